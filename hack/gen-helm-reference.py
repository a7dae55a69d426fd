#!/usr/bin/env python3
"""Writes the Helm values reference from the chart's own files: every value's path, type and
bounds from charts/tfps/values.schema.json, its default and its `# --` comment from
charts/tfps/values.yaml (the schema's description where a value has no such comment).

The same table goes into docs/reference/helm-values.md and charts/tfps/README.md, between the
markers. `--check` exits 1 when either page is stale (a unit test runs it).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import marked_block  # noqa: E402  (hack/marked_block.py, beside this file)

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "tfps"
SCHEMA = CHART / "values.schema.json"
VALUES = CHART / "values.yaml"
PAGES = (REPO / "docs" / "reference" / "helm-values.md", CHART / "README.md")
START, END = "<!-- helm-values:start -->", "<!-- helm-values:end -->"
# Definitions named for what they hold rather than shown as their JSON type.
NAMED_TYPES = {"duration": "duration", "quantity": "quantity", "dns1123Label": "DNS-1123 label"}
LONGEST_DEFAULT = 60
_KEY = re.compile(r"^(\s*)([A-Za-z_][\w.-]*):")
_MISSING = object()


def value_comments(text: str) -> dict[str, str]:
    """Each value's `# --` comment (with the comment lines that follow it), by dotted path."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = [stripped[4:].strip()]
            continue
        if stripped.startswith("#"):
            if pending is not None:
                pending.append(stripped[1:].strip())
            continue
        m = _KEY.match(line)
        if not m:
            pending = None if not stripped else pending
            continue
        while stack and stack[-1][0] >= len(m.group(1)):
            stack.pop()
        stack.append((len(m.group(1)), m.group(2)))
        if pending is not None:
            out[".".join(k for _, k in stack)] = " ".join(p for p in pending if p)
        pending = None
    return out


class Schema:
    def __init__(self, schema: dict):
        self.definitions = schema.get("definitions", {})
        self.root = schema

    def resolve(self, node: dict) -> dict:
        while "$ref" in node:
            node = self.definitions[node["$ref"].rsplit("/", 1)[1]]
        return node

    def type(self, node: dict) -> str:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            return NAMED_TYPES.get(name) or self.type(self.definitions[name])
        if "const" in node:
            return f"`{json.dumps(node['const'])}`"
        if "oneOf" in node:
            return " or ".join(self.type(alt) for alt in node["oneOf"])
        t = node.get("type", "any")
        if t == "array":
            return f"[]{self.type(node['items'])}" if "items" in node else "[]any"
        if t == "object" and isinstance(node.get("additionalProperties"), dict) and "properties" not in node:
            return f"map[string]{self.type(node['additionalProperties'])}"
        return t

    def facts(self, node: dict) -> str:
        node = self.resolve(node)
        out = []
        if "enum" in node:
            out.append("one of " + ", ".join(f"`{json.dumps(v)}`" for v in node["enum"]))
        for key, word in (
            ("minimum", "≥"),
            ("exclusiveMinimum", ">"),
            ("maximum", "≤"),
            ("minLength", "length ≥"),
            ("maxLength", "length ≤"),
        ):
            if key in node:
                out.append(f"{word} {node[key]}")
        names = (node.get("propertyNames") or {}).get("enum")
        if names:
            out.append("keys: " + ", ".join(f"`{n}`" for n in names))
        return "; ".join(out)


def _default(values: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(values, dict) or key not in values:
            return _MISSING
        values = values[key]
    return values


def _cell(text: str) -> str:
    """One table cell: one line, `|` escaped, and `<` outside code spans written as an entity
    (Markdown would take `<release>` for an HTML tag and drop it)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts))


def rows(schema: Schema, node: dict, path: str, comments: dict, values: Any) -> list[tuple[str, ...]]:
    """One row per value: a leaf of the schema, or an object that values.yaml documents as a whole."""
    out = []
    for name, child in (schema.resolve(node).get("properties") or {}).items():
        child_path = f"{path}.{name}" if path else name
        resolved = schema.resolve(child)
        if resolved.get("properties") and child_path not in comments:
            out += rows(schema, child, child_path, comments, values)
            continue
        default = _default(values, child_path)
        shown = "" if default is _MISSING else json.dumps(default, ensure_ascii=False, separators=(", ", ": "))
        if len(shown) > LONGEST_DEFAULT:
            shown = "see `values.yaml`"
        elif shown:
            shown = f"`{shown}`"
        description = comments.get(child_path) or child.get("description") or resolved.get("description") or ""
        out.append((f"`{child_path}`", schema.type(child), shown, schema.facts(child), _cell(description)))
    return out


def render() -> str:
    schema = Schema(json.loads(SCHEMA.read_text()))
    values_text = VALUES.read_text()
    table = rows(schema, schema.root, "", value_comments(values_text), yaml.safe_load(values_text))
    lines = [
        START,
        "",
        "Generated from `charts/tfps/values.schema.json` and `charts/tfps/values.yaml` by "
        "`hack/gen-helm-reference.py`. The schema rejects unknown keys and mistyped values: "
        "`helm install` fails naming the value.",
        "",
        "| value | type | default | bounds | description |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    lines += ["", END]
    return "\n".join(lines)


def main() -> int:
    return marked_block.write(PAGES, START, END, render(), REPO, "Helm values reference", "hack/gen-helm-reference.py")


if __name__ == "__main__":
    sys.exit(main())
