#!/usr/bin/env bash
# Installs the Debian packages the cluster, the images, the tests and the demo use. Idempotent
# and quiet when everything is present.
#   openssl (the PKI), util-linux (unshare), util-linux-extra (fincore: a test that checkpoints
#   bypass the page cache), prometheus + promtool (the metrics tests),
#   the node: containerd + runc, the CNI plugins, iptables, ipset, conntrack, iproute2,
#   the images: buildah (daemonless builds) and mmdebstrap (the Debian base image),
#   gcc and Python's headers (pip builds the PS's C update kernels, runtime/_rows.c).
set -euo pipefail
need=()
want() { command -v "$1" >/dev/null || [ -e "$1" ] || need+=("$2"); }
want openssl openssl
want unshare util-linux
want fincore util-linux-extra
want prometheus prometheus
want promtool prometheus
want containerd containerd
want runc runc
want /usr/lib/cni/bridge containernetworking-plugins
want iptables iptables
want ipset ipset
want conntrack conntrack
want ip iproute2
want buildah buildah
want mmdebstrap mmdebstrap
want gcc gcc
want "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" python3-dev
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "install-system-deps: need root to install: ${need[*]}" >&2; exit 1
fi
echo "install-system-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Debian's packages start services where systemd runs; the cluster and the tests start their own.
if command -v systemctl >/dev/null; then
  systemctl disable --now prometheus containerd 2>/dev/null || true
fi
pkill -x prometheus-node-exporter 2>/dev/null || true
