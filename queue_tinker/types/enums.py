"""Closed lists. Everything else (Lua, SQL, docs, the gateway) derives from these."""

from __future__ import annotations

from enum import StrEnum


class OpKind(StrEnum):
    """Every kind of job a model's queue can hold."""

    CREATE_MODEL = "create_model"
    PING = "ping"  # a no-op round trip: health checks, latency benchmarks, lease tests
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_STATE = "save_state"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"  # PEFT files for download
    LOAD_STATE = "load_state"
    UNLOAD_MODEL = "unload_model"
    SAMPLE = "sample"
    CREATE_SAMPLING_SESSION = "create_sampling_session"


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.DONE, JobStatus.FAILED)

    @property
    def rank(self) -> int:
        """Order of progress; a record never moves to a lower rank (write-behind may reorder)."""
        return _STATUS_RANK[self]


_STATUS_RANK = {JobStatus.QUEUED: 0, JobStatus.RUNNING: 1, JobStatus.DONE: 2, JobStatus.FAILED: 2}


class QueueState(StrEnum):
    """Why a future is waiting, as reported to the client."""

    ACTIVE = "active"
    PAUSED_RATE_LIMIT = "paused_rate_limit"
    PAUSED_CAPACITY = "paused_capacity"


class LossFn(StrEnum):
    """The built-in loss functions of forward / forward_backward (formulas in docs/losses.md)."""

    CROSS_ENTROPY = "cross_entropy"
    IMPORTANCE_SAMPLING = "importance_sampling"
    PPO = "ppo"
    CISPO = "cispo"
    DRO = "dro"
    GSPO = "gspo"
    STABLE_REINFORCE = "stable_reinforce"
    # A loss uploaded with create_custom_loss (types/requests/custom_loss.py); the op carries it.
    CUSTOM = "custom"


# The losses a forward_backward names by string; CUSTOM runs an uploaded graph instead.
BUILT_IN_LOSSES: tuple[LossFn, ...] = tuple(fn for fn in LossFn if fn is not LossFn.CUSTOM)


class Optimizer(StrEnum):
    """The optimizer families a training run can be created with (Tinker's optimizer_config
    type); fixed for the run's life."""

    ADAMW = "adamw"
    DIMUON = "dimuon"


class CheckpointKind(StrEnum):
    """`state`: weights + optimizer (tinker://<run>/weights/<name>); `sampler`: weights only
    (tinker://<run>/sampler_weights/<name>); `external`: the PEFT files for download, maybe
    age-encrypted (tinker://<run>/external_weights/<name>)."""

    STATE = "state"
    SAMPLER = "sampler"
    EXTERNAL = "external"

    @property
    def path_segment(self) -> str:
        return _PATH_SEGMENTS[self]


_PATH_SEGMENTS = {
    CheckpointKind.STATE: "weights",
    CheckpointKind.SAMPLER: "sampler_weights",
    CheckpointKind.EXTERNAL: "external_weights",
}
