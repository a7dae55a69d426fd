"""The large-embedding benchmark shapes: tfps's built-in `wide-deep` click model with a big table.

Power-law id frequencies (the model's own generator), batch 512 per worker, 2 workers, async,
the tables partitioned by rows over 2 PS. Every side trains the same `ModelDef`'s forward
pass on the same synthetic examples; the anchors feed them through tf.data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from .procs import ANCHOR_CRASH_RETRIES, CPU_FIGURES, Repeat, child_env, flag_args, module_cmd, run_json

MODEL = "wide-deep"
OPTIMIZERS = ("sgd", "adam")
SLOTS = {"sgd": 0, "adam": 2}


@dataclass(frozen=True)
class EmbeddingShape:
    name: str
    vocab: int  # rows of the embedding (and of the wide) table
    dim: int = 64
    fields: int = 8
    dense_dim: int = 8
    hidden: tuple[int, ...] = (64, 32)
    batch: int = 512
    workers: int = 2
    ps: int = 2
    model = MODEL

    @property
    def model_args(self) -> dict:
        """`spec.training.modelArgs` of the built-in `wide-deep` (no test split: nothing to evaluate)."""
        return {
            "vocabSize": self.vocab,
            "fields": self.fields,
            "embeddingDim": self.dim,
            "denseDim": self.dense_dim,
            "hidden": list(self.hidden),
            "testSamples": 0,
        }

    @property
    def rows(self) -> int:
        return self.vocab // self.fields * self.fields

    @property
    def params(self) -> int:
        dims = [self.fields * self.dim + self.dense_dim, *self.hidden, 1]
        return self.rows * (self.dim + 1) + sum(i * o + o for i, o in zip(dims[:-1], dims[1:], strict=False))

    def state_bytes(self, optimizer: str) -> int:
        """Parameters and optimizer slots, float32, all PS together."""
        return self.params * 4 * (1 + SLOTS[optimizer])


SHAPES = {
    "2M": EmbeddingShape("2M", 2_000_000),
    "10M": EmbeddingShape("10M", 10_000_000),
}
QUICK_SHAPE = EmbeddingShape("20k", 20_000, dim=16)


def load(shape: EmbeddingShape, seed: int = 0):
    from tfps.runtime.models import load_model

    return load_model(MODEL, shape.model_args, seed)


ADAM_LEARNING_RATE = 0.001  # Adam's, the same on every side (SGD takes the bench's --learning-rate)
TFPS_FIGURES = (
    "wire_bytes_per_step",
    "ps_peak_rss",
    "worker_peak_rss",
    "longest_step",
    "p99_step",
    "median_step",
    *CPU_FIGURES,
)
ANCHOR_STARTUP_S = 240.0  # the anchor's servers on a busy machine, and TF's first steps on a large table


def shard_state_bytes(shape: EmbeddingShape, optimizer: str) -> int:
    """Parameters and slots of the most loaded PS (runtime/sharding.py's placement)."""
    from tfps.runtime.sharding import place

    return max(place(load(shape).params, shape.ps).load()) * 4 * (1 + SLOTS[optimizer])


def measure_anchor(shape: EmbeddingShape, optimizer: str, learning_rate: float, cfg: dict) -> dict:
    from .anchor_tf_embedding import ENV, MODULE

    options = {
        "--vocab": shape.vocab,
        "--dim": shape.dim,
        "--optimizer": optimizer,
        "--batch": shape.batch,
        "--workers": shape.workers,
        "--ps": shape.ps,
        "--seconds": cfg["seconds"],
        "--warmup-seconds": cfg["warmup_seconds"],
        "--learning-rate": learning_rate,
    }
    cmd = module_cmd(MODULE, *flag_args(options))
    timeout = ANCHOR_STARTUP_S + 4 * (cfg["seconds"] + cfg["warmup_seconds"])
    return run_json(
        cmd, timeout, f"TF strategy ({shape.name}, {optimizer})", env=child_env(ENV), crash_retries=ANCHOR_CRASH_RETRIES
    )


def measure_once(
    shape: EmbeddingShape, cfg: dict, hints: dict, progress, checkpoints: bool, repeat: int = 0
) -> tuple[dict, list[str]]:
    """One repeat of one embedding shape: per optimizer the limit with that optimizer's update (a
    reference; then the same over one answering process per PS) and TF's strategy; the limit over
    one answering process per PS; then tfps async, SGD and Adam, right between two measurements
    of the bytes-inclusive limit (Repeat.bracket), in turn first on even and odd repeats; with
    `checkpoints`, tfps async Adam once more while checkpoints are written (about three in the
    run), for its longest step."""
    from . import limit, tfps_side

    rep = Repeat(shape.name, progress, {})
    learning_rates: dict[str, float] = {}
    for optimizer in OPTIMIZERS:
        rep.row[f"state_{optimizer}:shard"] = shard_state_bytes(shape, optimizer)
        learning_rates[optimizer] = cfg["learning_rate"] if optimizer == "sgd" else ADAM_LEARNING_RATE
        # In turn, not together: the largest shapes' state fits in memory once, not twice.
        for sharded in rep.in_turn((False, True), repeat):
            key = f"limit_update_{optimizer}" + ("_sharded" if sharded else "")
            rep.attempt(
                key,
                partial(limit.run, shape, cfg, "async", optimizer, learning_rates[optimizer], sharded=sharded),
                ("bytes_per_step", *CPU_FIGURES),
            )
        rep.attempt(
            f"tf_pss_{optimizer}",
            partial(measure_anchor, shape, optimizer, learning_rates[optimizer], cfg),
            ("ps_peak_rss",),
        )

    def tfps(optimizer: str) -> tuple[float, partial]:
        """Examples for tfps's run, and the run."""
        key = f"tfps_{optimizer}"
        rate = hints.get(key) or 0.8 * (rep.row.get("limit") or 20_000.0)
        examples = tfps_side.examples_for(rate, cfg)
        return examples, partial(
            tfps_side.measure, shape, "async", examples, rate, learning_rates[optimizer], optimizer=optimizer
        )

    def tfps_runs() -> None:
        for optimizer in rep.in_turn(OPTIMIZERS, repeat):
            key = f"tfps_{optimizer}"
            rep.attempt(key, tfps(optimizer)[1], TFPS_FIGURES)
            if rep.row.get(key):
                hints[key] = rep.row[key]

    rep.attempt("limit_sharded", partial(limit.run, shape, cfg, sharded=True), ("bytes_per_step", *CPU_FIGURES))
    rep.bracket("limit", lambda: limit.run(shape, cfg), ("bytes_per_step", *CPU_FIGURES), tfps_runs)
    if checkpoints:
        examples, run = tfps("adam")
        every = max(10, tfps_side.steps_for("async", shape, examples) // 4)
        rep.attempt("tfps_adam_ckpt", partial(run, every_steps=every), TFPS_FIGURES)
        rep.row["tfps_adam_ckpt:every_steps"] = every
    return rep.row, rep.errors
