#!/usr/bin/env bash
# Builds the node-side parts of the local cluster into $TFPS_CACHE/bin/<tool>-<version>/ and reuses
# what is there: a small CoreDNS (cluster.local only, no upstream), kube-router (NetworkPolicy) and
# the pause binary (the sandbox image's only file). Everything comes from the Go module proxy.
# Resumable: each finished binary is kept; partial outputs are written as *.partial and renamed.
# Usage: hack/build-node.sh [pause|coredns|kube-router ...]  (default: all three)
# Run it in the background with: hack/build-node.sh > build-node.log 2>&1 &
set -euo pipefail
tools=()
for a in "$@"; do
  case $a in
    pause|coredns|kube-router) tools+=("$a") ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-node: unknown part: $a (one of: pause coredns kube-router)" >&2; exit 2 ;;
  esac
done
[ ${#tools[@]} -gt 0 ] || tools=(pause coredns kube-router)
wanted() { local t; for t in "${tools[@]}"; do [ "$t" = "$1" ] && return 0; done; return 1; }
what=build-node; total=${#tools[@]}
# shellcheck source=go-build.sh
source "$(dirname "$0")/go-build.sh"
# The folder of a module's source in the module cache (read-only there), downloading it if needed.
module_dir() { go mod download -json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'; }
build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)

# CoreDNS with only the plugins the cluster's Corefile uses. There is deliberately no `forward`
# plugin: this server answers cluster.local and in-addr.arpa from the API and asks nobody upstream.
# `bind` lets the caller listen on the node address instead of every interface.
coredns_main() {
  cat <<'GO'
// Command coredns is CoreDNS with only the plugins a host-local test cluster needs.
// It has no forward plugin, so it never sends a query to an upstream resolver.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	// The order in which the plugins handle a query, as in CoreDNS's plugin.cfg.
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes"}
	coremain.Run()
}
GO
}

build_coredns() {
  local dir="$cache/bin/coredns-$COREDNS_VERSION" src="$cache/src/coredns-$COREDNS_VERSION"
  progress "coredns $COREDNS_VERSION (kubernetes, cache, errors, log, health, ready, bind)"
  have "$dir/coredns" && return 0
  mkdir -p "$dir" "$src"
  # A changed main.go (another plugin set) needs a new tidy.
  if ! coredns_main | cmp -s - "$src/main.go"; then
    rm -f "$src/.tidy-done"
    coredns_main > "$src/main.go"
  fi
  if [ ! -f "$src/.tidy-done" ]; then
    local modfile
    modfile=$(go mod download -json "github.com/coredns/coredns@$COREDNS_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    {
      echo "module tfps.local/coredns-build"
      echo
      grep -E '^go [0-9.]+$' "$modfile"
      echo
      echo "require github.com/coredns/coredns $COREDNS_VERSION"
    } > "$src/go.mod"
    (cd "$src" && go mod tidy) && touch "$src/.tidy-done"
  fi
  (cd "$src" && go build -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" \
    -o "$dir/coredns.partial" .)
  mv "$dir/coredns.partial" "$dir/coredns"
  echo "  built coredns in $(elapsed)"
}

# kube-router from a writable copy of its module source, with the module's own go.mod/go.sum.
build_kube_router() {
  local dir="$cache/bin/kube-router-$KUBE_ROUTER_VERSION" src="$cache/src/kube-router-$KUBE_ROUTER_VERSION"
  progress "kube-router $KUBE_ROUTER_VERSION"
  have "$dir/kube-router" && return 0
  mkdir -p "$dir"
  if [ ! -f "$src/go.mod" ]; then
    local mod
    mod=$(module_dir "github.com/cloudnativelabs/kube-router/v2@$KUBE_ROUTER_VERSION")
    rm -rf "$src.partial"
    cp -r "$mod" "$src.partial"
    chmod -R u+w "$src.partial"
    mv "$src.partial" "$src"
  fi
  local pkg=github.com/cloudnativelabs/kube-router/v2/pkg/version
  (cd "$src" && go build -ldflags "-s -w -X $pkg.Version=$KUBE_ROUTER_VERSION -X $pkg.BuildDate=$build_date" \
    -o "$dir/kube-router.partial" ./cmd/kube-router)
  mv "$dir/kube-router.partial" "$dir/kube-router"
  echo "  built kube-router in $(elapsed)"
}

# The pause binary from the Kubernetes module, stamped the way build/pause/Makefile stamps it.
build_pause() {
  local dir="$cache/bin/pause-$KUBERNETES_VERSION"
  progress "pause (k8s.io/kubernetes $KUBERNETES_VERSION build/pause)"
  have "$dir/pause" && return 0
  command -v gcc >/dev/null || { echo "build-node: gcc is needed for the pause binary (apt-get install gcc libc6-dev)" >&2; exit 1; }
  local mod tag
  mod=$(module_dir "k8s.io/kubernetes@$KUBERNETES_VERSION")
  tag=$(sed -nE 's/^TAG \?= *([0-9.]+) *$/\1/p' "$mod/build/pause/Makefile")
  [ -n "$tag" ] || { echo "build-node: no TAG in $mod/build/pause/Makefile" >&2; exit 1; }
  mkdir -p "$dir"
  gcc -static -O2 -Wall -Werror -s "-DVERSION=v$tag-$KUBERNETES_VERSION" \
    -o "$dir/pause.partial" "$mod/build/pause/linux/pause.c"
  mv "$dir/pause.partial" "$dir/pause"
}

wanted pause && build_pause
wanted coredns && build_coredns
wanted kube-router && build_kube_router

# The same folder of links as hack/build-cluster.sh, so callers need a single PATH entry.
links="$cache/bin/current"
mkdir -p "$links"
wanted coredns && ln -sf "$cache/bin/coredns-$COREDNS_VERSION/coredns" "$links/coredns"
wanted kube-router && ln -sf "$cache/bin/kube-router-$KUBE_ROUTER_VERSION/kube-router" "$links/kube-router"
wanted pause && ln -sf "$cache/bin/pause-$KUBERNETES_VERSION/pause" "$links/pause"
echo "[build-node done $(date +%T)] ${tools[*]} in $links"
