#!/usr/bin/env bash
# `make demo`'s set-up: builds only what the demo needs, in two lanes side by side, with a progress
# line for each step that says about how long the whole set-up has left:
# - the Go lane (CPU-bound): the local cluster's binaries from the Go module proxy: the pause
#   binary, the six Kubernetes commands in ONE `go build`, etcd, helm, CoreDNS and kube-router
#   (hack/build-cluster.sh, hack/build-node.sh). Not kwok, the gang backends' CRDs nor Kueue: only
#   the tests use them, and `make test` / `make cluster-tools` build them;
# - the network lane (network- and disk-bound): the venv (`make venv`), then the images
#   (hack/build-images.sh).
# When KUBECONFIG points at a cluster that answers (kind, k3d, a real one), no cluster binary is
# built: kubectl and helm come from PATH, only a missing one is built, and it says how to get the
# images into that cluster.
# The estimates come from the durations of earlier builds ($TFPS_CACHE/build-times.tsv), else
# from defaults measured on a cold cache on 2 cores. Each lane's output goes to
# $TFPS_CACHE/logs/demo-<lane>.log.
# Usage: hack/build-demo.sh [--plan]   (MAKE names the make that builds the venv; `make demo` sets it)
#   --plan  print each lane's steps and their estimates in seconds (0: built), build nothing
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1  # the repository's operator/ folder must not shadow the stdlib's `operator`
# shellcheck source=versions.env
. hack/versions.env
cache=${TFPS_CACHE:-$HOME/.cache/tfps}
export TFPS_CACHE=$cache
logs="$cache/logs"
times="$cache/build-times.tsv"
k8s_dir="$cache/bin/kubernetes-$KUBERNETES_VERSION"
mkdir -p "$logs"

# --- the steps ---------------------------------------------------------------------------------
k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)

label() {
  case $1 in
    kubernetes) echo "${k8s_cmds[*]} ($KUBERNETES_VERSION, one go build)" ;;
    kubectl) echo "kubectl $KUBERNETES_VERSION" ;;
    etcd) echo "etcd $ETCD_VERSION" ;;
    helm) echo "helm $HELM_VERSION" ;;
    coredns) echo "CoreDNS $COREDNS_VERSION" ;;
    kube-router) echo "kube-router $KUBE_ROUTER_VERSION" ;;
    pause) echo "the pause binary" ;;
    venv) echo "the venv (.venv)" ;;
    images) echo "the images (operator, ps, worker)" ;;
  esac
}

# The key its duration is recorded under. The venv and the images: a first build and an update
# (a source change rebuilds only the last layers) take minutes and seconds: two keys.
key() {
  case $1 in
    venv) if [ -x .venv/bin/python ]; then echo venv-update; else echo venv; fi ;;
    images) if [ -f "$cache/images/current.json" ]; then echo images-update; else echo images; fi ;;
    kubernetes|kubectl|pause) echo "$1-$KUBERNETES_VERSION" ;;
    etcd) echo "etcd-$ETCD_VERSION" ;;
    helm) echo "helm-$HELM_VERSION" ;;
    coredns) echo "coredns-$COREDNS_VERSION" ;;
    kube-router) echo "kube-router-$KUBE_ROUTER_VERSION" ;;
    *) echo "$1" ;;
  esac
}

# Seconds a cold build took on 2 cores with the other lane busy (and the machine shared: load ~7),
# in this order (etcd after Kubernetes reuses its compiled packages).
default_seconds() {
  case $(key "$1") in
    kubernetes-*) echo 880 ;;
    kubectl-*) echo 300 ;;
    etcd-*) echo 40 ;;
    helm-*) echo 150 ;;
    coredns-*) echo 125 ;;
    kube-router-*) echo 210 ;;
    pause-*) echo 5 ;;
    venv) echo 240 ;;
    venv-update) echo 30 ;;
    images) echo 650 ;;
    images-update) echo 120 ;;
  esac
}

