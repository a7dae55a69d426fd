#!/usr/bin/env bash
# Builds the operator benchmark's anchor, Kubeflow's training-operator, from its Go module
# (never copied into this repository) into the cache, keyed by version:
#   $cache/bench/training-operator-$version/training-operator          stock (go install)
#   $cache/bench/training-operator-$version-raised/training-operator   its client limits raised:
#     the module's source copied out of the Go module cache into the cache folder and patched
#     there with sed: flags --kube-api-qps and --kube-api-burst (stock: QPS 20, burst 30, no flag).
# Idempotent: a binary already built is kept. Run with --background to build with the output
# in $cache/bench/build-training-operator.log.
set -euo pipefail
version=${TRAINING_OPERATOR_VERSION:-v1.8.1}
module=github.com/kubeflow/training-operator
cache=${TFPS_CACHE:-$HOME/.cache/tfps}/bench
stock=$cache/training-operator-$version
raised=$cache/training-operator-$version-raised
mkdir -p "$cache"
if [ "${1:-}" = "--background" ]; then
  nohup "$0" >"$cache/build-training-operator.log" 2>&1 &
  echo "building in the background (pid $!), log: $cache/build-training-operator.log"
  exit 0
fi
export CGO_ENABLED=0 GOFLAGS="-buildvcs=false -trimpath" GOTOOLCHAIN=local

if [ -x "$stock/training-operator" ]; then
  echo "cached: $stock/training-operator"
else
  echo "[$(date +%T)] go install $module/cmd/training-operator.v1@$version"
  GOBIN="$stock" go install "$module/cmd/training-operator.v1@$version"
  mv "$stock/training-operator.v1" "$stock/training-operator"
fi

if [ -x "$raised/training-operator" ]; then
  echo "cached: $raised/training-operator"
else
  dir=$(go mod download -json "$module@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  if grep -q '^replace' "$dir/go.mod"; then
    echo "$module@$version has replace directives: the build would not match go install" >&2
    exit 1
  fi
  src=$raised/src
  rm -rf "$src"
  mkdir -p "$raised"
  cp -r "$dir" "$src"
  chmod -R u+w "$src"
  main=$src/cmd/training-operator.v1/main.go
  # Two flags next to --controller-threads, and the manager's rest config takes them.
  sed -i 's|^\(\s*\)flag.IntVar(&controllerThreads, .*|&\n\1kubeAPIQPS := flag.Float64("kube-api-qps", 20, "client QPS to the API server")\n\1kubeAPIBurst := flag.Int("kube-api-burst", 30, "client burst to the API server")|' "$main"
  sed -i 's|^\(\s*\)mgr, err := ctrl.NewManager(ctrl.GetConfigOrDie(), |\1restConfig := ctrl.GetConfigOrDie()\n\1restConfig.QPS, restConfig.Burst = float32(*kubeAPIQPS), *kubeAPIBurst\n\1mgr, err := ctrl.NewManager(restConfig, |' "$main"
  [ "$(grep -c 'kubeAPIQPS\|kubeAPIBurst' "$main")" = 3 ] || { echo "the patch did not apply to $main" >&2; exit 1; }
  echo "[$(date +%T)] go build (client limits raised) in $src"
  (cd "$src" && go build -o "$raised/training-operator" ./cmd/training-operator.v1)
fi
echo "[$(date +%T)] done"
