# Sourced by the hack/build-*.sh scripts that run `go build`: the pinned versions, the cache folder,
# Go's settings for static, reproducible builds, and progress lines. Set `total` and `what` first.
# Every build shares Go's own caches (GOCACHE, default ~/.cache/go-build; GOMODCACHE, default
# ~/go/pkg/mod) and the same flags, so a package that two tools use (client-go, apimachinery, grpc)
# is compiled once for all of them.
# shellcheck shell=bash
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cache=${TFPS_CACHE:-$HOME/.cache/tfps}
mkdir -p "$cache/bin" "$cache/src"
# Static binaries (no cgo), no paths of this machine in them, no VCS stamping; -ldflags "-s -w"
# (each build) drops the symbol table and DWARF, so the compiler need not emit DWARF either.
export CGO_ENABLED=0 GOFLAGS="-buildvcs=false -trimpath -gcflags=all=-dwarf=false" GOTOOLCHAIN=local
step=0 step_start=$(date +%s)
progress() {
  step=$((step + 1)) step_start=$(date +%s)
  printf '[%s %d/%d %s] %s\n' "$what" "$step" "$total" "$(date +%T)" "$*"
}
elapsed() { echo "$(($(date +%s) - step_start)) s"; }
have() { [ -x "$1" ] && { echo "  cached: $1"; return 0; }; return 1; }
