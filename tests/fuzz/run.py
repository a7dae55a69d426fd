"""Runs every fuzz target of the PS's request path (tests/fuzz/fuzz_*.py) for a fixed time on the
sanitized builds of its C kernels, and fails on any crash, sanitizer report or unexpected exception.

    python tests/fuzz/run.py [--seconds 30] [TARGET ...]       (`make fuzz FUZZ_SECONDS=600`)

Each target runs twice, on its own corpus (.tfps/fuzz/TARGET/corpus, grown from the committed seeds
in tests/fuzz/corpus/):

1. coverage-guided, two thirds of the time, on the kernels built with UndefinedBehaviorSanitizer in
   trap mode (hack/build-sanitized.sh trap): atheris's libFuzzer sees the Python code's coverage
   and grows the corpus; undefined behaviour in C stops the run.
2. under AddressSanitizer and UndefinedBehaviorSanitizer (hack/build-sanitized.sh asan, GCC's
   libasan preloaded), the rest of the time: every input of the grown corpus, then mutations of
   them. libasan's preload brings coverage callbacks of its own that take the place of
   libFuzzer's, so this run cannot see coverage (-keep_seed=1 keeps mutating the whole corpus).

A crash leaves its input in .tfps/fuzz/TARGET/ (crash-*); replay it with the same command and the
file as the only argument. Prints, per target and run, the executions, the time and the result."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

FUZZ = Path(__file__).resolve().parent
REPO = FUZZ.parents[1]
OUT = REPO / ".tfps" / "fuzz"
SEEDS = {"fuzz_c_request": "requests", "fuzz_shard_step": "requests", "fuzz_kernels": "kernels"}
RSS_LIMIT_MB = 6144
INPUT_TIMEOUT_SECONDS = 30


@dataclass
class Result:
    target: str
    phase: str
    runs: int
    seconds: float
    code: int

    @property
    def ok(self) -> bool:
        return self.code == 0


def build(mode: str) -> str:
    out = subprocess.run(
        [str(REPO / "hack" / "build-sanitized.sh"), mode],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PY": sys.executable},
    )
    return out.stdout.strip().splitlines()[-1]


def libasan() -> str:
    return subprocess.run(
        ["gcc", "-print-file-name=libasan.so"], check=True, capture_output=True, text=True
    ).stdout.strip()


def run(target: str, phase: str, module: str, seconds: int, corpus: Path, seeds: Path) -> Result:
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "TFPS_ROWS_SO": str(REPO / module),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    flags = [f"-max_total_time={seconds}", f"-timeout={INPUT_TIMEOUT_SECONDS}", f"-rss_limit_mb={RSS_LIMIT_MB}"]
    flags += [f"-artifact_prefix={OUT / target}/", "-print_final_stats=1"]
    if phase == "coverage":
        flags.append("-use_value_profile=1")
    else:
        env |= {
            "LD_PRELOAD": libasan(),
            "PYTHONMALLOC": "malloc",  # every allocation through ASan's malloc, with its redzones
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        }
        flags.append("-keep_seed=1")
    log = OUT / target / f"{phase}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, str(FUZZ / f"{target}.py"), *flags, str(corpus), str(seeds)],
            cwd=OUT / target,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    text = log.read_text(errors="replace")
    runs = re.findall(r"stat::number_of_executed_units: (\d+)", text) or re.findall(r"Done (\d+) runs", text)
    result = Result(target, phase, int(runs[-1]) if runs else 0, time.monotonic() - started, proc.returncode)
    if not result.ok:
        lines = [line for line in text.splitlines() if not line.startswith("INFO: Instrumenting")]
        print("\n".join(lines[-60:]), file=sys.stderr)
        print(f"fuzz: {target} ({phase}) failed: exit {proc.returncode}; its log: {log}", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=30, help="each target's time, both runs together")
    parser.add_argument("targets", nargs="*", default=sorted(SEEDS), help=f"default: all ({', '.join(sorted(SEEDS))})")
    args = parser.parse_args(argv)
    unknown = set(args.targets) - set(SEEDS)
    if unknown:
        parser.error(f"no such target: {', '.join(sorted(unknown))}")
    modules = {"coverage": build("trap"), "asan": build("asan")}
    results = []
    for target in args.targets:
        corpus = OUT / target / "corpus"
        corpus.mkdir(parents=True, exist_ok=True)
        seeds = FUZZ / "corpus" / SEEDS[target]
        coverage_seconds = max(1, args.seconds * 2 // 3)
        for phase, seconds in (("coverage", coverage_seconds), ("asan", max(1, args.seconds - coverage_seconds))):
            results.append(run(target, phase, modules[phase], seconds, corpus, seeds))
            if not results[-1].ok:
                break
    print(f"{'target':<18} {'run':<9} {'executions':>11} {'seconds':>8}  result")
    for r in results:
        print(f"{r.target:<18} {r.phase:<9} {r.runs:>11} {r.seconds:>8.0f}  {'ok' if r.ok else f'FAILED ({r.code})'}")
    failed = [r for r in results if not r.ok]
    print(f"fuzz: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    shutil.which("gcc") or sys.exit("fuzz: gcc is needed to build the sanitized kernels")
    sys.exit(main())
