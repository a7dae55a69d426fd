# Sourced by hack/build-cluster.sh and hack/build-node.sh: the pinned versions, the cache folder,
# Go's settings for static, reproducible builds, and progress lines. Set `total` and `what` first.
# shellcheck shell=bash
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cache=${TFPS_CACHE:-$HOME/.cache/tfps}
mkdir -p "$cache/bin" "$cache/src"
export CGO_ENABLED=0 GOFLAGS="-buildvcs=false -trimpath" GOTOOLCHAIN=local
step=0
progress() { step=$((step + 1)); printf '[%s %d/%d %s] %s\n' "$what" "$step" "$total" "$(date +%T)" "$*"; }
have() { [ -x "$1" ] && { echo "  cached: $1"; return 0; }; return 1; }