# Whether its output is there (the venv and the images: not known here, their own checks decide).
built() {
  case $1 in
    kubernetes) local c; for c in "${k8s_cmds[@]}"; do [ -x "$k8s_dir/$c" ] || return 1; done ;;
    kubectl) [ -x "$k8s_dir/kubectl" ] ;;
    etcd) [ -x "$cache/bin/etcd-$ETCD_VERSION/etcd" ] ;;
    helm) [ -x "$cache/bin/helm-$HELM_VERSION/helm" ] ;;
    coredns) [ -x "$cache/bin/coredns-$COREDNS_VERSION/coredns" ] ;;
    kube-router) [ -x "$cache/bin/kube-router-$KUBE_ROUTER_VERSION/kube-router" ] ;;
    pause) [ -x "$cache/bin/pause-$KUBERNETES_VERSION/pause" ] ;;
    *) return 1 ;;
  esac
}

run_step() {
  case $1 in
    kubernetes) hack/build-cluster.sh kubernetes ;;
    kubectl|etcd|helm) hack/build-cluster.sh "$1" ;;
    coredns|kube-router|pause) hack/build-node.sh "$1" ;;
    venv) "${MAKE:-make}" --no-print-directory venv ;;
    images) hack/build-images.sh ;;
  esac
}

# Seconds it is expected to take: 0 when built, else its last recorded duration, else the default.
estimate() {
  if built "$1"; then echo 0; return; fi
  local last
  last=$(awk -F'\t' -v k="$(key "$1")" '$1 == k {s = $2} END {print s}' "$times" 2>/dev/null || true)
  echo "${last:-$(default_seconds "$1")}"
}

minutes() {  # "about 4 min", "under a minute"
  if [ "$1" -lt 60 ]; then echo "under a minute"; else echo "about $(( ($1 + 59) / 60 )) min"; fi
}

# --- one lane: its steps one after the other ---------------------------------------------------
# $state/<lane> holds "step start estimate lane-end" while the lane runs; progress lines take
# the time left from the lane that ends last.
time_left() {
  local now end=0 f e
  now=$(date +%s)
  for f in "$state"/lane.*; do
    [ -f "$f" ] || continue
    e=$(awk '{print $4}' "$f")
    [ "${e:-0}" -gt "$end" ] && end=$e
  done
  echo $(( end > now ? end - now : 0 ))
}

