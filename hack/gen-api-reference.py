#!/usr/bin/env python3
"""Writes the TrainingJob reference, docs/reference/trainingjob.md, from the CRD's descriptions
(crds/ is the one source). `--check` exits 1 when the page is stale (a unit test runs it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import marked_block  # noqa: E402  (hack/marked_block.py, beside this file)

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "trainingjob.yaml"
PAGE = REPO / "docs" / "reference" / "trainingjob.md"
START, END = "<!-- api-reference:start -->", "<!-- api-reference:end -->"


def _type(node: dict) -> str:
    t = node.get("type", "object" if node.get("x-kubernetes-preserve-unknown-fields") else "")
    if t == "array":
        return f"[]{_type(node.get('items', {}))}"
    if t == "object" and "additionalProperties" in node:
        return f"map[string]{_type(node['additionalProperties'])}"
    return t or "any"


def _facts(node: dict) -> str:
    out = []
    if "default" in node:
        out.append(f"default `{json.dumps(node['default'])}`")
    if "enum" in node:
        out.append("one of " + ", ".join(f"`{v}`" if v != "" else '`""`' for v in node["enum"]))
    for key, word in (
        ("minimum", "≥"),
        ("maximum", "≤"),
        ("maxLength", "length ≤"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
        ("minProperties", "entries ≥"),
    ):
        if key in node:
            out.append(f"{word} {node[key]}")
    return "; ".join(out)


def _cell(text: str) -> str:
    """One table cell: one line, `|` escaped, and `<` outside code spans written as an entity
    (Markdown would take `<job>` for an HTML tag and drop it)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def rows(node: dict, path: str) -> list[tuple[str, str, str, str]]:
    out = []
    for name, child in (node.get("properties") or {}).items():
        child_path = f"{path}.{name}" if path else name
        desc = _cell(child.get("description") or "")
        out.append((child_path, _type(child), _facts(child), desc))
        out += rows(child.get("items", child), child_path + ("[]" if "items" in child else ""))
    return out


def rules(node: dict, path: str) -> list[tuple[str, str]]:
    out = [(path or "(root)", r.get("message") or r["rule"]) for r in node.get("x-kubernetes-validations") or []]
    for name, child in (node.get("properties") or {}).items():
        out += rules(child, f"{path}.{name}" if path else name)
    return out


def render() -> str:
    crd = next(d for d in yaml.safe_load_all(CRD.read_text()) if d and d.get("kind") == "CustomResourceDefinition")
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    lines = [
        START,
        "",
        f"Generated from `crds/trainingjob.yaml` by `hack/gen-api-reference.py` "
        f"(`{crd['spec']['group']}/{version['name']}`, kind `{crd['spec']['names']['kind']}`, "
        f"short name `{crd['spec']['names']['shortNames'][0]}`).",
        "",
    ]
    for section in ("spec", "status"):
        lines += [f"## `{section}`", "", "| field | type | default / bounds | description |", "|---|---|---|---|"]
        lines += [f"| `{p}` | {t} | {f} | {d} |" for p, t, f, d in rows(schema["properties"][section], "")]
        lines.append("")
    checks = rules(schema, "")
    if checks:
        lines += ["## Rules checked by the API server (CEL)", ""]
        lines += [f"- `{p}`: {m}" for p, m in checks]
        lines.append("")
    lines.append(END)
    return "\n".join(lines)


def main() -> int:
    return marked_block.write([PAGE], START, END, render(), REPO, "API reference", "hack/gen-api-reference.py")


if __name__ == "__main__":
    sys.exit(main())
