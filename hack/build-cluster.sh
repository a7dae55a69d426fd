#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, kube-proxy,
# helm and kwok from the Go module proxy into $TFPS_CACHE/bin/<tool>-<version>/ and reuses what is there.
# Resumable: each finished binary is kept; Go's own build cache makes a restarted build fast.
# Usage: hack/build-cluster.sh [TOOL...]  (default: all of them; `kubernetes` names the six k8s.io ones).
# The Kubernetes binaries that are missing are built by ONE `go build`, so the packages they share
# are compiled once and the links run beside the compiles.
# Run it in the background with: hack/build-cluster.sh > build.log 2>&1 &
set -euo pipefail
k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)
all_tools=(etcd "${k8s_cmds[@]}" helm kwok)
tools=()
for a in "$@"; do
  case $a in
    kubernetes) tools+=("${k8s_cmds[@]}") ;;
    etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kubectl|kubelet|kube-proxy|helm|kwok) tools+=("$a") ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-cluster: unknown tool: $a (one of: ${all_tools[*]} kubernetes)" >&2; exit 2 ;;
  esac
done
[ ${#tools[@]} -gt 0 ] || tools=("${all_tools[@]}")
wanted() { local t; for t in "${tools[@]}"; do [ "$t" = "$1" ] && return 0; done; return 1; }
what=build-cluster; total=0
for t in etcd kubernetes helm kwok; do
  case $t in
    kubernetes) for c in "${k8s_cmds[@]}"; do wanted "$c" && { total=$((total + 1)); break; }; done ;;
    *) wanted "$t" && total=$((total + 1)) ;;
  esac
done
# shellcheck source=go-build.sh
source "$(dirname "$0")/go-build.sh"

k8s_dir="$cache/bin/kubernetes-$KUBERNETES_VERSION"
k8s_src="$cache/src/kubernetes-$KUBERNETES_VERSION"
k8s_minor=$(echo "$KUBERNETES_VERSION" | cut -d. -f2)
k8s_patch=$(echo "$KUBERNETES_VERSION" | cut -d. -f3)
build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)

prepare_k8s_module() {
  # k8s.io/kubernetes replaces its staging modules with ./staging/..., which a dependent module
  # cannot follow: point each at its published v0.<minor>.<patch> instead.
  [ -f "$k8s_src/go.sum" ] && [ -f "$k8s_src/.tidy-done-node" ] && return 0
  mkdir -p "$k8s_src"
  local modfile
  modfile=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  {
    echo "module tfps.local/kubernetes-build"
    echo
    grep -E '^go [0-9.]+$' "$modfile"
    grep -E '^godebug ' "$modfile" || true
    echo
    echo "require k8s.io/kubernetes $KUBERNETES_VERSION"
    echo
    grep -Eo '^\s*k8s\.io/[A-Za-z0-9._/-]+ => \./staging' "$modfile" | awk '{print $1}' | sort -u |
      while read -r m; do echo "replace $m => $m v0.$k8s_minor.$k8s_patch"; done
  } > "$k8s_src/go.mod"
  cat > "$k8s_src/tools.go" <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
GO
  (cd "$k8s_src" && go mod tidy) && touch "$k8s_src/.tidy-done-node"
}

# The wanted Kubernetes commands that are not built yet, in one `go build -o DIR/ PKG...`.
build_k8s() {
  local cmds=() c
  for c in "$@"; do wanted "$c" && cmds+=("$c"); done
  [ ${#cmds[@]} -gt 0 ] || return 0
  progress "${cmds[*]} $KUBERNETES_VERSION"
  local todo=() pkgs=()
  for c in "${cmds[@]}"; do
    have "$k8s_dir/$c" || { todo+=("$c"); pkgs+=("k8s.io/kubernetes/cmd/$c"); }
  done
  [ ${#todo[@]} -gt 0 ] || return 0
  prepare_k8s_module
  local ld="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
    ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
  done
  local out="$k8s_dir/.partial"
  rm -rf "$out" && mkdir -p "$out"
  (cd "$k8s_src" && go build -tags selinux,notest -ldflags "$ld" -o "$out/" "${pkgs[@]}")
  for c in "${todo[@]}"; do mv "$out/$c" "$k8s_dir/$c"; done
  rmdir "$out"
  echo "  built ${todo[*]} in $(elapsed)"
}

build_etcd() {
  local dir="$cache/bin/etcd-$ETCD_VERSION" src="$cache/src/etcd-$ETCD_VERSION"
  progress "etcd $ETCD_VERSION"
  have "$dir/etcd" && return 0
  mkdir -p "$dir" "$src"
  if [ ! -f "$src/.tidy-done-node" ]; then
    printf 'module tfps.local/etcd-build\n\ngo 1.25\n\nrequire go.etcd.io/etcd/server/v3 %s\n' "$ETCD_VERSION" > "$src/go.mod"
    printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' > "$src/tools.go"
    (cd "$src" && go mod tidy) && touch "$src/.tidy-done-node"
  fi
  (cd "$src" && go build -ldflags "-s -w" -o "$dir/etcd.partial" go.etcd.io/etcd/server/v3)
  mv "$dir/etcd.partial" "$dir/etcd"
  echo "  built etcd in $(elapsed)"
}

build_helm() {
  local dir="$cache/bin/helm-$HELM_VERSION"
  progress "helm $HELM_VERSION"
  have "$dir/helm" && return 0
  mkdir -p "$dir"
  local ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ld+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
  done
  GOBIN="$dir" go install -ldflags "$ld" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  echo "  built helm in $(elapsed)"
}

build_kwok() {
  local dir="$cache/bin/kwok-$KWOK_VERSION"
  progress "kwok $KWOK_VERSION"
  # Its stage files (how fake nodes and pods move through their lifecycle) ship in the module.
  have "$dir/kwok" && [ -d "$dir/stage" ] && return 0
  mkdir -p "$dir"
  GOBIN="$dir" go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  local src
  src=$(go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  rm -rf "$dir/stage" && cp -r "$src/kustomize/stage" "$dir/stage" && chmod -R u+w "$dir/stage"
  echo "  built kwok in $(elapsed)"
}

wanted etcd && build_etcd
build_k8s "${k8s_cmds[@]}"
wanted helm && build_helm
wanted kwok && build_kwok

# One folder of links so callers need a single PATH entry.
links="$cache/bin/current"
mkdir -p "$links"
wanted etcd && ln -sf "$cache/bin/etcd-$ETCD_VERSION/etcd" "$links/etcd"
for c in "${k8s_cmds[@]}"; do if wanted "$c"; then ln -sf "$k8s_dir/$c" "$links/$c"; fi; done
wanted helm && ln -sf "$cache/bin/helm-$HELM_VERSION/helm" "$links/helm"
wanted kwok && ln -sf "$cache/bin/kwok-$KWOK_VERSION/kwok" "$links/kwok"
echo "[build-cluster done $(date +%T)] ${tools[*]} in $links"
