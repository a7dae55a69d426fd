"""The Helm values reference (docs/reference/helm-values.md and the table in charts/tfps/README.md)
is generated from the chart's schema and values by hack/gen-helm-reference.py: it must be fresh,
list every value, and its --check must notice a stale page."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "gen-helm-reference.py"
PAGE = REPO / "docs" / "reference" / "helm-values.md"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_helm_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _schema_leaves(node: dict, definitions: dict, path: str = "") -> list[str]:
    out = []
    for name, child in (node.get("properties") or {}).items():
        child_path = f"{path}.{name}" if path else name
        while "$ref" in child:
            child = definitions[child["$ref"].rsplit("/", 1)[1]]
        out += _schema_leaves(child, definitions, child_path) if child.get("properties") else [child_path]
    return out


def test_helm_reference_is_fresh():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_value_of_the_schema_is_in_the_reference():
    schema = json.loads((REPO / "charts" / "tfps" / "values.schema.json").read_text())
    text = PAGE.read_text()
    missing = []
    for leaf in _schema_leaves(schema, schema.get("definitions", {})):
        # A value documented as a whole (runtime.resources) stands for the keys under it.
        parts = leaf.split(".")
        if not any(f"| `{'.'.join(parts[:i])}` |" in text for i in range(len(parts), 0, -1)):
            missing.append(leaf)
    assert not missing, missing


def test_reference_takes_defaults_and_comments_from_values_yaml():
    text = PAGE.read_text()
    assert '| `operator.image.repository` | string | `"tfps/operator"` | length ≥ 1 |' in text
    assert "| `runtime.ports.data` | integer | `2223` | ≥ 1; ≤ 65535 | Data-path port of every PS" in text
    assert "`TfpsPSApplyLatencyHigh`" in text  # the schema's propertyNames of prometheusRule.disabled
    assert "&lt;release>" in text  # not swallowed as an HTML tag


def test_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    gen = _generator()
    page = tmp_path / "page.md"
    page.write_text(f"# Values\n\n{gen.START}\n| stale | table |\n{gen.END}\n")
    monkeypatch.setattr(gen, "PAGES", (page,))
    monkeypatch.setattr(gen, "REPO", tmp_path)
    monkeypatch.setattr(sys, "argv", ["gen-helm-reference.py", "--check"])
    assert gen.main() == 1
    assert "stale" in page.read_text()  # --check writes nothing
    monkeypatch.setattr(sys, "argv", ["gen-helm-reference.py"])
    assert gen.main() == 0
    monkeypatch.setattr(sys, "argv", ["gen-helm-reference.py", "--check"])
    assert gen.main() == 0 and "`monitoring.podMonitor.enabled`" in page.read_text()


def test_value_comments_are_read_with_their_continuation_lines():
    gen = _generator()
    comments = gen.value_comments(
        "a:\n  # not this\n  # -- First line\n  # second line.\n  b: 1\n  c: 2\n# -- Top.\nd: {}\n"
    )
    assert comments == {"a.b": "First line second line.", "d": "Top."}
