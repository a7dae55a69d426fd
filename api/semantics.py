"""The TFJob rules as pure functions: which replicas a job has and in what order, what each
runs, when a replica that exited runs again, and when the job has succeeded.

The operator (operator/reconcile.py) and `tfps local` (runtime/local.py) both decide through
these, so a manifest means the same thing on a cluster and on one machine.
"""

from __future__ import annotations

from collections.abc import Collection

from .spec import ReplicaType, RestartPolicy, SuccessPolicy, TrainingJobSpec

# Creation order: PS first (workers wait for them anyway), the Chief before the workers.
REPLICA_ORDER = (ReplicaType.PS, ReplicaType.CHIEF, ReplicaType.WORKER, ReplicaType.EVALUATOR)
RETRYABLE_EXIT_CODE = 128  # TFJob: >= 128 means killed by a signal (OOM, preemption): worth a retry
# The runtime could not load the user's model (import error, the function raised): a restart
# runs the same code again, so the job fails at once with the error in its condition.
USER_CODE_EXIT_CODE = 4
BUILT_IN_ARGS = {ReplicaType.PS: ["ps"]}  # with spec.training, every other type runs `tfps worker`

Replica = tuple[ReplicaType, int]


def replicas(spec: TrainingJobSpec) -> list[Replica]:
    """Every replica the job wants, in creation order."""
    return [(rtype, i) for rtype in REPLICA_ORDER for i in range(spec.replicas(rtype))]


def built_in_args(spec: TrainingJobSpec, rtype: ReplicaType) -> list[str] | None:
    """The `tfps` arguments a replica runs with the built-in runtime; None for a custom program
    (no spec.training), which runs the command of its pod template's `tensorflow` container."""
    if spec.training is None:
        return None
    return list(BUILT_IN_ARGS.get(rtype, ["worker"]))


def reporting_replica(spec: TrainingJobSpec) -> Replica:
    """The replica whose result is the job's: the Chief when there is one, else worker 0."""
    return (ReplicaType.CHIEF if spec.replicas(ReplicaType.CHIEF) > 0 else ReplicaType.WORKER, 0)


def retryable(policy: RestartPolicy, exit_code: int | None) -> bool:
    """Whether a replica that failed (exit code non-zero, or none known: evicted, node lost,
    killed by a signal) is run again under its restartPolicy. A model that cannot be loaded
    never is."""
    if exit_code == USER_CODE_EXIT_CODE:
        return False
    if policy in (RestartPolicy.ALWAYS, RestartPolicy.ON_FAILURE):
        return True
    if policy is RestartPolicy.EXIT_CODE:
        # No exit code (evicted, node lost), or a signal, is not the program's fault either.
        return exit_code is None or exit_code < 0 or exit_code >= RETRYABLE_EXIT_CODE
    return False


def user_code_failed(exit_code: int | None) -> bool:
    """Whether a replica exited because the user's model could not be loaded."""
    return exit_code == USER_CODE_EXIT_CODE


def restarts_after_exit(rtype: ReplicaType, policy: RestartPolicy, exit_code: int | None) -> bool:
    """Whether a replica that exited runs again. A replica that finished (exit code 0) is done,
    except a PS with restartPolicy Always: a PS serves until the job ends."""
    if exit_code == 0:
        return rtype is ReplicaType.PS and policy is RestartPolicy.ALWAYS
    return retryable(policy, exit_code)


def kubelet_restart_policy(rtype: ReplicaType, policy: RestartPolicy) -> str:
    """The pod's restartPolicy that carries out `restarts_after_exit`: the kubelet restarts in
    place for Always/OnFailure; for ExitCode the operator looks at the code and recreates the pod."""
    if policy is RestartPolicy.ALWAYS:
        return "Always" if rtype is ReplicaType.PS else "OnFailure"
    if policy is RestartPolicy.ON_FAILURE:
        return "OnFailure"
    return "Never"


def success(spec: TrainingJobSpec, completed: Collection[Replica]) -> str | None:
    """Why the job has succeeded, given the replicas that completed (exit code 0); None while
    it has not. The Chief decides when there is one, else successPolicy over the workers."""
    if spec.replicas(ReplicaType.CHIEF) > 0:
        return "the Chief completed" if (ReplicaType.CHIEF, 0) in completed else None
    workers = spec.replicas(ReplicaType.WORKER)
    if workers == 0:
        return None
    if spec.success_policy is SuccessPolicy.ALL_WORKERS:
        everyone = all((ReplicaType.WORKER, i) in completed for i in range(workers))
        return f"all {workers} workers completed" if everyone else None
    return "worker 0 completed" if (ReplicaType.WORKER, 0) in completed else None
