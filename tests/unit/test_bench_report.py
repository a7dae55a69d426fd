"""`tfps bench`'s pure parts: paired ratios, medians, goals, the report and its table."""

import io

import pytest
from rich.console import Console

from tfps.bench import report
from tfps.bench.main import build_report

SHAPE_670K = [
    {
        "limit": 15000.0,
        "limit_update_async": 13500.0,
        "limit_update_sync": 11000.0,
        "ceiling": 20000.0,
        "tf_pss": 6000.0,
        "tfps_async": 12000.0,
        "tfps_sync": 6600.0,
        "tfps_async_bf16": 13000.0,
    },
    {
        "limit": 8000.0,
        "limit_update_async": 6000.0,
        "limit_update_sync": 3000.0,
        "ceiling": 10000.0,
        "tf_pss": 3000.0,
        "tfps_async": 4500.0,
        "tfps_sync": 2700.0,
        "tfps_async_bf16": 5000.0,
    },
    {
        "limit": 12000.0,
        "limit_update_async": 10000.0,
        "limit_update_sync": 9000.0,
        "ceiling": 18000.0,
        "tf_pss": 5000.0,
        "tfps_async": 9000.0,
        "tfps_sync": None,
        "tfps_async_bf16": 10000.0,
    },
]


def test_ratios_are_paired_within_a_repeat_then_medianed():
    out = report.summarize_shape("670k", SHAPE_670K)
    async_vs_tf = out["ratios"]["async_vs_tf"]
    assert async_vs_tf["values"] == pytest.approx([2.0, 1.5, 1.8])
    assert async_vs_tf["median"] == pytest.approx(1.8)
    # the ratio of the medians would differ (9000/5000 = 1.8 here, by chance); check one that does
    sync = out["ratios"]["sync_vs_tf"]
    assert sync["values"][2] is None  # a failed measurement gives no ratio...
    assert sync["median"] == pytest.approx((1.1 + 0.9) / 2)  # ...and the median uses the others
    assert out["medians"]["ceiling"] == 18000.0


def test_goals_met_and_missed_by_percent():
    out = report.summarize_shape("670k", SHAPE_670K)["ratios"]
    assert out["async_vs_tf"]["met"] is True and out["async_vs_tf"]["goal"] == 1.6
    limit = out["async_vs_limit"]  # median of 0.8, 0.5625, 0.75 = 0.75 against 0.85
    assert limit["median"] == pytest.approx(0.75)
    assert limit["met"] is False
    assert limit["missed_by_pct"] == pytest.approx(11.8)
    assert limit["text"] == "missed by 12% (goal ≥ 0.85×)"
    # the compute-only ceiling is a reference without a goal
    assert out["async_vs_ceiling"]["median"] == pytest.approx(0.5) and out["async_vs_ceiling"]["goal"] is None
    assert out["tf_vs_ceiling"]["goal"] is None and out["tf_vs_ceiling"]["text"] == ""


def test_the_limit_with_the_update_is_a_paired_reference_without_a_goal():
    out = report.summarize_shape("670k", SHAPE_670K)["ratios"]
    # what the update costs: 13500/15000, 6000/8000, 10000/12000
    assert out["limit_update_async_vs_limit"]["values"] == pytest.approx([0.9, 0.75, 10000 / 12000])
    # tfps against a PS with no cost beyond the bytes and the update: 12000/13500, 4500/6000, 9000/10000
    assert out["async_vs_limit_update"]["median"] == pytest.approx(12000 / 13500)
    assert out["sync_vs_limit_update"]["values"] == pytest.approx([0.6, 0.9, None])
    for key in (
        "async_vs_limit_update",
        "sync_vs_limit_update",
        "limit_update_async_vs_limit",
        "limit_update_sync_vs_limit",
    ):
        assert out[key]["goal"] is None and out[key]["text"] == ""


def test_goals_differ_per_shape():
    out = report.summarize_shape("5.8M", SHAPE_670K)["ratios"]
    assert out["async_vs_tf"]["goal"] == 1.1
    assert out["sync_vs_tf"]["goal"] is None


def test_verdict_edge_cases():
    assert report.verdict(1.6, 1.6)["met"] is True
    assert report.verdict(None, 1.6) == {
        "goal": 1.6,
        "met": None,
        "missed_by_pct": None,
        "text": "not measured (goal ≥ 1.6×)",
    }
    assert report.ratio(5.0, 0.0) is None
    assert report.ratio(None, 3.0) is None
    assert report.median([None, None]) is None
    assert report.median([3.0, None, 1.0, 2.0]) == 2.0


