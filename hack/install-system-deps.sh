#!/usr/bin/env bash
# Installs the Debian packages the tests and the demo use (openssl for the PKI, util-linux
# for unshare, Prometheus and promtool for the metrics tests). Idempotent and quiet when present.
set -euo pipefail
need=()
command -v openssl >/dev/null || need+=(openssl)
command -v unshare >/dev/null || need+=(util-linux)
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "install-system-deps: need root to install: ${need[*]}" >&2; exit 1
fi
echo "install-system-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Debian's package starts a prometheus service where systemd runs; the tests start their own.
(command -v systemctl >/dev/null && systemctl disable --now prometheus 2>/dev/null) || true
pkill -x prometheus-node-exporter 2>/dev/null || true
