"""Training progress read from the PS pods' Prometheus metrics (status.progress)."""

from __future__ import annotations

import logging
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# Straight to the pod: never through an HTTP proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
STEP, LOSS, EXAMPLES = "tfps_ps_global_step", "tfps_ps_loss", "tfps_ps_examples_total"


@dataclass(frozen=True)
class Sample:
    step: int
    loss: float | None
    examples: float
    at: float  # monotonic seconds when read


def parse(text: str) -> dict[str, float]:
    """The PS metrics the status needs, from one /metrics page."""
    wanted = {STEP, LOSS, EXAMPLES}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = max(out.get(sample.name, float("-inf")), sample.value)
    return out


def combine(pages: list[dict[str, float]], at: float) -> Sample | None:
    """One reading for the job: every PS sees every step, so take the furthest one."""
    pages = [p for p in pages if STEP in p]
    if not pages:
        return None
    lead = max(pages, key=lambda p: p[STEP])
    return Sample(step=int(lead[STEP]), loss=lead.get(LOSS), examples=max(p.get(EXAMPLES, 0.0) for p in pages), at=at)


def to_status(sample: Sample, previous: Sample | None, now_iso: str) -> dict:
    progress: dict = {"step": sample.step, "updateTime": now_iso}
    if sample.loss is not None:
        progress["loss"] = round(sample.loss, 6)
    if previous is not None and sample.at > previous.at and sample.examples >= previous.examples:
        progress["examplesPerSecond"] = round((sample.examples - previous.examples) / (sample.at - previous.at), 3)
    return progress


def scrape(pod_ip: str, port: int, timeout: float = 2.0) -> dict[str, float] | None:
    url = f"http://{pod_ip}:{port}/metrics"
    try:
        with _OPENER.open(url, timeout=timeout) as resp:
            return parse(resp.read().decode())
    except (OSError, ValueError) as err:
        log.debug("metrics of %s unavailable: %s", url, err)
        return None
