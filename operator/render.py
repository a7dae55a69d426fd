"""`tfps render FILE`: print the Service and pods the operator would create, as YAML.

Uses the operator's own builders, so what is printed is what would be applied.
"""

from __future__ import annotations

import argparse
import sys

import yaml
from pydantic import ValidationError

from tfps.api.spec import load_manifest

from .builders import build_service, desired_pods
from .config import OperatorConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a YAML file with a TrainingJob")
    parser.add_argument("--namespace", "-n", help="namespace (default: the manifest's, else default)")
    parser.add_argument(
        "--config", help="operator configuration YAML (default: $TFPS_OPERATOR_CONFIG or built-in defaults)"
    )


def render(manifest_path: str, namespace: str | None = None, config: OperatorConfig | None = None) -> str:
    job = load_manifest(manifest_path)
    if namespace:
        job.metadata["namespace"] = namespace
    config = config or OperatorConfig()
    docs = [build_service(job, config), *desired_pods(job, config)]
    return yaml.safe_dump_all(docs, sort_keys=False)


def run(args: argparse.Namespace) -> int:
    try:
        text = render(args.file, args.namespace, OperatorConfig.load(args.config))
    except (OSError, ValueError, ValidationError) as err:
        print(f"tfps render: {err}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0