def test_goodput_ratio_and_goal():
    out = report.summarize_goodput(
        [{"raw_tcp": 2000.0, "tfps": 900.0}, {"raw_tcp": 3000.0, "tfps": 900.0}, {"raw_tcp": 2500.0, "tfps": 1000.0}]
    )
    assert out["ratio"]["values"] == pytest.approx([0.45, 0.3, 0.4])
    assert out["ratio"]["median"] == pytest.approx(0.4)
    assert out["ratio"]["met"] is True
    assert out["median_mib_per_second"] == {"raw_tcp": 2500.0, "tfps": 900.0, "grpc_echo": None}


def test_goodput_places_grpcio_alone_between_tfps_and_raw_tcp():
    out = report.summarize_goodput([{"raw_tcp": 4000.0, "tfps": 600.0, "grpc_echo": 1200.0}])
    assert out["grpc_ratio"]["median"] == pytest.approx(0.3)
    assert out["tfps_vs_grpc"]["median"] == pytest.approx(0.5)
    assert out["grpc_ratio"]["goal"] is None  # context, not a goal


def _full_report(errors=()):
    rows = {
        "670k": SHAPE_670K,
        "5.8M": [
            {
                "limit": 1100.0,
                "ceiling": 1200.0,
                "tf_pss": 900.0,
                "tfps_async": 950.0,
                "tfps_sync": 800.0,
                "tfps_async_bf16": 1000.0,
            }
        ],
    }
    goodput = [{"raw_tcp": 3000.0, "tfps": 600.0, "grpc_echo": 900.0}]
    return build_report({"repeats": 3}, rows, goodput, list(errors), 12.0)


def test_report_counts_goals():
    out = _full_report()
    # 670k: async/limit missed (0.75), sync/limit missed (0.39), async/TF met, sync/TF met (1.0), bf16/TF met (2.0);
    # 5.8M: async/limit met (0.86), sync/limit missed (0.73), async/TF missed (1.06), bf16/TF met (1.11);
    # goodput missed (0.2)
    assert out["goals"] == {"met": 5, "missed": 5, "not_measured": 0}
    assert out["shapes"]["5.8M"]["config"] == {
        "params": 5_824_522,
        "layers": [784, 2048, 2048, 10],
        "batch": 128,
        "workers": 2,
        "ps": 2,
    }


def test_table_has_every_row_and_goal():
    buf = io.StringIO()
    report.render(_full_report(["5.8M tfps_sync: boom"]), Console(file=buf, width=250, color_system=None))
    text = buf.getvalue()
    for label in [r.label for r in report.RATIOS] + ["tfps PS push+pull / raw TCP"]:
        assert label in text
    for label in report.SYSTEMS.values():
        assert label in text
    assert "669,706" in text and "5,824,522" in text
    assert "missed by 12% (goal ≥ 0.85×)" in text
    assert "measurement failed: 5.8M tfps_sync: boom" in text
    assert "goals: 5 met, 5 missed, 0 not measured" in text
    assert "grpcio alone (echo) / raw TCP" in text


MIB = 1 << 20
EMBEDDING_2M = {
    "limit": 50000.0,
    "limit:bytes_per_step": 1.0 * MIB,
    "tf_pss_sgd": 2000.0,
    "tfps_sgd": 42000.0,
    "tfps_sgd:wire_bytes_per_step": 1.1 * MIB,
    "tfps_sgd:ps_peak_rss": 900.0 * MIB,
    "state_sgd:shard": 260.0 * MIB,
    "tfps_sgd:worker_peak_rss": 700.0 * MIB,
    "tf_pss_adam": 800.0,
    "tfps_adam": 30000.0,
    "tfps_adam:wire_bytes_per_step": 1.3 * MIB,
    "tfps_adam:ps_peak_rss": 1000.0 * MIB,
    "state_adam:shard": 780.0 * MIB,
    "tfps_adam:worker_peak_rss": 700.0 * MIB,
    "tfps_adam:longest_step": 0.2,
    "tfps_adam:p99_step": 0.02,
    "tfps_adam_ckpt": 29000.0,
    "tf_pss_adam:ps_peak_rss": 2345.0 * MIB,
    "tfps_adam_ckpt:longest_step": 0.5,
    "tfps_adam_ckpt:p99_step": 0.03,
    "limit_update_sgd": 46000.0,
    "limit_update_adam": 35000.0,
}


