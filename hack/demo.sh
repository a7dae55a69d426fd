#!/usr/bin/env bash
# `make demo`: a local cluster (control plane and a real node; or the cluster KUBECONFIG points at),
# the operator installed by Helm from its image, examples/digits.yaml trained to Succeeded in
# containers, and a summary of its metrics and of the images that ran.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1  # the repository's operator/ folder must not shadow the stdlib's `operator`
py=.venv/bin/python
ns=${TFPS_DEMO_NAMESPACE:-tfps-demo}
job_file=${TFPS_DEMO_JOB:-examples/digits.yaml}
say() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
start=$(date +%s)

bin="${TFPS_CACHE:-$HOME/.cache/tfps}/bin/current"
values=()
# Extra helm arguments, e.g. the image repositories of a registry the cluster pulls from.
read -r -d '' -a extra <<< "${TFPS_DEMO_HELM_ARGS:-}" || true
# kubectl and helm from PATH, else those hack/build-demo.sh built (the same check it makes).
export PATH="$PATH:$bin"
if [ -n "${KUBECONFIG:-}" ] && [ -f "$KUBECONFIG" ] && kubectl version --request-timeout=5s >/dev/null 2>&1; then
  say "Reusing the cluster of KUBECONFIG=$KUBECONFIG (the images must be there: hack/build-demo.sh said how)"
else
  say "Starting the local cluster: control plane, and a node with containerd, kubelet, kube-proxy, CoreDNS, kube-router (hack/cluster.sh up)"
  hack/cluster.sh up
  eval "$(hack/cluster.sh env)"
  values=(-f hack/values-local.yaml)  # requests that fit one small node; images already loaded
  export PATH="$bin:$PATH"  # the kubectl and helm of the local cluster's version
fi

kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
# The demo's operator serves only the demo namespace, so it never competes with the operators
# that the test tiers start on the same local cluster.
say "Installing the operator with Helm (release tfps, namespace tfps-system); it watches namespace $ns only"
helm upgrade --install tfps charts/tfps --namespace tfps-system --create-namespace "${values[@]}" "${extra[@]}" \
  --set "operator.watchNamespaces={$ns}" --set operator.progressSeconds=2 --wait --timeout 5m
kubectl -n tfps-system get pods -l app.kubernetes.io/name=tfps -o wide

say "Applying $job_file in namespace $ns"
job=$($py -c 'import sys; from tfps.api.spec import load_manifest; print(load_manifest(sys.argv[1]).name)' "$job_file")
kubectl -n "$ns" delete trainingjob "$job" --ignore-not-found --wait=true >/dev/null
kubectl -n "$ns" apply -f "$job_file"

say "Training in containers (progress from the TrainingJob's status)"
rc=0
$py hack/demo_watch.py --namespace "$ns" --name "$job" || rc=$?

say "kubectl get tj -n $ns"
kubectl -n "$ns" get tj -o wide
echo
echo "make demo took $(( $(date +%s) - start )) s."
echo "The operator watches namespace $ns only: apply TrainingJobs there (kubectl -n $ns apply -f ...),"
echo "or reinstall it with --set 'operator.watchNamespaces={}' to watch every namespace."
echo "The cluster keeps running: eval \"\$(hack/cluster.sh env)\"; kubectl get tj -A. Stop it with hack/cluster.sh down."
exit $rc
