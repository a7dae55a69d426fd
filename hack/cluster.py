#!/usr/bin/env python3
"""Start and stop the local Kubernetes cluster: the control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler) and one real node (containerd + runc, kubelet, kube-proxy,
CoreDNS, kube-router's NetworkPolicy firewall; see hack/node.py for its addresses and host state),
with state, PKI and logs in one folder. Needs root: the node makes a bridge, rules and cgroups.

Usage: hack/cluster.sh up | down [--purge] | stop COMPONENT... | restart COMPONENT... | release --session PID |
       status | env | kubeconfig | logs

Standard library only, so it runs before the project's virtual environment exists.

State folder ($TFPS_STATE, default <repo>/.tfps):
  cluster.json   ports and URL of the running control plane
  pki/           CA, serving cert, admin client cert, service-account key pair
  kubeconfig     admin kubeconfig (system:masters)
  etcd/          etcd data (wiped whenever `up` finds etcd stopped: the cluster lives as long as its processes;
                 `restart etcd` keeps it, like a real control-plane restart)
  pids/          one pid file per component (the pid of its supervisor, hack/supervise.py)
  logs/          one log per component
  node/          the node's configuration files and kubeconfigs
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import node  # noqa: E402  (hack/node.py, beside this file)

log = logging.getLogger("tfps.cluster")

REPO = Path(__file__).resolve().parent.parent
# Every component runs under hack/supervise.py, which starts it again when it exits (systemd's job on
# a real machine); the pid files record the supervisors.
SUPERVISE = Path(__file__).resolve().parent / "supervise.py"
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
NODE = ("containerd", "kubelet", "kube-proxy", "coredns", "kube-router")
COMPONENTS = CONTROL_PLANE + NODE
NODE_NAME = node.NODE_NAME
# Kubernetes' own gang scheduling (alpha in 1.35): the Workload API and the scheduler's plugin.
FEATURE_GATES = "--feature-gates=GenericWorkload=true,GangScheduling=true"
PKI_LAYOUT = "2"  # bump when LEAVES change: `up` then makes the PKI anew


def read_versions() -> dict[str, str]:
    out = {}
    for line in (REPO / "hack" / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k] = v
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("TFPS_CACHE") or Path.home() / ".cache" / "tfps")


def state_dir() -> Path:
    return Path(os.environ.get("TFPS_STATE") or REPO / ".tfps")


def bin_dir() -> Path:
    return cache_dir() / "bin" / "current"


def binary(name: str) -> Path:
    """Path of a control-plane tool: the `current` link folder, else the versioned build folder."""
    link = bin_dir() / name
    if link.exists():
        return link
    v = read_versions()
    versioned = {
        "etcd": f"etcd-{v['ETCD_VERSION']}/etcd",
        "helm": f"helm-{v['HELM_VERSION']}/helm",
        "kwok": f"kwok-{v['KWOK_VERSION']}/kwok",
    }.get(name, f"kubernetes-{v['KUBERNETES_VERSION']}/{name}")
    return cache_dir() / "bin" / versioned


def missing_binaries() -> list[str]:
    names = (
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubectl",
        "kubelet",
        "kube-proxy",
        "coredns",
        "kube-router",
        "pause",
    )
    missing = [n for n in names if not os.access(binary(n), os.X_OK)]
    return missing + [n for n in ("containerd", "runc", "ctr", "buildah", "ipset", "iptables") if not shutil.which(n)]


def venv_python() -> str:
    cand = REPO / ".venv" / "bin" / "python"
    return str(cand) if cand.exists() else sys.executable


# ---------------------------------------------------------------------------------------------
# Paths and recorded state


@dataclass
class Paths:
    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def info(self) -> Path:
        return self.root / "cluster.json"

    def pidfile(self, comp: str) -> Path:
        return self.pids / f"{comp}.pid"

    def logfile(self, comp: str) -> Path:
        return self.logs / f"{comp}.log"

    @property
    def sessions(self) -> Path:
        return self.root / "sessions"

    @property
    def node(self) -> Path:
        return self.root / "node"


@contextlib.contextmanager
def locked(p: Paths):
    """Serialises up/down/release of one state folder (several test sessions may share it)."""
    p.root.mkdir(parents=True, exist_ok=True)
    with open(p.root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def load_info(p: Paths) -> dict:
    try:
        return json.loads(p.info.read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------------
# Processes, by recorded pid (checked against /proc so a recycled pid is never signalled)


def proc_start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def recorded_pid(p: Paths, comp: str) -> int | None:
    """The component's pid if the process we recorded is still the one running."""
    try:
        rec = json.loads(p.pidfile(comp).read_text())
    except (OSError, ValueError):
        return None
    pid = rec.get("pid")
    if not pid or proc_start_ticks(pid) != rec.get("start"):
        return None
    return pid


