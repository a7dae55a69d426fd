"""The metadata every object the operator creates for a job carries: its name and namespace,
the job's labels, and the owner reference that lets the garbage collector delete it with the job."""

from __future__ import annotations

from typing import Any

from tfps.api import naming
from tfps.api.spec import API_GROUP, API_VERSION, KIND, TrainingJob


def owner_reference(job: TrainingJob) -> list[dict[str, Any]]:
    uid = job.metadata.get("uid")
    if not uid:  # `tfps render` of a manifest that was never applied
        return []
    return [
        {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": KIND,
            "name": job.name,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def job_labels(job: TrainingJob) -> dict[str, str]:
    return {naming.LABEL_JOB: job.name, naming.LABEL_MANAGED_BY: naming.MANAGED_BY}


def object_meta(
    job: TrainingJob, name: str, labels: dict[str, str] | None = None, template: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`labels` (default: the job's) win over the template's; the template's annotations are kept."""
    template = template or {}
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.namespace,
        "labels": {**template.get("labels", {}), **(labels if labels is not None else job_labels(job))},
    }
    if template.get("annotations"):
        meta["annotations"] = dict(template["annotations"])
    owners = owner_reference(job)
    if owners:
        meta["ownerReferences"] = owners
    return meta
