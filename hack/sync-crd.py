#!/usr/bin/env python3
"""Copies the TrainingJob CRD (crds/trainingjob.yaml, the single source) into the chart.

    hack/sync-crd.py           write charts/tfps/crds/trainingjob.yaml
    hack/sync-crd.py --check   exit 1 when the chart's copy is missing or stale

The copy is the source byte for byte under a header naming where it comes from, so a
stale copy is a plain text difference (tests/unit/test_chart.py runs --check).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "crds" / "trainingjob.yaml"
TARGET = REPO / "charts" / "tfps" / "crds" / "trainingjob.yaml"
HEADER = "# Generated from crds/trainingjob.yaml by hack/sync-crd.py: edit the source, then run it.\n"


def rendered(source: Path = SOURCE) -> str:
    return HEADER + source.read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the chart's copy is current")
    args = parser.parse_args(argv)
    if not SOURCE.is_file():
        print(f"sync-crd: {SOURCE.relative_to(REPO)} does not exist", file=sys.stderr)
        return 2
    want = rendered()
    have = TARGET.read_text() if TARGET.is_file() else None
    if args.check:
        if have != want:
            state = "missing" if have is None else "stale"
            print(f"sync-crd: {TARGET.relative_to(REPO)} is {state}; run hack/sync-crd.py", file=sys.stderr)
            return 1
        return 0
    if have != want:
        TARGET.parent.mkdir(parents=True, exist_ok=True)
        TARGET.write_text(want)
        print(f"sync-crd: wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