def recorded(p: Paths, comp: str, key: str):
    try:
        return json.loads(p.pidfile(comp).read_text()).get(key)
    except (OSError, ValueError):
        return None


def stale(p: Paths, comp: str, argv: list[str]) -> bool:
    """A running component started with other flags."""
    return recorded(p, comp, "argv") != argv


def spawn(p: Paths, comp: str, argv: list[str], env: dict | None = None) -> int:
    p.logs.mkdir(parents=True, exist_ok=True)
    p.pids.mkdir(parents=True, exist_ok=True)
    with open(p.logfile(comp), "ab") as out:
        out.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} start {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            [sys.executable, str(SUPERVISE), comp, "--", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            cwd=p.root,
        )
    p.pidfile(comp).write_text(json.dumps({"pid": proc.pid, "start": proc_start_ticks(proc.pid), "argv": argv}))
    log.info("started %s pid=%d log=%s", comp, proc.pid, p.logfile(comp))
    return proc.pid


def stop_child(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stop a process this one started: SIGTERM, then SIGKILL after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop(p: Paths, comp: str, timeout: float = 15.0) -> None:
    pid = recorded_pid(p, comp)
    if pid is None:
        p.pidfile(comp).unlink(missing_ok=True)
        return
    log.info("stopping %s pid=%d", comp, pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and recorded_pid(p, comp) is not None:
        time.sleep(0.1)
    if recorded_pid(p, comp) is not None:
        log.warning("%s did not stop in %.0fs: SIGKILL", comp, timeout)
        for victim in (pid, *children(pid)):  # the supervisor first, so it starts nothing new
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        while recorded_pid(p, comp) is not None:
            time.sleep(0.1)
    p.pidfile(comp).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# PKI and kubeconfig


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def new_ca(d: Path, subj: str, days: int, *extensions: str) -> None:
    """A self-signed CA in d (ca.key, ca.crt) with these X.509v3 extensions."""
    added = [arg for ext in extensions for arg in ("-addext", ext)]
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
            "-subj", subj, *added, cwd=d)  # fmt: skip


def issue_leaf(d: Path, name: str, subj: str, ext: str, days: int) -> None:
    """<name>.key and <name>.crt signed by d's CA with the extensions file text `ext`; the
    certificate is renamed into place, so a crash never leaves half of one."""
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subj,
            cwd=d)  # fmt: skip
    (d / f"{name}.ext").write_text(ext)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt.tmp", "-days", str(days), "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    (d / f"{name}.crt.tmp").rename(d / f"{name}.crt")


SERVING_SANS = [
    "IP:127.0.0.1",
    f"IP:{node.NODE_IP}",
    f"IP:{node.KUBERNETES_SERVICE_IP}",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
]
SERVER_EXT = (
    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
)
CLIENT_EXT = (
    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
)
# name -> (subject, extensions); every leaf is signed by the one CA.
LEAVES = {
    "apiserver": ("/CN=kube-apiserver", SERVER_EXT + f"subjectAltName={','.join(SERVING_SANS)}\n"),
    "admin": ("/O=system:masters/CN=tfps-admin", CLIENT_EXT),
    # the kubelet's serving certificate: the apiserver verifies it (logs, exec, port-forward)
    "kubelet": (f"/CN=system:node:{NODE_NAME}", SERVER_EXT + f"subjectAltName=IP:{node.NODE_IP},DNS:{NODE_NAME}\n"),
    # the kubelet's API identity, authorized by the Node authorizer
    "node": (f"/O=system:nodes/CN=system:node:{NODE_NAME}", CLIENT_EXT),
    # bound to the built-in system:node-proxier role
    "kube-proxy": ("/CN=system:kube-proxy", CLIENT_EXT),
}


def ensure_pki(p: Paths) -> None:
    """CA, leaf certificates and the service-account key pair; creates only what is missing."""
    d = p.pki
    if (d / "layout").exists() and (d / "layout").read_text() != PKI_LAYOUT:
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    (d / "layout").write_text(PKI_LAYOUT)
    if not (d / "ca.crt").exists():
        log.info("creating PKI in %s", d)
        new_ca(
            d,
            "/CN=tfps-local-ca",
            3650,
            "basicConstraints=critical,CA:TRUE",
            "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )
    for name, (subj, ext) in LEAVES.items():
        if not (d / f"{name}.crt").exists():
            issue_leaf(d, name, subj, ext, 3650)
    if not (d / "sa.pub").exists():
        openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=d)
        openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    for f in d.glob("*.key"):
        f.chmod(0o600)


def write_kubeconfig(p: Paths, url: str, user: str = "admin", path: Path | None = None) -> None:
    pki = p.pki
    path = path or p.kubeconfig
    text = f"""apiVersion: v1
kind: Config
clusters:
- name: tfps-local
  cluster:
    server: {url}
    certificate-authority: {pki / "ca.crt"}
users:
- name: tfps-admin
  user:
    client-certificate: {pki / f"{user}.crt"}
    client-key: {pki / f"{user}.key"}
contexts:
- name: tfps-local
  context: {{cluster: tfps-local, user: tfps-admin, namespace: default}}
current-context: tfps-local
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)


# ---------------------------------------------------------------------------------------------
# Health


def ssl_context(p: Paths) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(p.pki / "ca.crt"))
    ctx.load_cert_chain(str(p.pki / "admin.crt"), str(p.pki / "admin.key"))
    return ctx


def api_call(
    p: Paths,
    url: str,
    path: str,
    timeout: float = 3.0,
    method: str = "GET",
    body: object = None,
    content_type: str = "application/json",
) -> tuple[int, bytes]:
    """One API call as the admin: (HTTP status, body); status 0 when the server did not answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, context=ssl_context(p), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ssl.SSLError) as e:
        return 0, str(e).encode()


