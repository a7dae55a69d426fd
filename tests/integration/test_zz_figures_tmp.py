import sys
sys.path.insert(0, "/work/main/tests/integration")
from test_prometheus import *  # noqa

def test_print_figures(scraped_run):
    api, namespace, run, _ = scraped_run
    time.sleep(10)
    sel = f'namespace="{namespace}", job="{JOB}"'
    for name, expr in [
        ("examples/s", f"sum(rate(tfps_worker_examples_total{{{sel}}}[20s]))"),
        ("global steps/s", f"max(deriv(tfps_ps_global_step{{{sel}}}[20s]))"),
        ("step p50", f"histogram_quantile(0.5, sum by (le) (rate(tfps_worker_step_seconds_bucket{{{sel}}}[20s])))"),
        ("step p99", f"histogram_quantile(0.99, sum by (le) (rate(tfps_worker_step_seconds_bucket{{{sel}}}[20s])))"),
        ("push p99", f"histogram_quantile(0.99, sum by (le) (rate(tfps_worker_push_seconds_bucket{{{sel}}}[20s])))"),
        ("apply p99", f"histogram_quantile(0.99, sum by (le) (rate(tfps_ps_apply_seconds_bucket{{{sel}}}[20s])))"),
        ("loss", f"avg(tfps_ps_loss{{{sel}}})"),
        ("series scraped", f"count({{{sel}}})"),
    ]:
        print(name, api.query(expr)["result"][0]["value"][1])
