"""A job the cluster cannot place: the real scheduler leaves a worker asking for more
nvidia.com/gpu than the node advertises (4) Pending, and the operator says why."""

from __future__ import annotations

import pytest
from conftest import job_manifest
from support import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOO_MANY_GPUS = {"spec": {"containers": [{"name": "tensorflow", "resources": {"limits": {"nvidia.com/gpu": 64}}}]}}


def test_impossible_gpu_request_is_explained_in_status_and_events(tfps_operator):
    op = tfps_operator
    body = job_manifest("gpus", ps=1, workers=1, template=TOO_MANY_GPUS)
    body["spec"]["replicaSpecs"]["PS"]["template"] = {"spec": {"nodeSelector": {"tfps.io/test": "never"}}}
    op.create(body)
    running = wait_for(
        "the Running condition to explain the wait",
        lambda: (c := op.condition("gpus", "Running")) and c.get("reason") == "Unschedulable" and c,
        timeout=60,
    )
    assert running["status"] == "False"
    assert "gpus-worker-0" in running["message"] and "nvidia.com/gpu" in running["message"]
    assert op.status("gpus")["phase"] == "Pending"
    wait_for("an Unschedulable Event", lambda: "Unschedulable" in {r for r, _ in op.events("gpus")})
