#!/usr/bin/env bash
# The PodGroup CRDs of the two gang-scheduling backends that are not built into Kubernetes, as
# their projects publish them, into $TFPS_CACHE/crds/ (tests check the operator's PodGroups
# against them on the real API server):
# - scheduler-plugins' coscheduling PodGroup: the CRD file in its Go module;
# - Volcano's PodGroup: generated with controller-gen from the types of its API module
#   (volcano.sh/apis), which is how Volcano makes its own CRDs; the Go module proxy does not
#   serve the volcano.sh/volcano module that holds the generated files.
set -euo pipefail
cd "$(dirname "$0")/.."
. hack/versions.env
cache=${TFPS_CACHE:-$HOME/.cache/tfps}
out="$cache/crds/gang-$SCHEDULER_PLUGINS_VERSION-$VOLCANO_APIS_VERSION"
if [ -s "$out/coscheduling-podgroups.yaml" ] && [ -s "$out/volcano-podgroups.yaml" ]; then
  echo "  cached: $out"; exit 0
fi
mkdir -p "$out"
dir() { go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'; }

sp=$(dir "sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION")
cp "$sp/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml" "$out/coscheduling-podgroups.yaml.partial"

gen="$cache/bin/controller-gen-$CONTROLLER_TOOLS_VERSION"
[ -x "$gen/controller-gen" ] || GOBIN="$gen" go install "sigs.k8s.io/controller-tools/cmd/controller-gen@$CONTROLLER_TOOLS_VERSION"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && go mod init tfps.local/gang-crds >/dev/null 2>&1 \
  && go get "volcano.sh/apis/pkg/apis/scheduling/v1beta1@$VOLCANO_APIS_VERSION" >/dev/null 2>&1 \
  && "$gen/controller-gen" crd paths=volcano.sh/apis/pkg/apis/scheduling/v1beta1 output:crd:dir="$work/out")
cp "$work/out/scheduling.volcano.sh_podgroups.yaml" "$out/volcano-podgroups.yaml.partial"
for f in coscheduling-podgroups volcano-podgroups; do mv "$out/$f.yaml.partial" "$out/$f.yaml"; done
echo "gang CRDs in $out"
