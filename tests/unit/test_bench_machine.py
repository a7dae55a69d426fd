"""The machine a `tfps bench` report records: read from a /proc and /sys laid out under a
temporary root (the same files, in the kernel's formats), and from this machine's own."""

import io
import os

from rich.console import Console

from tfps.bench import machine, report
from tfps.bench.main import build_report

CPU = """vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 167
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 1
cpu MHz\t\t: 2599.996
flags\t\t: fpu vme de pse
"""
CPUINFO = f"processor\t: 0\n{CPU}\nprocessor\t: 1\n{CPU}"
CACHES = {
    "index0": ("1", "Data", "48K"),
    "index1": ("1", "Instruction", "32K"),
    "index2": ("2", "Unified", "2048K"),
    "index3": ("3", "Unified", "491520K"),
}


def fake_root(tmp_path):
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/cpuinfo").write_text(CPUINFO)
    (tmp_path / "proc/meminfo").write_text("MemTotal:       24570640 kB\nMemFree:        22000000 kB\n")
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.1.0-test\n")
    for index, (level, kind, size) in CACHES.items():
        folder = tmp_path / "sys/devices/system/cpu/cpu0/cache" / index
        folder.mkdir(parents=True)
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(value + "\n")
    return tmp_path


def test_describe_reads_cpu_memory_caches_and_kernel(tmp_path):
    described = machine.describe(fake_root(tmp_path))
    assert len(described.pop("load")) == 3  # this machine's: os.getloadavg
    assert described == {
        "cpu": "Intel(R) Xeon(R) Processor",
        "cpu_signature": "6/167/1",
        "mhz": 2600,
        "cpus": 2,
        "memory_gib": 23.4,
        "caches": {"L1d": "48K", "L2": "2048K", "L3": "491520K"},
        "kernel": "6.1.0-test",
    }


def test_what_cannot_be_read_is_none(tmp_path):
    described = machine.describe(tmp_path)
    described.pop("load")
    assert described == {
        "cpu": None,
        "cpu_signature": None,
        "mhz": None,
        "cpus": None,
        "memory_gib": None,
        "caches": {},
        "kernel": None,
    }


def test_this_machine():
    host = machine.describe()
    assert host["cpus"] == os.cpu_count()
    assert host["memory_gib"] > 0 and len(host["load"]) == 3


def test_the_report_carries_the_machine_and_prints_it(tmp_path):
    host = {**machine.describe(fake_root(tmp_path)), "load": [0.12, 0.34, 0.56], "load_at_end": [1.9, 1.5, 0.9]}
    out = build_report({"repeats": 1}, {}, None, [], 1.0, host=host)
    assert out["machine"] == host
    buf = io.StringIO()
    report.render(out, Console(file=buf, width=250, color_system=None))
    assert (
        "machine: Intel(R) Xeon(R) Processor (6/167/1, 2600 MHz), 2 CPUs, 23.4 GiB, "
        "L1d 48K, L2 2048K, L3 491520K, Linux 6.1.0-test; load average 0.12 at the start, 1.90 at the end"
    ) in buf.getvalue()
