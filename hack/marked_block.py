"""A generated block of a page: what stands between a start and an end marker, replaced whole
(the generators beside this file write their reference tables this way)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path


def write(pages: Sequence[Path], start: str, end: str, block: str, repo: Path, what: str, script: str) -> int:
    """Put `block` (its markers included) in place of each page's; with `--check` on the command
    line, write nothing and return 1 when a page is stale (`what` and `script` name the block and
    its generator in the message)."""
    stale = []
    for page in pages:
        text = page.read_text()
        if start not in text or end not in text:
            print(f"{page.relative_to(repo)} lacks the markers {start} ... {end}", file=sys.stderr)
            return 1
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        new = head + block + tail
        if new == text:
            continue
        if "--check" in sys.argv:
            stale.append(str(page.relative_to(repo)))
        else:
            page.write_text(new)
    if stale:
        print(f"stale {what} in {', '.join(stale)}: run {script}", file=sys.stderr)
        return 1
    return 0
