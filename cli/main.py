"""Entry point of the `tfps` console script.

Each subcommand imports its implementation lazily, so `tfps ps` starts without kopf or
kubernetes, and `tfps operator` without TensorFlow.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module exposes add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "local": ("tfps.runtime.local", "run a TrainingJob manifest as local processes, no cluster"),
    "ps": ("tfps.runtime.ps_main", "parameter-server pod entry point"),
    "worker": ("tfps.runtime.worker_main", "worker pod entry point"),
    "operator": ("tfps.operator.main", "run the kopf operator"),
    "render": ("tfps.operator.render", "print the Service and pods the operator would create"),
    "bench": ("tfps.bench.main", "benchmarks against their anchors"),
}


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tfps", description="distributed TensorFlow training with parameter servers")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # prints usage or the error, then exits
        return 2
    name = argv[0]
    module = _load(SUBCOMMANDS[name][0])
    if module is None:
        print(f"tfps {name}: not available yet in this build", file=sys.stderr)
        return 3
    cmd_parser = argparse.ArgumentParser(prog=f"tfps {name}", description=SUBCOMMANDS[name][1])
    module.add_arguments(cmd_parser)
    return int(module.run(cmd_parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
