#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, helm and kwok
# from the Go module proxy into $TFPS_CACHE/bin/<tool>-<version>/ and reuses what is there.
# Resumable: each finished binary is kept; Go's own build cache makes a restarted build fast.
# Run it in the background with: hack/build-cluster.sh > build.log 2>&1 &
set -euo pipefail
what=build-cluster; total=9
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

build_k8s() {
  local cmd=$1 out="$k8s_dir/$1"
  progress "$cmd $KUBERNETES_VERSION"
  have "$out" && return 0
  prepare_k8s_module
  local ld="-s -w"
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
    ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
  done
  mkdir -p "$k8s_dir"
  (cd "$k8s_src" && go build -tags selinux,notest -ldflags "$ld" -o "$out.partial" "k8s.io/kubernetes/cmd/$cmd")
  mv "$out.partial" "$out"
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
}

build_etcd
build_k8s kube-apiserver
build_k8s kubectl
build_helm
build_k8s kube-scheduler
build_k8s kube-controller-manager
build_k8s kubelet
build_k8s kube-proxy
build_kwok

# One folder of links so callers need a single PATH entry.
links="$cache/bin/current"
mkdir -p "$links"
ln -sf "$cache/bin/etcd-$ETCD_VERSION/etcd" "$links/etcd"
for c in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do ln -sf "$k8s_dir/$c" "$links/$c"; done
ln -sf "$cache/bin/helm-$HELM_VERSION/helm" "$links/helm"
ln -sf "$cache/bin/kwok-$KWOK_VERSION/kwok" "$links/kwok"
echo "[build-cluster done $(date +%T)] binaries in $links"
