"""The TFPS_* environment a PS or worker process reads, in one pydantic model.

In a pod the operator sets these (operator/builders.py), `tfps local` sets the same for its
processes (runtime/local.py); the rest are knobs with the defaults below. Each field's
variable is its alias, spelled in api/naming.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from . import naming
from .spec import TrainingSpec


class ProcessSettings(BaseModel):
    """`ProcessSettings.from_env()` reads os.environ, `ProcessSettings.from_env(env)` a given
    mapping. (A plain model, not pydantic-settings' BaseSettings: that package imports dotenv,
    email, zipfile and more into every PS, for what one `model_validate` of the environment does,
    and a PS's memory beyond its shard is a goal.)"""

    model_config = ConfigDict(extra="ignore")

    tf_config: str | None = Field(None, validation_alias=AliasChoices(naming.ENV_TF_CONFIG))
    job_name: str = Field("local", validation_alias=AliasChoices(naming.ENV_JOB_NAME))
    namespace: str = Field("default", validation_alias=AliasChoices(naming.ENV_NAMESPACE))
    training: TrainingSpec | None = Field(None, validation_alias=AliasChoices(naming.ENV_TRAINING))
    bind_address: str = Field("0.0.0.0", validation_alias=AliasChoices(naming.ENV_BIND_ADDRESS))
    metrics_port: int = Field(naming.METRICS_PORT, validation_alias=AliasChoices(naming.ENV_METRICS_PORT))
    # "off": no data path; 0 or empty: any free port
    data_port: str = Field("0", validation_alias=AliasChoices(naming.ENV_DATA_PORT))
    auth_token_file: str | None = Field(None, validation_alias=AliasChoices(naming.ENV_AUTH_TOKEN_FILE))
    result_file: str | None = Field(None, validation_alias=AliasChoices(naming.ENV_RESULT_FILE))
    termination_log: str = Field("/dev/termination-log", validation_alias=AliasChoices(naming.ENV_TERMINATION_LOG))
    ps_retry_seconds: float = Field(300.0, validation_alias=AliasChoices(naming.ENV_RETRY_SECONDS))
    worker_timeout_seconds: float = Field(10.0, validation_alias=AliasChoices(naming.ENV_WORKER_TIMEOUT))
    intra_op_threads: int | None = Field(None, validation_alias=AliasChoices(naming.ENV_INTRA_OP_THREADS))
    data_path: bool = Field(True, validation_alias=AliasChoices(naming.ENV_DATA_PATH))
    pipeline: bool = Field(True, validation_alias=AliasChoices(naming.ENV_PIPELINE))
    sched_batch: bool = Field(True, validation_alias=AliasChoices(naming.ENV_SCHED_BATCH))
    crash_at: int | None = Field(None, validation_alias=AliasChoices(naming.ENV_CRASH_AT))

    @field_validator("training", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    @field_validator("intra_op_threads", "crash_at", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        return None if value == "" else value

    @property
    def data_port_number(self) -> int | None:
        """The PS's data path port: None for none, 0 for any free port."""
        return None if self.data_port == "off" else int(self.data_port or 0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProcessSettings:
        return cls.model_validate(dict(os.environ if env is None else env))