next_step() {
  ( flock 8; n=$(( $(cat "$state/count" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$state/count"; echo "$n" ) 8>"$state/.lock"
}

lane() {
  local lane=$1; shift
  local steps=("$@") i n rest now t0 dt was_built k
  local log="$logs/demo-$lane.log"
  : > "$log"
  for ((i = 0; i < ${#steps[@]}; i++)); do
    local s=${steps[i]}
    rest=0
    for n in "${steps[@]:i}"; do rest=$(( rest + $(estimate "$n") )); done
    now=$(date +%s)
    echo "$s $now $(estimate "$s") $(( now + rest ))" > "$state/lane.$lane"
    n=$(next_step)
    was_built=0
    if built "$s"; then
      was_built=1
      printf '[%d/%d] %s: built already\n' "$n" "$TFPS_DEMO_TOTAL" "$(label "$s")"
    else
      printf '[%d/%d] building %s (%s left)\n' "$n" "$TFPS_DEMO_TOTAL" "$(label "$s")" "$(minutes "$(time_left)")"
    fi
    k=$(key "$s") t0=$(date +%s)
    echo "=== $s $(date +%T)" >> "$log"
    if ! (run_step "$s") >> "$log" 2>&1; then
      echo "$s" > "$state/failed.$lane"
      rm -f "$state/lane.$lane"
      exit 1
    fi
    dt=$(( $(date +%s) - t0 ))
    echo "=== $s done in $dt s" >> "$log"
    # A step that found its output built says nothing about how long a build takes.
    [ "$was_built" = 1 ] || printf '%s\t%s\t%s\n' "$k" "$dt" "$(date -u +%FT%TZ)" >> "$times"
  done
  rm -f "$state/lane.$lane"
}

plan=0
case ${1:-} in
  --lane)
    # The lane's exit status in a file: the waiting side must not go by its pid, which a long build
    # (thousands of compiler processes) may have handed to another process by then.
    state=$TFPS_DEMO_STATE lane_name=$2
    trap 'echo $? > "$state/rc.$lane_name"' EXIT
    shift; lane "$@"; exit 0 ;;
  --plan) plan=1 ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "build-demo: unknown argument: $1" >&2; exit 2 ;;
esac

# --- which steps -------------------------------------------------------------------------------
say() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
start=$(date +%s)
# A cluster that answers: the one KUBECONFIG names (hack/demo.sh makes the same check).
kubectl_bin=$(command -v kubectl || true)
[ -n "$kubectl_bin" ] || { [ -x "$cache/bin/current/kubectl" ] && kubectl_bin=$cache/bin/current/kubectl; } || true
reuse=0
if [ -n "${KUBECONFIG:-}" ] && [ -f "$KUBECONFIG" ]; then
  if [ -z "$kubectl_bin" ] && [ "$plan" = 1 ]; then
    echo "first: kubectl $(estimate kubectl)"
  elif [ -z "$kubectl_bin" ]; then
    say "Building kubectl to ask the cluster of KUBECONFIG=$KUBECONFIG ($(minutes "$(estimate kubectl)"))"
    t0=$(date +%s)
    hack/build-cluster.sh kubectl > "$logs/demo-kubectl.log" 2>&1 || { tail -30 "$logs/demo-kubectl.log"; exit 1; }
    printf '%s\t%s\t%s\n' "$(key kubectl)" "$(( $(date +%s) - t0 ))" "$(date -u +%FT%TZ)" >> "$times"
    kubectl_bin=$cache/bin/current/kubectl
  fi
  if [ -n "$kubectl_bin" ] && "$kubectl_bin" version --request-timeout=5s >/dev/null 2>&1; then reuse=1; fi
fi

net_steps=(venv images)
if [ "$reuse" = 1 ]; then
  go_steps=()
  command -v kubectl >/dev/null || go_steps+=(kubectl)
  command -v helm >/dev/null || go_steps+=(helm)
  [ "$plan" = 1 ] || say "The cluster of KUBECONFIG=$KUBECONFIG answers: no cluster binaries to build (kubectl: ${kubectl_bin}; helm: $(command -v helm || echo "built into $cache/bin/current"))"
else
  go_steps=(pause kubernetes etcd helm coredns kube-router)
  [ "$plan" = 1 ] || say "Building what the demo needs: the local cluster's binaries (Go) beside the venv and the images"
fi

if [ "$plan" = 1 ]; then
  echo "cluster: $( [ "$reuse" = 1 ] && echo "KUBECONFIG's" || echo local)"
  for s in "${go_steps[@]}"; do echo "go: $s $(estimate "$s")"; done
  for s in "${net_steps[@]}"; do echo "net: $s $(estimate "$s")"; done
  exit 0
fi
total=$(( ${#go_steps[@]} + ${#net_steps[@]} ))
state=$(mktemp -d "$cache/.build-demo.XXXXXX")
export TFPS_DEMO_STATE=$state TFPS_DEMO_TOTAL=$total
lanes=() pids=()
# Each lane in its own session, so that an interrupt or a failure ends its builds and nothing else.
stop_lanes() {
  local i
  for i in "${!pids[@]}"; do
    [ -f "$state/rc.${lanes[i]}" ] && continue
    touch "$state/stopped.${lanes[i]}"
    kill -- "-${pids[i]}" 2>/dev/null || true
  done
}
trap 'stop_lanes; rm -rf "$state"' EXIT
trap 'exit 130' INT TERM
# Each lane's expected end, before either starts, so that the first progress lines count both.
lane_end() {
  local lane=$1 now rest=0 s; shift
  now=$(date +%s)
  for s in "$@"; do rest=$(( rest + $(estimate "$s") )); done
  echo "${1:-} $now 0 $(( now + rest ))" > "$state/lane.$lane"
}
if [ ${#go_steps[@]} -gt 0 ]; then lane_end go "${go_steps[@]}"; fi
lane_end net "${net_steps[@]}"
if [ ${#go_steps[@]} -gt 0 ]; then setsid "$0" --lane go "${go_steps[@]}" & pids+=($!); lanes+=(go); fi
setsid "$0" --lane net "${net_steps[@]}" & pids+=($!); lanes+=(net)

# Wait for the lanes; every 3 minutes say what is still running.
rc=0 last_note=$(date +%s)
while :; do
  running=0
  for i in "${!lanes[@]}"; do
    l=${lanes[i]}
    [ -f "$state/rc.$l" ] && continue
    # Killed before it could say (SIGKILL, the OOM killer): nothing left in its process group.
    kill -0 -- "-${pids[i]}" 2>/dev/null || { echo 137 > "$state/rc.$l"; continue; }
    running=$((running + 1))
  done
  for l in "${lanes[@]}"; do
    if [ -f "$state/failed.$l" ] || { [ -f "$state/rc.$l" ] && [ "$(cat "$state/rc.$l")" != 0 ]; }; then rc=1; fi
  done
  [ "$rc" = 0 ] || break
  [ "$running" -gt 0 ] || break
  sleep 2
  if [ $(( $(date +%s) - last_note )) -ge 180 ]; then
    last_note=$(date +%s)
    for f in "$state"/lane.*; do
      [ -f "$f" ] || continue
      read -r s t0 est _ < "$f"
      printf '      ... still building %s: %d min in (%s left in all)\n' "$(label "$s")" $(( (last_note - t0) / 60 )) "$(minutes "$(time_left)")"
    done
  fi
done
[ "$rc" = 0 ] || stop_lanes  # the other lanes' builds are of no use now
wait 2>/dev/null || true  # the lanes that are left, stopped or done
for l in "${lanes[@]}"; do
  if [ ! -f "$state/stopped.$l" ] && [ "$(cat "$state/rc.$l" 2>/dev/null)" != 0 ]; then
    rc=1
    [ -f "$state/failed.$l" ] || echo "a step of lane $l" > "$state/failed.$l"
  fi
done
if [ "$rc" != 0 ]; then
  for f in "$state"/failed.*; do
    lane=${f##*.} s=$(cat "$f")
    echo "build-demo: building $(label "$s" | grep . || echo "$s") failed; the end of $logs/demo-$lane.log:" >&2
    tail -40 "$logs/demo-$lane.log" >&2
  done
  exit 1
fi
printf '%s\t%s\t%s\n' "demo-setup-$( [ "$reuse" = 1 ] && echo reuse || echo local )" "$(( $(date +%s) - start ))" "$(date -u +%FT%TZ)" >> "$times"
say "Set-up done in $(( $(date +%s) - start )) s (logs: $logs/demo-*.log)"

if [ "$reuse" = 1 ]; then
  version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
  cat <<EOF
The cluster of KUBECONFIG pulls the images docker.io/tfps/{operator,ps,worker}:$version, which were
built here as docker-archives in $cache/images/ (hack/build-images.sh); nothing was pushed. Get them there first:
  kind:  for a in $cache/images/tfps-*.tar; do kind load image-archive "\$a" --name CLUSTER; done
  k3d:   k3d image import $cache/images/tfps-*.tar -c CLUSTER
  a registry:  for n in operator ps worker; do skopeo copy docker-archive:\$(ls $cache/images/tfps-\$n-*.tar) docker://REGISTRY/tfps/\$n:$version; done
         then: TFPS_DEMO_HELM_ARGS="--set operator.image.repository=REGISTRY/tfps/operator
                 --set runtime.images.ps.repository=REGISTRY/tfps/ps --set runtime.images.worker.repository=REGISTRY/tfps/worker" make demo
EOF
fi
