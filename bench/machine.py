"""The machine a benchmark ran on, as its report records it.

Ratios measured in one run are paired, but they still move with the machine, anchors and
tfps's share of them alike, from one run to the next on the same virtual machine. A report says
which machine it came from and how busy that machine was when the run began (a quiet one
starts near 0).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def describe(root: Path = Path("/")) -> dict[str, Any]:
    """CPU model and count, memory, CPU caches and kernel, read from /proc and /sys under
    `root`, and this machine's load average; a field that cannot be read is None."""
    cpuinfo = _read(root / "proc/cpuinfo") or ""
    first = _fields(cpuinfo.split("\n\n")[0])  # the first CPU's
    signature = [first.get(k) for k in ("cpu family", "model", "stepping")]
    mhz = first.get("cpu MHz")
    meminfo = _read(root / "proc/meminfo") or ""
    mem_kib = next((int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemTotal:")), None)
    return {
        "cpu": first.get("model name"),
        # a virtual machine's model name is often generic: family/model/stepping tell its hosts apart
        "cpu_signature": "/".join(signature) if all(signature) else None,
        "mhz": round(float(mhz)) if mhz and mhz.replace(".", "", 1).isdigit() else None,
        "cpus": sum(1 for line in cpuinfo.splitlines() if line.startswith("processor")) or None,
        "memory_gib": None if mem_kib is None else round(mem_kib / (1 << 20), 1),
        "caches": _caches(root / "sys/devices/system/cpu/cpu0/cache"),
        "kernel": _read(root / "proc/sys/kernel/osrelease"),
        "load": load(),
    }


def load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this system
        return None


def _fields(block: str) -> dict[str, str]:
    """`key : value` lines (a /proc/cpuinfo block)."""
    pairs = (line.split(":", 1) for line in block.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def _caches(folder: Path) -> dict[str, str]:
    """{"L1d": "48K", "L2": "2048K", "L3": "491520K"}: one CPU's view of each cache (size per instance)."""
    out = {}
    for index in sorted(folder.glob("index*")):
        level, kind, size = (_read(index / name) for name in ("level", "type", "size"))
        if level and size and kind != "Instruction":
            out[f"L{level}{'d' if kind == 'Data' else ''}"] = size
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
