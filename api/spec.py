"""The TrainingJob spec types, their defaults, and reading a manifest.

The one definition of the API's shape on the Python side: the operator's pod builders,
`tfps local` and the PS/worker entry points all use these. Field names are the
manifest's (camelCase) through aliases; Python code uses snake_case.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

API_GROUP = "tfps.io"
API_VERSION = "v1alpha1"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
# spec.training.model: one of these (runtime/models.py builds them) or `package.module:function`.
BUILT_IN_MODELS = ("digits-mlp", "mlp", "wide-deep")
MODEL_FUNCTION_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class _Model(BaseModel):
    # defer_build: a model's validator is built when first used, so a PS builds only those of
    # the spec parts it reads.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", defer_build=True)

    def to_manifest(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ReplicaType(StrEnum):
    PS = "PS"
    WORKER = "Worker"
    CHIEF = "Chief"
    EVALUATOR = "Evaluator"

    @property
    def task_type(self) -> str:
        """The TF_CONFIG task type and the name segment of pods (`ps`, `worker`, ...)."""
        return self.value.lower()


class RestartPolicy(StrEnum):
    ALWAYS = "Always"
    ON_FAILURE = "OnFailure"
    NEVER = "Never"
    EXIT_CODE = "ExitCode"  # TFJob semantics: exit codes >= 128 are retryable


class ConsistencyMode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"
    BOUNDED = "bounded"


class OptimizerName(StrEnum):
    SGD = "sgd"
    MOMENTUM = "momentum"
    ADAM = "adam"
    ADAGRAD = "adagrad"


class WireDtype(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class CleanPodPolicy(StrEnum):
    RUNNING = "Running"
    ALL = "All"
    NONE = "None"


class SuccessPolicy(StrEnum):
    DEFAULT = ""  # Chief when present, else worker 0
    ALL_WORKERS = "AllWorkers"


class ReplicaSpec(_Model):
    replicas: int = Field(1, ge=0)
    restart_policy: RestartPolicy = RestartPolicy.ON_FAILURE
    template: dict[str, Any] = Field(default_factory=dict)


class OptimizerSpec(_Model):
    name: OptimizerName = OptimizerName.ADAM
    learning_rate: float = Field(0.001, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)  # momentum optimizer only
    beta1: float = Field(0.9, ge=0, lt=1)  # adam only
    beta2: float = Field(0.999, ge=0, lt=1)  # adam only
    epsilon: float = Field(1e-7, gt=0)  # adam only
    initial_accumulator: float = Field(0.1, ge=0)  # adagrad only


class ConsistencySpec(_Model):
    mode: ConsistencyMode = ConsistencyMode.SYNC
    staleness: int = Field(4, ge=0)  # bounded only: versions a worker may fall behind


class CheckpointSpec(_Model):
    path: str | None = None
    # By time, as TF's Estimator did: a checkpoint's cost is the same whatever a step costs.
    every_seconds: int = Field(600, ge=1)
    every_steps: int | None = Field(None, ge=1)  # also, when set: whichever is due first


class DataFormat(StrEnum):
    TFRECORD = "tfrecord"
    PARQUET = "parquet"
    CSV = "csv"


class BadRecordPolicy(StrEnum):
    SKIP = "skip"  # dropped and counted (tfps_worker_bad_records_total)
    FAIL = "fail"  # the worker fails, naming the file


# Per format, the compressions its reader takes (Parquet's own is inside the file).
COMPRESSIONS = {DataFormat.TFRECORD: ("GZIP", "ZLIB"), DataFormat.CSV: ("gzip",), DataFormat.PARQUET: ()}
FEATURE_DTYPES = ("float32", "float64", "int32", "int64", "string")


class DataSource(_Model):
    files: str = Field(min_length=1)  # a glob, on a volume every worker mounts
    format: DataFormat
    compression: str | None = None

    @model_validator(mode="after")
    def _known_compression(self) -> DataSource:
        allowed = COMPRESSIONS[self.format]
        if self.compression is not None and self.compression not in allowed:
            raise ValueError(
                f"compression {self.compression!r}: {self.format.value} takes "
                + (", ".join(allowed) if allowed else "none (Parquet's compression is inside the file)")
            )
        return self


class FeatureSpec(_Model):
    dtype: str
    shape: list[int] = Field(default_factory=list)  # per example; [] is a scalar

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, dtype: str) -> str:
        if dtype not in FEATURE_DTYPES:
            raise ValueError(f"must be one of {', '.join(FEATURE_DTYPES)}")
        return dtype


class DataSpec(_Model):
    """Training (and evaluation) examples read from files by the workers (runtime/filedata.py)."""

    train: DataSource
    eval: DataSource | None = None
    label: str = Field(min_length=1)
    features: dict[str, FeatureSpec] | None = None  # default: the model's inputs
    shuffle_buffer: int = Field(10_000, ge=0)
    epochs: int | None = Field(None, ge=1)  # default: repeat until training.steps
    on_bad_record: BadRecordPolicy = BadRecordPolicy.FAIL


class TrainingSpec(_Model):
    model: str = "digits-mlp"  # BUILT_IN_MODELS or `package.module:function`, checked at admission too
    model_args: dict[str, Any] = Field(default_factory=dict)
    # Directories searched first for the model's module (a ConfigMap or volume mounted in the pods).
    module_path: list[str] | None = None
    seed: int = 0
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    batch_size: int = Field(64, ge=1)
    steps: int = Field(1000, ge=1)
    consistency: ConsistencySpec = Field(default_factory=ConsistencySpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    export_path: str | None = None  # SavedModel of the final parameters, written on success
    tls: bool = False  # workers reach the PS over TLS with the job's certificate (runtime/auth.py)
    wire_dtype: WireDtype = WireDtype.FLOAT32  # dense tensors on the wire; the PS keeps float32
    data: DataSpec | None = None  # examples from files, in place of the model's data()

    @field_validator("model")
    @classmethod
    def _known_model(cls, model: str) -> str:
        if model not in BUILT_IN_MODELS and not re.match(MODEL_FUNCTION_PATTERN, model):
            raise ValueError(f"must be a built-in model ({', '.join(BUILT_IN_MODELS)}) or package.module:function")
        return model


class SchedulingPolicy(_Model):
    """TFJob's runPolicy.schedulingPolicy: the job's pods are scheduled as one gang."""

    min_available: int | None = Field(None, ge=1)  # default: every PS, worker and Chief
    queue: str | None = None  # Volcano's queue, or Kueue's LocalQueue when queueing is Kueue
    priority_class: str | None = None  # every pod's priorityClassName, unless its template sets one
    schedule_timeout_seconds: int | None = Field(None, ge=1)  # scheduler-plugins' coscheduling honours it


class RunPolicy(_Model):
    clean_pod_policy: CleanPodPolicy = CleanPodPolicy.RUNNING
    backoff_limit: int = Field(3, ge=0)
    active_deadline_seconds: int | None = Field(None, ge=1)
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    suspend: bool = False
    scheduling_policy: SchedulingPolicy | None = None


class TrainingJobSpec(_Model):
    replica_specs: dict[ReplicaType, ReplicaSpec]
    training: TrainingSpec | None = None
    run_policy: RunPolicy = Field(default_factory=RunPolicy)
    success_policy: SuccessPolicy = SuccessPolicy.DEFAULT

    @model_validator(mode="after")
    def _check_replicas(self) -> TrainingJobSpec:
        if self.training is not None:
            for needed in (ReplicaType.PS, ReplicaType.WORKER):
                spec = self.replica_specs.get(needed)
                if spec is None or spec.replicas < 1:
                    raise ValueError(
                        f"spec.replicaSpecs.{needed.value}: required (replicas >= 1) when spec.training is set"
                    )
        chief = self.replica_specs.get(ReplicaType.CHIEF)
        if chief is not None and chief.replicas > 1:
            raise ValueError("spec.replicaSpecs.Chief.replicas: at most 1")
        return self

    def replicas(self, rtype: ReplicaType) -> int:
        spec = self.replica_specs.get(rtype)
        return spec.replicas if spec else 0


class TrainingJob(_Model):
    """A whole manifest (apiVersion, kind, metadata, spec); status is the operator's."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    api_version: str = f"{API_GROUP}/{API_VERSION}"
    kind: str = KIND
    metadata: dict[str, Any]
    spec: TrainingJobSpec

    @property
    def name(self) -> str:
        return self.metadata["name"]

    @property
    def namespace(self) -> str:
        return self.metadata.get("namespace", "default")


def manifest_for(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A TrainingJob's manifest as a plain dict, for whoever writes one in code (`spec` in the
    manifest's field names)."""
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "metadata": {"name": name}, "spec": spec}


def load_manifest(path: str | Path) -> TrainingJob:
    """Read the first TrainingJob in a YAML file; a clear ValueError names what is wrong."""
    import yaml  # here: PS and worker processes never read a manifest

    with open(path) as fh:
        for doc in yaml.safe_load_all(fh):
            if isinstance(doc, dict) and doc.get("kind") == KIND:
                return TrainingJob.model_validate(doc)
    raise ValueError(f"{path}: no {KIND} document found")