def test_embedding_goals_at_least_and_at_most():
    out = report.summarize_shape("2M", [EMBEDDING_2M], report.EMBEDDING_RATIOS)["ratios"]
    assert out["sgd_vs_limit"]["median"] == pytest.approx(0.84) and out["sgd_vs_limit"]["met"] is True
    assert out["sgd_vs_tf"]["median"] == pytest.approx(21.0) and out["sgd_vs_tf"]["text"] == "met (goal ≥ 10×)"
    # bytes and memory: lower is better
    assert out["sgd_wire"]["met"] is True and out["sgd_wire"]["text"] == "met (goal ≤ 1.2×)"
    assert out["adam_wire"]["median"] == pytest.approx(1.3) and out["adam_wire"]["text"] == "missed by 8% (goal ≤ 1.2×)"
    assert out["adam_ps_rss"]["median"] == pytest.approx(1000 / 780) and out["adam_ps_rss"]["met"] is True
    assert out["sgd_ps_rss"]["met"] is False
    assert out["checkpoint_stall"]["median"] == pytest.approx(2.5) and out["checkpoint_stall"]["goal"] is None
    assert out["checkpoint_stall_p99"]["median"] == pytest.approx(1.5) and out["checkpoint_stall_p99"]["goal"] is None
    # the limit with the update: references, no goals
    assert (
        out["adam_vs_limit_update"]["median"] == pytest.approx(30000 / 35000)
        and out["adam_vs_limit_update"]["goal"] is None
    )
    assert (
        out["limit_update_sgd_vs_limit"]["median"] == pytest.approx(0.92)
        and out["limit_update_sgd_vs_limit"]["text"] == ""
    )


def test_scale_ratios_pair_the_large_table_with_the_small_one_repeat_by_repeat():
    big = [
        {**EMBEDDING_2M, "tfps_sgd": 40000.0, "tfps_sgd:worker_peak_rss": 720.0 * MIB},
        {**EMBEDDING_2M, "tfps_sgd": 20000.0, "tfps_sgd:worker_peak_rss": 1400.0 * MIB},
    ]
    small = [EMBEDDING_2M, {**EMBEDDING_2M, "tfps_sgd": 40000.0}]
    out = report.summarize_scale({"10M": big, "2M": small})
    assert out["sgd_examples"]["values"] == pytest.approx([40000 / 42000, 0.5])
    assert out["sgd_worker_rss"]["values"] == pytest.approx([720 / 700, 2.0])
    assert report.summarize_scale({"2M": small}) is None


def test_report_with_embedding_shapes_renders_them_and_counts_their_goals():
    rows = {"2M": [EMBEDDING_2M], "10M": [{**EMBEDDING_2M, "tfps_sgd": 30000.0}]}
    out = build_report({"repeats": 1}, {}, None, [], 1.0, rows)
    assert out["embedding"]["shapes"]["10M"]["config"]["vocab"] == 10_000_000
    assert out["embedding"]["scale"]["sgd_examples"]["median"] == pytest.approx(30000 / 42000)
    counted = out["goals"]["met"] + out["goals"]["missed"]
    assert counted == 2 * 8 + 4  # per shape 4 goals for each optimizer; 4 across the shapes
    buf = io.StringIO()
    report.render(out, Console(file=buf, width=250, color_system=None))
    text = buf.getvalue()
    for label in [
        *report.EMBEDDING_SYSTEMS.values(),
        *(r.label for r in report.EMBEDDING_RATIOS),
        *(r.label for r in report.SCALE_RATIOS),
    ]:
        assert label in text
    assert "goal ≤ 1.3×" in text and "goal ≥ 10×" in text
    # TF's PS peak RSS next to the same shard state as tfps's
    tf_adam = next(line for line in text.splitlines() if "TF strategy, Adam" in line and "2M" in line)
    assert "2,345" in tf_adam and "780" in tf_adam


def test_cpu_table_lists_the_runs_that_measured_their_cpu():
    rows = {
        "2M": [
            {
                **EMBEDDING_2M,
                "limit:worker_cpu_ms_per_step": 2.45,
                "limit:ps_cpu_ms_per_step": 0.1,
                "tfps_sgd:worker_cpu_ms_per_step": 2.92,
                "tfps_sgd:ps_cpu_ms_per_step": 0.92,
            }
        ]
    }
    buf = io.StringIO()
    report.render(
        build_report({"repeats": 1}, {}, None, [], 1.0, rows), Console(file=buf, width=250, color_system=None)
    )
    text = buf.getvalue()
    table = text[text.index("CPU per worker step") : text.index(report.CPU_LEGEND[:40])]
    tfps = next(line for line in table.splitlines() if "tfps async, SGD" in line)
    assert "2.92" in tfps and "0.92" in tfps and "3.84" in tfps  # workers, PS, total
    assert any("bytes-inclusive limit" in line and "2.55" in line for line in table.splitlines())
    assert "tfps async, Adam" not in table  # it did not measure its CPU
    buf = io.StringIO()
    report.render(
        build_report({"repeats": 1}, {}, None, [], 1.0, {"2M": [EMBEDDING_2M]}),
        Console(file=buf, width=250, color_system=None),
    )
    assert "CPU per worker step" not in buf.getvalue()
