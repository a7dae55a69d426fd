"""When a PS shard checkpoints: by time by default (checkpoint.everySeconds), also by steps when
checkpoint.everySteps is set, and always at the last step. A fake clock stands for time."""

from tfps.api.spec import CheckpointSpec
from tfps.runtime.checkpoint import ShardCheckpoints


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NoMetrics:
    pass


def _checkpoints(tmp_path, clock, last_step=10_000, **every):
    spec = CheckpointSpec.model_validate(every)
    return ShardCheckpoints(tmp_path, 0, NoMetrics(), spec, last_step, clock=clock)


def test_time_is_the_default_and_steps_alone_never_trigger(tmp_path):
    clock = FakeClock()
    ckpt = _checkpoints(tmp_path, clock)
    assert ckpt.every.every_seconds == 600 and ckpt.every.every_steps is None
    assert not any(ckpt.due(v) for v in range(1, 5000))  # many fast steps, little time
    clock.now += 600
    assert ckpt.due(5000)
    clock.now += 599
    assert not ckpt.due(5001)  # the timer restarted at the previous checkpoint
    clock.now += 1
    assert ckpt.due(5002)


def test_steps_when_set_and_whichever_is_due_first(tmp_path):
    clock = FakeClock()
    ckpt = _checkpoints(tmp_path, clock, everySteps=100, everySeconds=30)
    assert [v for v in range(1, 301) if ckpt.due(v)] == [100, 200, 300]
    clock.now += 30
    assert ckpt.due(301)
    clock.now += 29
    assert not ckpt.due(302)


def test_the_last_step_is_always_checkpointed(tmp_path):
    ckpt = _checkpoints(tmp_path, FakeClock(), last_step=7)
    assert ckpt.due(7)
