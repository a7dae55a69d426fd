#!/usr/bin/env bash
# Builds Kueue's manager (sigs.k8s.io/kueue/cmd/kueue at KUEUE_VERSION from hack/versions.env) from
# the Go module proxy into $TFPS_CACHE/bin/kueue-<version>/kueue and reuses it when it is there.
# Kueue's go.mod has no replace directives, so `go install module@version` builds it as released.
# Its CRDs and webhook manifests are read by hack/kueue.py from the same module in Go's module cache.
# Run it in the background with: hack/build-kueue.sh > "$HOME/.cache/tfps/kueue-build.log" 2>&1 &
set -euo pipefail
what=build-kueue; total=1
# shellcheck source=go-build.sh
source "$(dirname "$0")/go-build.sh"

dir="$cache/bin/kueue-$KUEUE_VERSION"
progress "kueue $KUEUE_VERSION"
if ! have "$dir/kueue"; then
  mkdir -p "$dir"
  go mod download "sigs.k8s.io/kueue@$KUEUE_VERSION"
  pkg=sigs.k8s.io/kueue/pkg/version
  ld="-s -w -X $pkg.GitVersion=$KUEUE_VERSION -X $pkg.BuildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  GOBIN="$dir" go install -ldflags "$ld" "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION"
fi
echo "[build-kueue done $(date +%T)] $dir/kueue"
