"""`tfps bench --quick`: the whole benchmark end to end, in its shortest mode.

Real processes on 127.0.0.1: TensorFlow's ParameterServerStrategy (tf.distribute.Server
per task; Keras 2 for the embedding shape), the bytes-inclusive limit, the compute-only
ceiling, `tfps local` in async and sync mode, the wide-deep model on a small vocabulary with
SGD, Adam and Adam while checkpointing, a `tfps ps` for the goodput pair. Checks what a user
reads: every row of the report with numeric rates, bytes and memory, each goal marked met
or missed, and the machine it ran on. No timing is asserted.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from tfps.bench import report
from tfps.bench.procs import CPU_FIGURES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]


def _numeric(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_quick_bench_reports_every_ratio_with_numbers(tmp_path):
    out_file = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tfps.cli.main", "bench", "--quick", "--shapes", "670k", "--output", str(out_file)],
        capture_output=True, text=True, timeout=1440,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # the table a user reads
    text = proc.stdout
    for rdef in report.RATIOS:
        assert rdef.label in text
    assert "tfps PS push+pull / raw TCP" in text
    assert "669,706" in text  # the 5.8M shape runs the same code; the full `tfps bench` measures it
    assert "goal ≥ 1.6×" in text and "goal ≥ 1×" in text and "goal ≥ 0.85×" in text and "goal ≥ 0.4×" in text
    for label in [*report.EMBEDDING_SYSTEMS.values(), *(r.label for r in report.EMBEDDING_RATIOS)]:
        assert label in text
    assert "goal ≤ 1.2×" in text and "goal ≤ 1.3×" in text and "goal ≥ 10×" in text
    assert "0 not measured" in text
    assert "CPU per worker step" in text
    assert f"{os.cpu_count()} CPUs" in text  # the machine the figures came from

    # the same report as JSON
    out = json.loads(out_file.read_text())
    assert out["errors"] == []
    assert set(out["shapes"]) == {"670k"}
    assert out["machine"]["cpus"] == os.cpu_count() and len(out["machine"]["load_at_end"]) == 3
    for name, shape in out["shapes"].items():
        assert len(shape["repeats"]) == 1
        for system in report.SYSTEMS:
            assert _numeric(shape["medians"][system]), (name, system)
        _assert_cpu_measured(
            shape["medians"], ("limit", "limit_update_async", "limit_update_sync", "tfps_async", "tfps_sync")
        )
        for rdef in report.RATIOS:
            entry = shape["ratios"][rdef.key]
            assert _numeric(entry["median"]), (name, rdef.key)
            if rdef.goals.get(name) is not None:
                assert entry["met"] in (True, False)
                assert entry["text"].startswith("met" if entry["met"] else "missed by")
    goodput = out["goodput"]
    assert _numeric(goodput["median_mib_per_second"]["raw_tcp"])
    assert _numeric(goodput["median_mib_per_second"]["tfps"])
    assert _numeric(goodput["ratio"]["median"]) and goodput["ratio"]["met"] in (True, False)
    assert out["goals"]["not_measured"] == 0
    (emb,) = out["embedding"]["shapes"].values()
    for system in report.EMBEDDING_SYSTEMS:
        assert _numeric(emb["medians"][system]), system
    for key in (
        "tfps_sgd:wire_bytes_per_step",
        "tfps_adam:ps_peak_rss",
        "tfps_adam:worker_peak_rss",
        "limit:bytes_per_step",
        "tfps_adam_ckpt:longest_step",
        "tfps_adam_ckpt:p99_step",
        "state_adam:shard",
    ):
        assert _numeric(emb["medians"][key]), key
    _assert_cpu_measured(
        emb["medians"],
        (
            "limit",
            "limit_sharded",
            "limit_update_sgd",
            "limit_update_adam",
            "limit_update_sgd_sharded",
            "limit_update_adam_sharded",
            "tfps_sgd",
            "tfps_adam",
        ),
    )
    for shape in (*out["shapes"].values(), emb):  # the limit, measured on both sides of tfps's runs
        before, after = shape["medians"]["limit:before"], shape["medians"]["limit:after"]
        assert _numeric(before) and _numeric(after) and shape["medians"]["limit"] == pytest.approx((before + after) / 2)
    for rdef in report.EMBEDDING_RATIOS:
        assert _numeric(emb["ratios"][rdef.key]["median"]), rdef.key
    # 5 for the 670k shape, 8 for the embedding shape, 1 for goodput
    assert out["goals"]["met"] + out["goals"]["missed"] == 14
    assert _numeric(goodput["median_mib_per_second"]["grpc_echo"])


def _assert_cpu_measured(medians: dict, systems: tuple[str, ...]) -> None:
    """Each run's CPU per worker step, its workers' and its PS's (a limit's: its answering process's)."""
    for system in systems:
        for figure in CPU_FIGURES:
            assert _numeric(medians[f"{system}:{figure}"]) and medians[f"{system}:{figure}"] > 0, (system, figure)
