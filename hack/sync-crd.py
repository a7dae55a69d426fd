#!/usr/bin/env python3
"""Copies the CRDs (crds/*.yaml, the single source) into the chart's crds/ folder.

    hack/sync-crd.py           write charts/tfps/crds/<same names>
    hack/sync-crd.py --check   exit 1 when a chart copy is missing, stale, or has no source

Each copy is its source byte for byte under a header naming where it comes from, so a stale
copy is a plain text difference (tests/unit/test_chart.py runs --check).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE_DIR = REPO / "crds"
TARGET_DIR = REPO / "charts" / "tfps" / "crds"


def header(name: str) -> str:
    return f"# Generated from crds/{name} by hack/sync-crd.py: edit the source, then run it.\n"


def wanted() -> dict[str, str]:
    """Chart file name -> its content."""
    return {src.name: header(src.name) + src.read_text() for src in sorted(SOURCE_DIR.glob("*.yaml"))}


def problems(want: dict[str, str]) -> list[str]:
    found = []
    for name, text in want.items():
        target = TARGET_DIR / name
        if not target.is_file():
            found.append(f"charts/tfps/crds/{name} is missing")
        elif target.read_text() != text:
            found.append(f"charts/tfps/crds/{name} is stale")
    for target in sorted(TARGET_DIR.glob("*.yaml")):
        if target.name not in want:
            found.append(f"charts/tfps/crds/{target.name} has no source in crds/")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the chart's copies are current")
    args = parser.parse_args(argv)
    want = wanted()
    if "trainingjob.yaml" not in want:
        print("sync-crd: crds/trainingjob.yaml does not exist", file=sys.stderr)
        return 2
    if args.check:
        found = problems(want)
        for line in found:
            print(f"sync-crd: {line}; run hack/sync-crd.py", file=sys.stderr)
        return 1 if found else 0
    TARGET_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in want.items():
        target = TARGET_DIR / name
        if not target.is_file() or target.read_text() != text:
            target.write_text(text)
            print(f"sync-crd: wrote charts/tfps/crds/{name}")
    for target in TARGET_DIR.glob("*.yaml"):
        if target.name not in want:
            target.unlink()
            print(f"sync-crd: removed charts/tfps/crds/{target.name} (no source)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
