"""`tfps bench`'s pure parts: paired ratios, medians, goals, the report and its table."""
import io

import pytest
from rich.console import Console

from tfps.bench import report
from tfps.bench.main import build_report

SHAPE_670K = [
    {"ceiling": 20000.0, "tf_pss": 6000.0, "tfps_async": 12000.0, "tfps_sync": 6600.0, "tfps_async_bf16": 13000.0},
    {"ceiling": 10000.0, "tf_pss": 3000.0, "tfps_async": 4500.0, "tfps_sync": 2700.0, "tfps_async_bf16": 5000.0},
    {"ceiling": 18000.0, "tf_pss": 5000.0, "tfps_async": 9000.0, "tfps_sync": None, "tfps_async_bf16": 10000.0},
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
    assert out["median_examples_per_second"]["ceiling"] == 18000.0


def test_goals_met_and_missed_by_percent():
    out = report.summarize_shape("670k", SHAPE_670K)["ratios"]
    assert out["async_vs_tf"]["met"] is True and out["async_vs_tf"]["goal"] == 1.6
    ceiling = out["async_vs_ceiling"]  # median of 0.6, 0.45, 0.5 = 0.5 against 0.75
    assert ceiling["median"] == pytest.approx(0.5)
    assert ceiling["met"] is False
    assert ceiling["missed_by_pct"] == pytest.approx(33.3)
    assert ceiling["text"] == "missed by 33% (goal ≥ 0.75×)"
    assert out["tf_vs_ceiling"]["goal"] is None and out["tf_vs_ceiling"]["text"] == ""


def test_goals_differ_per_shape():
    out = report.summarize_shape("5.8M", SHAPE_670K)["ratios"]
    assert out["async_vs_tf"]["goal"] == 1.1
    assert out["sync_vs_tf"]["goal"] is None


def test_verdict_edge_cases():
    assert report.verdict(1.6, 1.6)["met"] is True
    assert report.verdict(None, 1.6) == {"goal": 1.6, "met": None, "missed_by_pct": None, "text": "not measured (goal ≥ 1.6×)"}
    assert report.ratio(5.0, 0.0) is None
    assert report.ratio(None, 3.0) is None
    assert report.median([None, None]) is None
    assert report.median([3.0, None, 1.0, 2.0]) == 2.0


def test_goodput_ratio_and_goal():
    out = report.summarize_goodput([{"raw_tcp": 2000.0, "tfps": 900.0}, {"raw_tcp": 3000.0, "tfps": 900.0}, {"raw_tcp": 2500.0, "tfps": 1000.0}])
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
    rows = {"670k": SHAPE_670K, "5.8M": [{"ceiling": 1200.0, "tf_pss": 900.0, "tfps_async": 950.0, "tfps_sync": 800.0, "tfps_async_bf16": 1000.0}]}
    goodput = [{"raw_tcp": 3000.0, "tfps": 600.0, "grpc_echo": 900.0}]
    return build_report({"repeats": 3}, rows, goodput, list(errors), 12.0)


def test_report_counts_goals():
    out = _full_report()
    # 670k: async/TF met, sync/TF met, async/ceiling missed, bf16/TF met (2.0), bf16/ceiling missed (0.56);
    # 5.8M: async/TF missed (1.06), async/ceiling met (0.79), bf16/TF met (1.11), bf16/ceiling met (0.83);
    # goodput missed (0.2)
    assert out["goals"] == {"met": 6, "missed": 4, "not_measured": 0}
    assert out["shapes"]["5.8M"]["config"] == {"params": 5_824_522, "layers": [784, 2048, 2048, 10], "batch": 128, "workers": 2, "ps": 2}


def test_table_has_every_row_and_goal():
    buf = io.StringIO()
    report.render(_full_report(["5.8M tfps_sync: boom"]), Console(file=buf, width=250, color_system=None))
    text = buf.getvalue()
    for label in [r.label for r in report.RATIOS] + ["tfps PS push+pull / raw TCP"]:
        assert label in text
    for label in report.SYSTEMS.values():
        assert label in text
    assert "669,706" in text and "5,824,522" in text
    assert "missed by 33% (goal ≥ 0.75×)" in text
    assert "measurement failed: 5.8M tfps_sync: boom" in text
    assert "goals: 6 met, 4 missed, 0 not measured" in text
    assert "grpcio alone (echo) / raw TCP" in text
