#!/usr/bin/env bash
# The local cluster (control plane and a real node; root): hack/cluster.sh up | down [--purge] | stop C... | restart C... | status | env | kubeconfig | logs
# (see hack/cluster.py). Runs with the project's venv when present, else the system python3.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=python3
[ -x "$here/../.venv/bin/python" ] && py="$here/../.venv/bin/python"
exec "$py" "$here/cluster.py" "$@"