def etcd_healthy(info: dict) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{info['etcd_port']}/health", timeout=2) as r:
            return json.loads(r.read()).get("health") == "true"
    except (OSError, ValueError, KeyError):
        return False


def wait_for(what: str, check, timeout: float, comp: str, p: Paths) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if recorded_pid(p, comp) is None:
            raise SystemExit(
                f"{comp} exited while waiting for {what}; see {p.logfile(comp)}:\n" + tail(p.logfile(comp))
            )
        time.sleep(0.3)
    raise SystemExit(
        f"timed out after {timeout:.0f}s waiting for {what}; see {p.logfile(comp)}:\n" + tail(p.logfile(comp))
    )


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------
# Components


def etcd_argv(p: Paths, info: dict) -> list[str]:
    client = f"http://127.0.0.1:{info['etcd_port']}"
    peer = f"http://127.0.0.1:{info['etcd_peer_port']}"
    return [
        str(binary("etcd")),
        "--name=tfps",
        f"--data-dir={p.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=tfps={peer}",
        "--unsafe-no-fsync",
        "--log-level=warn",
        "--quota-backend-bytes=4294967296",
    ]


def apiserver_argv(p: Paths, info: dict) -> list[str]:
    pki = p.pki
    return [
        str(binary("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{info['etcd_port']}",
        # the node address: pods reach it through the `kubernetes` Service (kube-proxy)
        f"--bind-address={node.NODE_IP}",
        f"--advertise-address={node.NODE_IP}",
        f"--secure-port={info['apiserver_port']}",
        f"--cert-dir={pki}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--service-account-issuer=https://127.0.0.1:{info['apiserver_port']}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--authorization-mode=Node,RBAC",
        f"--service-cluster-ip-range={node.SERVICE_CIDR}",
        "--endpoint-reconciler-type=lease",
        # logs, exec and port-forward go to the kubelet by the node's address, never by its host
        # name (which would need a DNS server off the machine)
        "--kubelet-preferred-address-types=InternalIP",
        f"--kubelet-client-certificate={pki / 'admin.crt'}",
        f"--kubelet-client-key={pki / 'admin.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        "--allow-privileged=true",
        FEATURE_GATES,
        "--runtime-config=scheduling.k8s.io/v1alpha1=true",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_argv(p: Paths, info: dict) -> list[str]:
    pki = p.pki
    return [
        str(binary("kube-controller-manager")),
        f"--kubeconfig={p.kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--secure-port=0",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        # No cloud, no pod CIDRs: leave out the controllers that only make sense with them.
        "--controllers=*,-cloud-node-lifecycle-controller,-node-ipam-controller,"
        "-service-lb-controller,-node-route-controller",
        FEATURE_GATES,
        "--profiling=false",
        "--v=1",
    ]


def scheduler_argv(p: Paths, info: dict) -> list[str]:
    return [
        str(binary("kube-scheduler")),
        f"--kubeconfig={p.kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--secure-port=0",
        # v=2: each binding, each "no fit" and each preemption, for the failure reports
        FEATURE_GATES,
        "--profiling=false",
        "--v=2",
    ]


def containerd_argv(p: Paths, info: dict) -> list[str]:
    return ["containerd", f"--config={p.node / 'containerd.toml'}"]


def kubelet_argv(p: Paths, info: dict) -> list[str]:
    return [
        str(binary("kubelet")),
        f"--config={p.node / 'kubelet.yaml'}",
        f"--kubeconfig={p.node / 'kubelet.kubeconfig'}",
        f"--root-dir={node.NODE_ROOT / 'kubelet'}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={node.NODE_IP}",
        "--v=1",
    ]


def kube_proxy_argv(p: Paths, info: dict) -> list[str]:
    return [str(binary("kube-proxy")), f"--config={p.node / 'kube-proxy.yaml'}", "--v=1"]


def coredns_argv(p: Paths, info: dict) -> list[str]:
    return [str(binary("coredns")), "-conf", str(p.node / "Corefile")]


def kube_router_argv(p: Paths, info: dict) -> list[str]:
    return node.kube_router_argv(str(binary("kube-router")), p.kubeconfig)


ARGV = {
    "etcd": etcd_argv,
    "kube-apiserver": apiserver_argv,
    "kube-controller-manager": controller_manager_argv,
    "kube-scheduler": scheduler_argv,
    "containerd": containerd_argv,
    "kubelet": kubelet_argv,
    "kube-proxy": kube_proxy_argv,
    "coredns": coredns_argv,
    "kube-router": kube_router_argv,
}


def default_sa_exists(p: Paths, url: str) -> bool:
    code, _ = api_call(p, url, "/api/v1/namespaces/default/serviceaccounts/default")
    return code == 200


def ready_condition(p: Paths, url: str) -> tuple[int, dict, list[dict]]:
    """The node's Ready condition and its taints as the API shows them, with the HTTP status of the
    read (no condition and no taints when it failed)."""
    code, body = api_call(p, url, f"/api/v1/nodes/{NODE_NAME}")
    if code != 200:
        return code, {}, []
    node_obj = json.loads(body)
    ready = next((c for c in node_obj.get("status", {}).get("conditions", []) if c.get("type") == "Ready"), {})
    return code, ready, node_obj.get("spec", {}).get("taints") or []


def node_ready(p: Paths, url: str, since: float = 0.0) -> bool:
    """The node is Ready, by a status the kubelet posted at or after `since` (epoch seconds) when given."""
    _, ready, _ = ready_condition(p, url)
    return ready.get("status") == "True" and calendar.timegm(
        time.strptime(ready.get("lastHeartbeatTime", "1970-01-01T00:00:00Z"), "%Y-%m-%dT%H:%M:%SZ")
    ) >= int(since)


def node_summary(p: Paths, url: str) -> str:
    """The node's Ready condition and its taints (the scheduler's reasons), in one line."""
    code, ready, taints = ready_condition(p, url)
    if code != 200:
        return f"not readable (HTTP {code or 'no answer'})"
    names = [f"{t.get('key')}:{t.get('effect')}" for t in taints]
    return (
        f"Ready={ready.get('status', '?')} ({ready.get('reason', '')}, last heartbeat "
        f"{ready.get('lastHeartbeatTime', '?')}), taints: {', '.join(names) or 'none'}"
    )


def advertise_extended_resources(p: Paths, url: str) -> None:
    patch = [
        {"op": "add", "path": f"/status/capacity/{name.replace('/', '~1')}", "value": value}
        for name, value in node.EXTENDED_RESOURCES.items()
    ]
    code, body = api_call(
        p,
        url,
        f"/api/v1/nodes/{NODE_NAME}/status",
        timeout=10,
        method="PATCH",
        body=patch,
        content_type="application/json-patch+json",
    )
    if code != 200:
        raise SystemExit(f"could not advertise {node.EXTENDED_RESOURCES} on node {NODE_NAME}: {code} {body[:300]!r}")


def write_node_config(p: Paths, info: dict) -> None:
    d = p.node
    d.mkdir(parents=True, exist_ok=True)
    url = info["apiserver_url"]
    write_kubeconfig(p, url, user="node", path=d / "kubelet.kubeconfig")
    write_kubeconfig(p, url, user="kube-proxy", path=d / "kube-proxy.kubeconfig")
    (d / "containerd.toml").write_text(node.containerd_config(pause_image()))
    (d / "resolv.conf").write_text(f"nameserver {node.DNS_IP}\noptions ndots:5\n")
    (d / "kubelet.yaml").write_text(json.dumps(node.kubelet_config(p.pki, d / "resolv.conf"), indent=1))
    (d / "kube-proxy.yaml").write_text(json.dumps(node.kube_proxy_config(d / "kube-proxy.kubeconfig"), indent=1))
    (d / "Corefile").write_text(node.corefile(p.kubeconfig, info["dns_health_port"], info["dns_ready_port"]))


def pause_image() -> str:
    return f"tfps.local/pause:{read_versions()['KUBERNETES_VERSION']}"


def ctr(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return node.sh("ctr", "--address", str(node.CONTAINERD_SOCK), "-n", "k8s.io", *args, check=check)


def containerd_ready() -> bool:
    return node.CONTAINERD_SOCK.exists() and ctr("version", check=False).returncode == 0


def load_images(p: Paths) -> None:
    """The pause image and the project's images (hack/build-images.sh builds them), imported into
    the node's containerd unless it has them already."""
    have = set(ctr("images", "ls", "-q").stdout.split())
    if pause_image() not in have:
        archive = cache_dir() / "images" / f"pause-{read_versions()['KUBERNETES_VERSION']}.tar"
        if not archive.exists():
            build_pause_image(archive)
        ctr("images", "import", "--no-unpack", str(archive))
    proc = subprocess.run(
        [str(REPO / "hack" / "load-images.sh"), "--address", str(node.CONTAINERD_SOCK)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        log.warning("the project's images were not loaded (run `make images`):\n%s", proc.stderr[-2000:])
    else:
        log.info("images: %s", proc.stdout.strip().replace("\n", "; "))


def build_pause_image(archive: Path) -> None:
    """FROM scratch, the pause binary built from the Kubernetes source, as uid 65535."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    ctx = archive.parent / "pause-context"
    ctx.mkdir(exist_ok=True)
    shutil.copy(binary("pause"), ctx / "pause")
    (ctx / "Containerfile").write_text('FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n')
    node.sh(
        "buildah",
        "bud",
        "--isolation=chroot",
        "--pull=never",
        "-t",
        pause_image(),
        "-f",
        str(ctx / "Containerfile"),
        str(ctx),
    )
    node.sh("buildah", "push", pause_image(), f"docker-archive:{archive}.partial:{pause_image()}")
    Path(f"{archive}.partial").rename(archive)


def live_sessions(p: Paths) -> list[int]:
    out = []
    for f in p.sessions.glob("*") if p.sessions.exists() else []:
        try:
            pid, start = json.loads(f.read_text())
        except (OSError, ValueError):
            pid = start = None
        if pid and proc_start_ticks(pid) == start:
            out.append(pid)
        else:
            f.unlink(missing_ok=True)
    return out


def register_session(p: Paths, pid: int) -> None:
    p.sessions.mkdir(parents=True, exist_ok=True)
    (p.sessions / str(pid)).write_text(json.dumps([pid, proc_start_ticks(pid)]))


def release(p: Paths, pid: int) -> bool:
    """Ends a session's use of the cluster; the last session out stops a cluster a session started."""
    (p.sessions / str(pid)).unlink(missing_ok=True)
    others = live_sessions(p)
    if others or load_info(p).get("owner") != "session":
        log.info("cluster left running (sessions still using it: %s)", others or "none, started by hand")
        return False
    down(p, purge=False)
    return True


def up(p: Paths, with_node: bool, session: int | None = None) -> dict:
    if os.geteuid() != 0:
        raise SystemExit("hack/cluster.sh up needs root: the node makes a bridge, iptables rules and cgroups")
    missing = missing_binaries()
    if missing:
        raise SystemExit(
            f"cluster parts missing: {', '.join(missing)} (binaries looked for in {bin_dir()}); "
            f"run `make cluster-tools` (hack/build-cluster.sh, hack/build-node.sh, "
            f"hack/install-system-deps.sh)"
        )
    t0 = time.monotonic()
    p.root.mkdir(parents=True, exist_ok=True)
    ensure_pki(p)
    info = load_info(p)
    running = {c: recorded_pid(p, c) is not None for c in COMPONENTS}
    started: list[str] = []
    if session:
        register_session(p, session)
    if not running["etcd"]:
        # A cold etcd starts empty, and everything above it restarts against it.
        for comp in reversed(COMPONENTS[1:]):
            stop(p, comp)
            running[comp] = False
        info = start_fresh_etcd(p, session)
        started.append("etcd")
    if session is None and info.get("owner") != "manual":
        # Someone wants this cluster by hand: test sessions must no longer stop it when they end.
        info["owner"] = "manual"
        p.info.write_text(json.dumps(info, indent=1))
    if not p.kubeconfig.exists():
        write_kubeconfig(p, info["apiserver_url"])

    node_up = all(running[c] for c in NODE)
    if not node_up:
        # The node's network must exist before the apiserver binds the node address.
        for comp in reversed(NODE):
            stop(p, comp)
        stop_other_owner(p)
        node.prepare()
        (node.NODE_RUN / "owner").write_text(str(p.root))
    started += start_control_plane(p, info, running)
    if with_node and not node_up:
        start_node(p, info)
        started += list(NODE)
    elif with_node:
        load_images(p)  # images rebuilt since the node started (a no-op when it has them)

    info = {**info, "started": started, "seconds": round(time.monotonic() - t0, 1)}
    log.info(
        "cluster up at %s (started: %s) in %.1fs",
        info["apiserver_url"],
        ", ".join(started) or "nothing, reused",
        info["seconds"],
    )
    return info


def start_fresh_etcd(p: Paths, session: int | None) -> dict:
    shutil.rmtree(p.etcd_data, ignore_errors=True)
    ports = set()
    while len(ports) < 5:
        ports.add(free_port())
    info = dict(
        zip(
            ("etcd_port", "etcd_peer_port", "apiserver_port", "dns_health_port", "dns_ready_port"),
            sorted(ports),
            strict=True,
        )
    )
    info["owner"] = "session" if session else "manual"
    info["apiserver_url"] = f"https://{node.NODE_IP}:{info['apiserver_port']}"
    p.info.write_text(json.dumps(info, indent=1))
    write_kubeconfig(p, info["apiserver_url"])
    spawn(p, "etcd", etcd_argv(p, info))
    wait_for("etcd /health", lambda: etcd_healthy(info), 60, "etcd", p)
    return info


def start_control_plane(p: Paths, info: dict, running: dict[str, bool]) -> list[str]:
    """Starts what is not running (and restarts what runs with other flags; etcd never, it would
    start empty); returns what it started."""
    url, started = info["apiserver_url"], []
    for comp in CONTROL_PLANE[1:]:
        if running[comp] and stale(p, comp, ARGV[comp](p, info)):
            log.info("%s was started with other flags: restarting it", comp)
            stop(p, comp)
            running[comp] = False
    if not running["kube-apiserver"]:
        spawn(p, "kube-apiserver", apiserver_argv(p, info))
        started.append("kube-apiserver")
    wait_for("kube-apiserver /readyz", lambda: api_call(p, url, "/readyz")[0] == 200, 120, "kube-apiserver", p)
    for comp in ("kube-controller-manager", "kube-scheduler"):
        if not running[comp]:
            spawn(p, comp, ARGV[comp](p, info))
            started.append(comp)
    wait_for(
        "the default ServiceAccount (controller-manager)",
        lambda: default_sa_exists(p, url),
        90,
        "kube-controller-manager",
        p,
    )
    if recorded_pid(p, "kube-scheduler") is None:
        raise SystemExit(
            f"kube-scheduler exited; see {p.logfile('kube-scheduler')}:\n" + tail(p.logfile("kube-scheduler"))
        )
    return started


def start_node(p: Paths, info: dict) -> None:
    url = info["apiserver_url"]
    write_node_config(p, info)
    spawn(p, "containerd", containerd_argv(p, info))
    wait_for("containerd", containerd_ready, 60, "containerd", p)
    load_images(p)
    spawn(p, "kubelet", kubelet_argv(p, info))
    wait_for(f"node {NODE_NAME} Ready", lambda: node_ready(p, url), 120, "kubelet", p)
    advertise_extended_resources(p, url)
    for comp in ("kube-proxy", "coredns", "kube-router"):
        spawn(p, comp, ARGV[comp](p, info))
    wait_for("CoreDNS ready", lambda: http_ok(f"http://127.0.0.1:{info['dns_ready_port']}/ready"), 60, "coredns", p)
    wait_for("the kubernetes Service's iptables rules (kube-proxy)", kube_proxy_synced, 60, "kube-proxy", p)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def kube_proxy_synced() -> bool:
    rules = node.sh("iptables-save", "-t", "nat", check=False).stdout
    return f"-d {node.KUBERNETES_SERVICE_IP}/32" in rules


def stop_other_owner(p: Paths) -> None:
    """A node started from another state folder (another checkout) is stopped before this one starts."""
    try:
        other = Path((node.NODE_RUN / "owner").read_text().strip())
    except OSError:
        return
    if other != p.root and other.exists():
        log.info("stopping the node started from %s", other)
        for comp in reversed(NODE):
            stop(Paths(other), comp)


def restart(p: Paths, comps: list[str]) -> list[str]:
    """Stop the named components (those running) and start them again on the same ports and data,
    etcd's included: the cluster survives, as a real one survives a control-plane restart, and the
    node's containers survive a restart of containerd and the kubelet. Also starts components ended
    by `stop`. Returns what was started, in start order."""
    info = load_info(p)
    if not info or not p.kubeconfig.exists():
        raise SystemExit("no cluster recorded in this state folder: run `hack/cluster.sh up` first")
    order = [c for c in COMPONENTS if c in comps]
    t0 = time.time()
    for comp in reversed(order):
        stop(p, comp)
    url = info["apiserver_url"]
    for comp in order:
        spawn(p, comp, ARGV[comp](p, info))
        if comp == "etcd":
            wait_for("etcd /health", lambda: etcd_healthy(info), 60, comp, p)
        elif comp == "kube-apiserver":
            wait_for("kube-apiserver /readyz", lambda: api_call(p, url, "/readyz")[0] == 200, 120, comp, p)
        elif comp == "containerd":
            wait_for("containerd", containerd_ready, 60, comp, p)
        elif comp == "kubelet":
            wait_for(
                f"node {NODE_NAME} Ready, posted by the new kubelet", lambda: node_ready(p, url, since=t0), 120, comp, p
            )
    log.info("restarted %s", ", ".join(order))
    return order


def down(p: Paths, purge: bool) -> None:
    for comp in reversed(COMPONENTS):
        stop(p, comp)
    try:
        owner = (node.NODE_RUN / "owner").read_text().strip()
    except OSError:
        owner = str(p.root)
    if owner == str(p.root):
        node.teardown(purge_images=purge)
        (node.NODE_RUN / "owner").unlink(missing_ok=True)
    if purge:
        shutil.rmtree(p.root, ignore_errors=True)
        log.info("removed %s", p.root)


def status(p: Paths) -> int:
    info = load_info(p)
    ok = True
    for comp in COMPONENTS:
        pid = recorded_pid(p, comp)
        ok &= pid is not None
        print(f"{comp:25} {'running pid ' + str(pid) if pid else 'stopped'}")
    if info:
        code = api_call(p, info["apiserver_url"], "/readyz")[0] if recorded_pid(p, "kube-apiserver") else 0
        print(f"{'apiserver':25} {info['apiserver_url']} readyz={code or 'unreachable'}")
        ok &= code == 200
        if code == 200:
            print(f"{'node':25} {node_summary(p, info['apiserver_url'])}")
    print(f"{'kubeconfig':25} {p.kubeconfig}")
    print(f"{'logs':25} {p.logs}")
    return 0 if ok else 1


def env_lines(p: Paths) -> list[str]:
    return [f"export KUBECONFIG={p.kubeconfig}", f"export PATH={bin_dir()}:$PATH"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hack/cluster.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-dir", type=Path, default=None, help="default $TFPS_STATE or <repo>/.tfps")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start (or reuse) the control plane and the node")
    u.add_argument("--no-node", action="store_true", help="control plane only")
    u.add_argument("--json", action="store_true", help="print what was started as JSON")
    u.add_argument("--session", type=int, help="pid of a test session using the cluster (see `release`)")
    d = sub.add_parser("down", help="stop everything started from this state folder")
    d.add_argument("--purge", action="store_true", help="also delete the state folder and the node's image store")
    r = sub.add_parser("release", help="a session is done; the last one out stops a cluster sessions started")
    r.add_argument("--session", type=int, required=True)
    st = sub.add_parser("stop", help="stop single components (`up` starts them again)")
    st.add_argument("components", nargs="+", choices=COMPONENTS)
    rs = sub.add_parser("restart", help="stop and start components keeping etcd's data (also starts stopped ones)")
    rs.add_argument("components", nargs="+", choices=COMPONENTS)
    sub.add_parser("status", help="show components; exit 1 unless all run and the API is ready")
    sub.add_parser("env", help='print shell exports (eval "$(hack/cluster.sh env)")')
    sub.add_parser("kubeconfig", help="print the kubeconfig path")
    sub.add_parser("logs", help="print the logs folder")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    p = Paths(args.state_dir or state_dir())
    if args.cmd == "up":
        with locked(p):
            info = up(p, not args.no_node, args.session)
        if args.json:
            print(json.dumps({**info, "kubeconfig": str(p.kubeconfig), "state_dir": str(p.root)}))
        else:
            print("\n".join(env_lines(p)))
        return 0
    if args.cmd == "down":
        with locked(p):
            down(p, args.purge)
        return 0
    if args.cmd == "stop":
        with locked(p):
            for comp in args.components:
                stop(p, comp)
        return 0
    if args.cmd == "restart":
        with locked(p):
            restart(p, args.components)
        return 0
    if args.cmd == "release":
        with locked(p):
            release(p, args.session)
        return 0
    if args.cmd == "status":
        return status(p)
    if args.cmd == "env":
        print("\n".join(env_lines(p)))
        return 0
    if args.cmd == "kubeconfig":
        print(p.kubeconfig)
        return 0
    if args.cmd == "logs":
        print(p.logs)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
