#!/usr/bin/env bash
# Imports the images hack/build-images.sh wrote ($TFPS_CACHE/images/current.json) into a
# running containerd, in the namespace the kubelet uses (k8s.io), and tags each with its
# content tag too. An image whose tags already point at the same image id is skipped.
#
# Usage: hack/load-images.sh [--address SOCK] [operator|ps|worker ...]
#   SOCK defaults to $TFPS_CONTAINERD_SOCK, else /run/containerd/containerd.sock;
#   the namespace is $TFPS_CONTAINERD_NAMESPACE, else k8s.io.
set -euo pipefail
cache=${TFPS_CACHE:-$HOME/.cache/tfps}
manifest="$cache/images/current.json"
sock=${TFPS_CONTAINERD_SOCK:-/run/containerd/containerd.sock}
ns=${TFPS_CONTAINERD_NAMESPACE:-k8s.io}
names=()
while [ $# -gt 0 ]; do
  case $1 in
    --address) sock=$2; shift ;;
    --address=*) sock=${1#--address=} ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "load-images: unknown option: $1" >&2; exit 2 ;;
    *) names+=("$1") ;;
  esac
  shift
done
[ -f "$manifest" ] || { echo "load-images: no $manifest; run hack/build-images.sh first" >&2; exit 1; }
[ -S "$sock" ] || { echo "load-images: no containerd socket at $sock (set TFPS_CONTAINERD_SOCK)" >&2; exit 1; }
ctr_() { ctr --address "$sock" -n "$ns" "$@"; }

# The image id (config digest) a reference points at in containerd, or nothing.
image_id() {
  local digest
  digest=$(ctr_ images ls "name==$1" | awk 'NR == 2 {print $3}')
  [ -n "$digest" ] || return 0
  ctr_ content get "$digest" 2>/dev/null | python3 -c '
import json, sys
m = json.load(sys.stdin)
print(m.get("config", {}).get("digest", ""))' || true
}

# name ref content_ref archive image_id, one image a line.
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
python3 - "$manifest" "${names[@]}" <<'PY' >"$tmp"
import json, sys
current = json.load(open(sys.argv[1]))
for name in sys.argv[2:] or sorted(current):
    if name not in current:
        sys.exit(f"load-images: {name} is not in {sys.argv[1]}")
    e = current[name]
    print(name, e["ref"], e["content_ref"], e["archive"], e["image_id"])
PY

while read -r name ref content_ref archive want; do
  if [ "$(image_id "$ref")" = "$want" ] && [ "$(image_id "$content_ref")" = "$want" ]; then
    echo "[load-images] $name: $ref present ($want)"
    continue
  fi
  t0=$(date +%s)
  ctr_ images import "$archive" >/dev/null
  ctr_ images tag --force "$ref" "$content_ref" >/dev/null
  got=$(image_id "$ref")
  if [ "$got" != "$want" ]; then
    echo "load-images: $ref has image id '$got' after the import, expected $want" >&2
    exit 1
  fi
  echo "[load-images] $name: $ref (+ :${content_ref##*:}) imported in $(( $(date +%s) - t0 )) s ($want)"
done <"$tmp"
