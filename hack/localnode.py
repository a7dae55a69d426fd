#!/usr/bin/env python3
"""The local node: a kubelet stand-in that runs this project's pods as local processes.

There is no container runtime on the machines tfps is developed and tested on. This process
registers a Node (cpu, memory, pods and nvidia.com/gpu capacity), keeps its Lease renewed, and
runs the pods bound to it whose images are the project's own (tfps/operator, tfps/ps,
tfps/worker, any registry and tag) as processes of the project's virtual environment:

- each pod gets a unique, stable loopback IP (127.10.0.0/16) reported as status.podIP;
- each container runs under `unshare -m -u` with, bind-mounted in its own mount namespace, a
  per-pod /etc/hosts (the pods of its namespace that a headless Service names, rewritten in
  place as pods come and go), an /etc/resolv.conf that points at 127.0.0.1 only, and the pod's
  volumes (emptyDir, hostPath, secret, configMap, downwardAPI, projected ServiceAccount token);
- env has the downward API fields and KUBERNETES_SERVICE_HOST/PORT of the loopback apiserver;
- status is written like a kubelet (phase, conditions, containerStatuses, restartCount), the
  pod's restartPolicy is honoured, deletion sends SIGTERM, waits the grace period, SIGKILLs and
  then removes the object; pods of other images go to Failed with reason ErrImagePull;
- init containers run first, in order; readiness, liveness and startup probes (exec, httpGet,
  tcpSocket, grpc) are aimed at the pod IP; `kubectl logs` reaches the log files through an
  HTTPS endpoint on 127.0.0.1 (the node's kubelet port).

Not done: container isolation beyond the mount and UTS namespaces (pods share the host's network
namespace, so a connection's source address is 127.0.0.1, not the pod IP; securityContext and
resource limits are not enforced), `kubectl exec`/`port-forward`, and Endpoints/EndpointSlices
(the controller-manager refuses loopback addresses in them).

Pod processes outlive a restart of this process and are adopted by the next one (each container
is recorded with its pid and start time; a small shell parent records the exit code).

Usage: localnode.py run --kubeconfig K --state-dir D [--cpu 16 --memory 64Gi --gpus 4 ...]
       localnode.py stop-pods --state-dir D     (end every pod process this node started)
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import ipaddress
import json
import logging
import os
import platform
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("tfps.localnode")

REPO = Path(__file__).resolve().parent.parent
NODE_NAME = "tfps-local"
HOST_IP = "127.0.0.1"
POD_NET = ipaddress.ip_network("127.10.0.0/16")
RUNTIME = "tfps-localnode://0.1.0"
# The project's images: repository (last two path parts) -> arguments when the pod gives neither
# command nor args (the images' ENTRYPOINT is `tfps`).
RUNNABLE_IMAGES = {"tfps/operator": ["operator"], "tfps/ps": ["ps"], "tfps/worker": ["worker"]}
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
CRASH_BACKOFF_MAX = 30.0
POLL = 0.5


# ---------------------------------------------------------------------------------------------
# Structured logging: one JSON object a line, with the pod and container named as fields.


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "msg": record.getMessage()}
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def ev(level: int, msg: str, **fields) -> None:
    log.log(level, msg, extra={"fields": fields}, exc_info=fields.pop("exc_info", False))


def job_fields(pod: dict) -> dict:
    """The TrainingJob and replica a pod belongs to (the operator's labels), for log lines."""
    try:
        from tfps.api import naming
    except ImportError:
        return {}
    labels = pod["metadata"].get("labels") or {}
    out = {}
    if naming.LABEL_JOB in labels:
        out["job"] = labels[naming.LABEL_JOB]
    if naming.LABEL_TYPE in labels:
        out["replica"] = f"{labels[naming.LABEL_TYPE]}-{labels.get(naming.LABEL_INDEX, '')}".rstrip("-")
    return out


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------
# Pure helpers: images, IPs, hosts files, env


def image_repository(image: str) -> str:
    """`reg:5000/a/tfps/worker:1.0@sha256:..` -> `reg:5000/a/tfps/worker`."""
    ref = image.split("@", 1)[0]
    last = ref.rsplit("/", 1)
    if ":" in last[-1]:
        last[-1] = last[-1].rsplit(":", 1)[0]
    return "/".join(last)


def runnable_repo(image: str) -> str | None:
    """The project's repository name (`tfps/worker`) an image reference points at, or None."""
    repo = "/".join(image_repository(image).split("/")[-2:])
    return repo if repo in RUNNABLE_IMAGES else None


def ip_for(key: str, taken: set[str]) -> str:
    """A stable address in POD_NET for `key`, probing past addresses already taken."""
    size = POD_NET.num_addresses
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    for i in range(size):
        ip = POD_NET[(h + i) % size]
        last = int(ip) & 0xFF
        if last in (0, 255) or str(ip) in taken:
            continue
        return str(ip)
    raise RuntimeError("pod address range exhausted")


def pod_hostname(pod: dict) -> str:
    return pod["spec"].get("hostname") or pod["metadata"]["name"]


def dns_names(hostname: str, subdomain: str, ns: str) -> list[str]:
    base = f"{hostname}.{subdomain}"
    return [f"{base}.{ns}.svc.cluster.local", f"{base}.{ns}.svc", f"{base}.{ns}", base]


def selector_matches(selector: dict | None, labels: dict | None) -> bool:
    return all((labels or {}).get(k) == v for k, v in (selector or {}).items())


def hosts_file(pod: dict, ip: str, peers: list[tuple[str, dict]], services: dict[str, dict]) -> str:
    """The /etc/hosts of one pod: like the kubelet's (localhost, its own names), plus the records a
    cluster DNS would serve for the pods of its namespace that a headless Service of their
    subdomain selects (publishNotReadyAddresses semantics: a pod is listed once it has an IP)."""
    ns = pod["metadata"]["namespace"]
    own = pod_hostname(pod)
    sub = pod["spec"].get("subdomain")
    lines = ["# Kubernetes-managed hosts file (tfps local node).", "127.0.0.1\tlocalhost",
             "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines.append(f"{ip}\t{' '.join(dns_names(own, sub, ns)[:1] + [own]) if sub else own}")
    for peer_ip, peer in peers:
        psub = peer["spec"].get("subdomain")
        host = peer["spec"].get("hostname")
        svc = services.get(psub or "")
        if not (host and psub and svc) or svc.get("spec", {}).get("clusterIP") != "None":
            continue
        if not selector_matches(svc["spec"].get("selector"), peer["metadata"].get("labels")):
            continue
        lines.append(f"{peer_ip}\t{' '.join(dns_names(host, psub, ns))}")
    return "\n".join(lines) + "\n"


RESOLV_CONF = ("# tfps local node: cluster names come from /etc/hosts; nothing leaves 127.0.0.0/8.\n"
               "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")


def write_in_place(path: Path, text: str) -> None:
    """Rewrite a file keeping its inode: it is bind-mounted into running pods."""
    if path.exists():
        if path.read_text() == text:
            return
        with open(path, "r+") as f:
            f.truncate(0)
            f.write(text)
    else:
        path.write_text(text)


VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known names are replaced, $$ escapes, unknown refs stay."""
    return VAR_REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


class ConfigError(Exception):
    """The pod asks for something this node cannot give yet (a missing Secret key...)."""


def field_ref(pod: dict, ip: str, path: str) -> str:
    meta = pod["metadata"]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    values = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
              "metadata.uid": meta.get("uid", ""), "spec.nodeName": pod["spec"].get("nodeName", ""),
              "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
              "status.podIP": ip, "status.podIPs": ip, "status.hostIP": HOST_IP, "status.hostIPs": HOST_IP}
    if path not in values:
        raise ConfigError(f"unsupported fieldRef {path}")
    return values[path]


def resource_ref(container: dict, ref: dict, node_alloc: dict) -> str:
    kind, _, res = ref["resource"].partition(".")
    value = ((container.get("resources") or {}).get(kind) or {}).get(res)
    return str(value if value is not None else node_alloc.get(res, "0"))


@dataclass
class Lookups:
    """Reads Secrets and ConfigMaps for env and volumes (a callable each, so builders stay pure)."""
    secret: callable
    configmap: callable


def container_env(pod: dict, container: dict, ip: str, base: dict[str, str], lookups: Lookups,
                  node_alloc: dict) -> dict[str, str]:
    env = dict(base)
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        if "configMapRef" in src:
            ref = src["configMapRef"]
            data = lookups.configmap(ref["name"], ref.get("optional", False)) or {}
        else:
            ref = src["secretRef"]
            data = lookups.secret(ref["name"], ref.get("optional", False)) or {}
        env.update({prefix + k: v.decode() if isinstance(v, bytes) else v for k, v in data.items()})
    for var in container.get("env") or []:
        name = var["name"]
        if "value" in var or "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        vf = var["valueFrom"]
        if "fieldRef" in vf:
            env[name] = field_ref(pod, ip, vf["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in vf:
            env[name] = resource_ref(container, vf["resourceFieldRef"], node_alloc)
        elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
            is_secret = "secretKeyRef" in vf
            ref = vf["secretKeyRef" if is_secret else "configMapKeyRef"]
            data = (lookups.secret if is_secret else lookups.configmap)(ref["name"], ref.get("optional", False))
            if data is None or ref["key"] not in data:
                if ref.get("optional"):
                    continue
                raise ConfigError(f"{'secret' if is_secret else 'configmap'} {ref['name']!r} has no key "
                                  f"{ref['key']!r} (env {name})")
            v = data[ref["key"]]
            env[name] = v.decode() if isinstance(v, bytes) else v
        else:
            raise ConfigError(f"unsupported valueFrom in env {name}")
    return env


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    command = container.get("command") or []
    args = container.get("args")
    if not command:
        command = ["tfps"]
        if args is None:
            args = RUNNABLE_IMAGES[runnable_repo(container["image"])]
    return [expand(a, env) for a in [*command, *(args or [])]]


# ---------------------------------------------------------------------------------------------
# Probes (readiness, liveness, startup), aimed at the pod's loopback IP


def probe_port(port, container: dict) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


def probe_once(probe: dict, ip: str, container: dict, pid: int | None, env: dict) -> tuple[bool, str]:
    """One probe attempt: (success, what happened)."""
    import socket
    import urllib.error
    import urllib.request

    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "exec" in probe:
            cmd = ["nsenter", "-t", str(pid), "-m", "-u", "--", *probe["exec"]["command"]]
            r = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
            return r.returncode == 0, f"exit code {r.returncode}: {(r.stdout + r.stderr).strip()[-200:]}"
        if "tcpSocket" in probe:
            t = probe["tcpSocket"]
            with socket.create_connection((t.get("host") or ip, probe_port(t["port"], container)), timeout=timeout):
                return True, "connected"
        if "httpGet" in probe:
            h = probe["httpGet"]
            scheme = h.get("scheme", "HTTP").lower()
            url = f"{scheme}://{h.get('host') or ip}:{probe_port(h['port'], container)}{h.get('path', '/')}"
            headers = {"User-Agent": "kube-probe/tfps-localnode",
                       **{x["name"]: x["value"] for x in h.get("httpHeaders") or []}}
            req = urllib.request.Request(url, headers=headers)
            handlers = [urllib.request.ProxyHandler({})]  # never through a proxy: loopback only
            if scheme == "https":
                handlers.append(urllib.request.HTTPSHandler(context=ssl._create_unverified_context()))
            try:
                with urllib.request.build_opener(*handlers).open(req, timeout=timeout) as r:
                    return 200 <= r.status < 400, f"HTTP {r.status}"
            except urllib.error.HTTPError as e:
                return False, f"HTTP probe failed with statuscode: {e.code}"
        if "grpc" in probe:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            g = probe["grpc"]
            with grpc.insecure_channel(f"{ip}:{g['port']}", options=[("grpc.enable_http_proxy", 0)]) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=g.get("service", "")), timeout=timeout)
                ok = resp.status == health_pb2.HealthCheckResponse.SERVING
                return ok, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return False, "unsupported probe handler"
    except Exception as e:  # a refused connection, a timeout...: the probe failed
        return False, f"{type(e).__name__}: {e}"


class Prober(threading.Thread):
    """Runs a container's probes while that process runs; reports through the Container's flags."""

    def __init__(self, worker: "PodWorker", c: "Container", env: dict):
        super().__init__(name=f"probe-{worker.ns}/{worker.pod_name}/{c.name}", daemon=True)
        self.worker, self.c, self.env, self.pid = worker, c, env, c.pid

    def run(self) -> None:
        c, spec = self.c, self.c.spec
        probes = {k: spec[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if spec.get(k)}
        t0 = time.monotonic()
        due = {k: t0 + float(p.get("initialDelaySeconds", 0)) for k, p in probes.items()}
        ok_n = dict.fromkeys(probes, 0)
        fail_n = dict.fromkeys(probes, 0)
        while c.pid == self.pid and c.running() and not self.worker.node.stopping.is_set():
            now = time.monotonic()
            for kind, p in probes.items():
                if now < due[kind] or (kind != "startupProbe" and not c.started_ok):
                    continue
                if kind == "startupProbe" and c.started_ok:
                    continue
                due[kind] = now + float(p.get("periodSeconds", 10))
                ok, msg = probe_once(p, self.worker.ip, spec, self.pid, self.env)
                ok_n[kind], fail_n[kind] = (ok_n[kind] + 1, 0) if ok else (0, fail_n[kind] + 1)
                failed = fail_n[kind] >= int(p.get("failureThreshold", 3))
                if not ok:
                    ev(logging.INFO, "probe failed", probe=kind, result=msg, container=c.name, **self.worker.f())
                if kind == "startupProbe":
                    c.started_ok = ok
                    if failed:
                        c.kill_reason = f"startup probe failed: {msg}"
                elif kind == "livenessProbe" and failed:
                    c.kill_reason = f"liveness probe failed: {msg}"
                elif kind == "readinessProbe":
                    if ok and ok_n[kind] >= int(p.get("successThreshold", 1)):
                        c.ready = True
                    elif failed:
                        c.ready = False
                self.worker.wake.set()
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# Processes


def proc_start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def alive(pid: int | None, start: int | None) -> bool:
    return bool(pid) and proc_start_ticks(pid) == start


def signal_group(pid: int, start: int | None, sig: int) -> None:
    if alive(pid, start):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


# Runs as the container's parent inside its own mount and UTS namespaces: mounts, then runs the
# command and records its exit code (so a restarted node can still learn it). It ignores the
# group's SIGTERM itself (a trap, reset for the command on exec) and exits with the command.
# A pod may mount a volume over the folder that holds its own files (an emptyDir at /tmp while
# the state folder is under /tmp): so the exit file and default working folder are opened first,
# and the pod's folder is reached through a bind mount at /run/tfps-pod made before any other.
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_MESSAGE_BYTES = 4096

LAUNCHER = r'''
set -e
exitfile=$1; workdir=$2; podhost=$3; poddir=$4; codedir=$5; shift 5
exec 9>"$exitfile"
case "$workdir" in default:*) cd "${workdir#default:}" ;; esac
mkdir -p /run/tfps-pod /run/tfps-code
mount --bind "$poddir" /run/tfps-pod
mount --bind "$codedir" /run/tfps-code
while [ "$1" != "--" ]; do
  src=$1; dst=$2; mode=$3; shift 3
  case "$src" in "$poddir"/*) src="/run/tfps-pod/${src#"$poddir"/}" ;; esac
  if [ -d "$src" ]; then mkdir -p "$dst"; else mkdir -p "$(dirname "$dst")"; [ -e "$dst" ] || : > "$dst"; fi
  mount --bind "$src" "$dst"
  if [ "$mode" = ro ]; then mount -o remount,bind,ro "$dst"; fi
done
shift
# A volume over the folder that holds tfps and its venv (an emptyDir at /tmp while the checkout
# lives under /tmp) would hide the program the pod runs: put that folder back on top.
if [ "$(stat -c %d:%i "$codedir" 2>/dev/null)" != "$(stat -c %d:%i /run/tfps-code)" ]; then
  mkdir -p "$codedir"
  mount --bind /run/tfps-code "$codedir"
fi
hostname "$podhost" 2>/dev/null || true
case "$workdir" in default:*) ;; *) mkdir -p "$workdir"; cd "$workdir" ;; esac
set +e
trap : TERM INT HUP
"$@" 9>&-
rc=$?
echo "$rc" >&9
exit "$rc"
'''


@dataclass
class Container:
    spec: dict
    rundir: Path
    pid: int | None = None
    start: int | None = None
    popen: subprocess.Popen | None = None
    restart_count: int = 0
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    next_start: float = 0.0  # monotonic time of the next (re)start
    done: bool = False  # terminated and not to be restarted
    restarting: bool = False  # the next start is a restart (counted in restartCount)
    ready: bool = True  # the readiness probe's verdict (True without one)
    started_ok: bool = True  # the startup probe's verdict (True without one)
    kill_reason: str | None = None  # set by a failing liveness/startup probe

    @property
    def name(self) -> str:
        return self.spec["name"]

    def record(self) -> None:
        self.rundir.mkdir(parents=True, exist_ok=True)
        (self.rundir / "proc.json").write_text(json.dumps(
            {"pid": self.pid, "start": self.start, "restartCount": self.restart_count, "state": self.state,
             "lastState": self.last_state, "restarting": self.restarting}))

    def load(self) -> bool:
        try:
            rec = json.loads((self.rundir / "proc.json").read_text())
        except (OSError, ValueError):
            return False
        self.pid, self.start = rec.get("pid"), rec.get("start")
        self.restart_count = rec.get("restartCount", 0)
        self.state, self.last_state = rec.get("state") or self.state, rec.get("lastState") or {}
        self.restarting = rec.get("restarting", False)
        return True

    def running(self) -> bool:
        return "running" in self.state

    def poll_exit(self) -> int | None:
        """The exit code once the process has ended, else None."""
        if self.popen is not None:
            rc = self.popen.poll()
            if rc is None:
                return None
            return rc if rc >= 0 else 128 - rc
        if alive(self.pid, self.start):
            return None
        try:
            return int((self.rundir / "exit").read_text().strip())
        except (OSError, ValueError):
            return 137  # killed along with its recording shell (the file stays empty)


# ---------------------------------------------------------------------------------------------
# The node


class LocalNode:
    def __init__(self, args: argparse.Namespace):
        from kubernetes import client, config

        self.args = args
        self.state = Path(args.state_dir).resolve()
        self.run_dir = self.state / "run"
        self.logs_dir = self.state / "pods"
        self.api = config.new_client_from_config(config_file=str(args.kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.coord = client.CoordinationV1Api(self.api)
        self.client = client
        host = self.api.configuration.host  # https://127.0.0.1:PORT
        self.api_port = host.rsplit(":", 1)[1].split("/")[0]
        self.api_host = host.split("//", 1)[1].rsplit(":", 1)[0]
        self.ca_file = self.api.configuration.ssl_ca_cert
        self.alloc = {"cpu": str(args.cpu), "memory": args.memory, "pods": str(args.pods),
                      "nvidia.com/gpu": str(args.gpus), "ephemeral-storage": args.ephemeral_storage}
        self.lock = threading.RLock()
        self.pods: dict[str, dict] = {}  # uid -> pod, the pods bound to this node
        self.services: dict[str, dict[str, dict]] = {}  # ns -> name -> Service
        self.workers: dict[str, PodWorker] = {}
        self.finished: set[str] = set()  # uids of pods this node has stopped and removed
        self.ips_file = self.state / "pod-ips.json"
        self.ips: dict[str, str] = self._load_ips()
        self.stopping = threading.Event()
        self.kubelet_port = 0
        venv_bin = REPO / ".venv" / "bin"
        self.bin_path = str(venv_bin if venv_bin.exists() else Path(sys.executable).parent)

    # -- addresses -----------------------------------------------------------------------------

    def _load_ips(self) -> dict[str, str]:
        try:
            return json.loads(self.ips_file.read_text())
        except (OSError, ValueError):
            return {}

    def _save_ips(self) -> None:
        tmp = self.ips_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ips, indent=0, sort_keys=True))
        tmp.replace(self.ips_file)

    def pod_ip(self, pod: dict) -> str:
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        with self.lock:
            if key not in self.ips:
                self.ips[key] = ip_for(key, set(self.ips.values()))
                self._save_ips()
            return self.ips[key]

    def release_ip(self, pod: dict) -> None:
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        with self.lock:
            # another pod of the same name may have arrived already: keep its address
            if key in self.ips and not any(
                    f"{p['metadata']['namespace']}/{p['metadata']['name']}" == key for p in self.pods.values()):
                del self.ips[key]
                self._save_ips()

    # -- the Node object and its heartbeat -----------------------------------------------------

    def node_body(self) -> dict:
        t = now_rfc3339()

        def cond(kind, status, reason, msg):
            return {"type": kind, "status": status, "reason": reason, "message": msg,
                    "lastHeartbeatTime": t, "lastTransitionTime": self.started_at}

        uname = platform.uname()
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(uname.machine, uname.machine)
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.args.node_name, "labels": {
                "kubernetes.io/hostname": self.args.node_name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": arch,
                "tfps.io/local-node": "true"}},
            "status": {
                "capacity": self.alloc, "allocatable": self.alloc,
                "conditions": [
                    cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "tfps local node"),
                    cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "tfps local node"),
                    cond("PIDPressure", "False", "KubeletHasSufficientPID", "tfps local node"),
                    cond("Ready", "True", "KubeletReady", "tfps local node runs the project's images as processes"),
                ],
                # InternalIP only: the apiserver then reaches this node at 127.0.0.1, never by a host
                # name that would need a DNS server off the machine.
                "addresses": [{"type": "InternalIP", "address": HOST_IP}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port or 0}},
                "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": uname.release,
                             "osImage": "tfps local node", "containerRuntimeVersion": RUNTIME,
                             "kubeletVersion": self.kube_version, "kubeProxyVersion": "",
                             "operatingSystem": "linux", "architecture": arch},
            },
        }

    # -- the kubelet endpoint: container logs for `kubectl logs` (via the apiserver) -------------

    def serve_logs(self) -> int:
        """HTTPS on 127.0.0.1 with client certificates of the cluster CA, like the kubelet's port.
        Serves /containerLogs/<ns>/<pod>/<container> (tailLines, limitBytes, follow)."""
        pki = self.state / "pki"
        files = [pki / "kubelet.crt", pki / "kubelet.key", pki / "ca.crt"]
        if not all(f.exists() for f in files):
            ev(logging.WARNING, "no kubelet certificate: `kubectl logs` will not reach this node", pki=str(pki))
            return 0
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(files[0]), str(files[1]))
        ctx.load_verify_locations(str(files[2]))
        ctx.verify_mode = ssl.CERT_REQUIRED
        node = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *a):
                log.debug(fmt, *a)

            def do_GET(self):
                url = urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self.send_error(501, "the tfps local node serves container logs only")
                    return
                ns, pod, container = parts[1:]
                if not all(re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", x) for x in parts[1:]):
                    self.send_error(400, "invalid namespace, pod or container name")
                    return
                q = {k: v[-1] for k, v in parse_qs(url.query).items()}
                path = node.logs_dir / ns / pod / f"{container}.log"
                if not path.exists():
                    self.send_error(404, f"no log of container {container} in pod {ns}/{pod}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.end_headers()
                with open(path, "rb") as f:
                    data = f.read()
                    if q.get("tailLines"):
                        n = int(q["tailLines"])
                        data = b"".join(data.splitlines(keepends=True)[-n:]) if n > 0 else b""
                    if q.get("limitBytes"):
                        data = data[:int(q["limitBytes"])]
                    self.wfile.write(data)
                    self.wfile.flush()
                    while q.get("follow") == "true" and not node.stopping.is_set():
                        chunk = f.read()
                        if chunk:
                            self.wfile.write(chunk)
                            self.wfile.flush()
                        elif not node.container_running(ns, pod, container):
                            break
                        else:
                            time.sleep(0.2)

        srv = ThreadingHTTPServer((HOST_IP, self.args.kubelet_port), Handler)
        srv.daemon_threads = True
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True, do_handshake_on_connect=False)
        threading.Thread(target=srv.serve_forever, name="kubelet-endpoint", daemon=True).start()
        return srv.server_address[1]

    def container_running(self, ns: str, pod: str, container: str) -> bool:
        with self.lock:
            workers = [w for w in self.workers.values() if (w.ns, w.pod_name) == (ns, pod)]
        return any(c.running() for w in workers for c in w.containers if c.name == container)

    def register(self) -> None:
        from kubernetes.client.rest import ApiException

        self.started_at = now_rfc3339()
        try:
            self.kube_version = self.client.VersionApi(self.api).get_code().git_version
        except ApiException:
            self.kube_version = "v0.0.0"
        body = self.node_body()
        try:
            self.core.create_node(body)
            ev(logging.INFO, "node registered", node=self.args.node_name, capacity=self.alloc)
        except ApiException as e:
            if e.status != 409:
                raise
            self.core.patch_node(self.args.node_name, {"metadata": body["metadata"]})
            ev(logging.INFO, "node exists, updating", node=self.args.node_name)
        self.core.patch_node_status(self.args.node_name, {"status": body["status"]},
                                    _content_type="application/merge-patch+json")

    def heartbeat_loop(self) -> None:
        from kubernetes.client.rest import ApiException

        last_status = time.monotonic()
        while not self.stopping.wait(10):
            try:
                self.renew_lease()
                if time.monotonic() - last_status > 40:
                    try:
                        self.core.patch_node_status(self.args.node_name, {"status": self.node_body()["status"]},
                                                    _content_type="application/merge-patch+json")
                    except ApiException as e:
                        if e.status != 404:
                            raise
                        self.register()
                    last_status = time.monotonic()
            except Exception as e:  # the API may be restarting; try again next beat
                ev(logging.WARNING, "heartbeat failed", error=str(e))

    def renew_lease(self) -> None:
        from kubernetes.client.rest import ApiException

        name, ns = self.args.node_name, "kube-node-lease"
        t = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec = {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": t}
        try:
            self.coord.patch_namespaced_lease(name, ns, {"spec": spec})
        except ApiException as e:
            if e.status != 404:
                raise
            node = self.core.read_node(name)
            self.coord.create_namespaced_lease(ns, {
                "metadata": {"name": name, "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node.metadata.uid}]},
                "spec": spec})

    # -- informers -----------------------------------------------------------------------------

    def informer(self, what: str, list_fn, on_sync, on_event, **kw) -> None:
        from kubernetes import watch

        while not self.stopping.is_set():
            try:
                resp = list_fn(_preload_content=False, **kw)
                data = json.loads(resp.data)
                on_sync(data["items"])
                rv = data["metadata"]["resourceVersion"]
                w = watch.Watch()
                for e in w.stream(list_fn, resource_version=rv, timeout_seconds=240,
                                  allow_watch_bookmarks=True, **kw):
                    if self.stopping.is_set():
                        w.stop()
                        return
                    if e["type"] == "ERROR":
                        break  # e.g. 410 Gone: list again
                    if e["type"] != "BOOKMARK":
                        on_event(e["type"], e["raw_object"])
            except Exception as e:
                if self.stopping.is_set():
                    return
                ev(logging.WARNING, "watch failed, listing again", kind=what, error=str(e))
                time.sleep(1)

    def on_pods_sync(self, items: list[dict]) -> None:
        seen = {p["metadata"]["uid"] for p in items}
        with self.lock:
            gone = [p for uid, p in self.pods.items() if uid not in seen]
        for p in gone:
            self.on_pod("DELETED", p)
        for p in items:
            self.on_pod("MODIFIED", p)

    def on_pod(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        ns = pod["metadata"]["namespace"]
        with self.lock:
            if kind == "DELETED":
                self.pods.pop(uid, None)
                self.release_ip(pod)
                w = self.workers.get(uid)
                if w:
                    w.object_deleted(pod)
            else:
                self.pods[uid] = pod
                w = self.workers.get(uid)
                if uid in self.finished:
                    pass
                elif w is None:
                    w = self.workers[uid] = PodWorker(self, pod)
                    w.start()
                else:
                    w.update(pod)
        self.refresh_hosts(ns)

    def on_services_sync(self, items: list[dict]) -> None:
        with self.lock:
            old = {ns for ns in self.services}
            self.services = {}
            for s in items:
                self.services.setdefault(s["metadata"]["namespace"], {})[s["metadata"]["name"]] = s
            namespaces = old | set(self.services)
        for ns in namespaces:
            self.refresh_hosts(ns)

    def on_service(self, kind: str, svc: dict) -> None:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        with self.lock:
            if kind == "DELETED":
                self.services.get(ns, {}).pop(name, None)
            else:
                self.services.setdefault(ns, {})[name] = svc
        self.refresh_hosts(ns)

    def refresh_hosts(self, ns: str) -> None:
        with self.lock:
            pods = [p for p in self.pods.values()
                    if p["metadata"]["namespace"] == ns and not p["metadata"].get("deletionTimestamp")
                    and p["status"].get("phase") not in ("Succeeded", "Failed")]
            peers = sorted(((self.pod_ip(p), p) for p in pods), key=lambda t: t[1]["metadata"]["name"])
            services = dict(self.services.get(ns, {}))
            for p in self.pods.values():
                if p["metadata"]["namespace"] != ns:
                    continue
                path = self.run_dir / p["metadata"]["uid"] / "hosts"  # made by the pod's prepare()
                if path.exists():
                    try:
                        write_in_place(path, hosts_file(p, self.pod_ip(p), peers, services))
                    except FileNotFoundError:
                        pass  # the pod was removed meanwhile

    # -- secrets and config maps -------------------------------------------------------------

    def lookups(self, ns: str) -> Lookups:
        from kubernetes.client.rest import ApiException

        def secret(name, optional):
            try:
                s = self.core.read_namespaced_secret(name, ns, _preload_content=False)
            except ApiException as e:
                if e.status == 404 and optional:
                    return None
                raise ConfigError(f"secret {name!r} not found") from e
            return {k: base64.b64decode(v) for k, v in (json.loads(s.data).get("data") or {}).items()}

        def configmap(name, optional):
            try:
                c = json.loads(self.core.read_namespaced_config_map(name, ns, _preload_content=False).data)
            except ApiException as e:
                if e.status == 404 and optional:
                    return None
                raise ConfigError(f"configmap {name!r} not found") from e
            out = dict(c.get("data") or {})
            out.update({k: base64.b64decode(v) for k, v in (c.get("binaryData") or {}).items()})
            return out

        return Lookups(secret, configmap)

    def service_account_token(self, pod: dict, audience: str | None, seconds: int) -> str:
        meta = pod["metadata"]
        body = {"spec": {"audiences": [audience] if audience else [], "expirationSeconds": seconds,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                            "uid": meta["uid"]}}}
        resp = self.core.create_namespaced_service_account_token(
            pod["spec"].get("serviceAccountName") or "default", meta["namespace"], body, _preload_content=False)
        return json.loads(resp.data)["status"]["token"]

    # -- lifecycle -----------------------------------------------------------------------------

    def cleanup_orphans(self, live_uids: set[str]) -> None:
        """Processes of pods that were removed while this node was down are ended."""
        if not self.run_dir.exists():
            return
        for d in self.run_dir.iterdir():
            if d.name in live_uids:
                continue
            stop_recorded(d, grace=5)
            shutil.rmtree(d, ignore_errors=True)
            ev(logging.INFO, "cleaned up a pod removed while the node was down", uid=d.name)

    def run(self) -> int:
        self.kubelet_port = self.serve_logs()
        self.register()
        self.renew_lease()
        field = f"spec.nodeName={self.args.node_name}"
        first = json.loads(self.core.list_pod_for_all_namespaces(field_selector=field, _preload_content=False).data)
        self.cleanup_orphans({p["metadata"]["uid"] for p in first["items"]})
        threads = [
            threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True),
            threading.Thread(target=self.informer, name="services", daemon=True, args=(
                "Service", self.core.list_service_for_all_namespaces, self.on_services_sync, self.on_service)),
            threading.Thread(target=self.informer, name="pods", daemon=True, args=(
                "Pod", self.core.list_pod_for_all_namespaces, self.on_pods_sync, self.on_pod),
                kwargs={"field_selector": field}),
        ]
        for t in threads:
            t.start()
        ev(logging.INFO, "local node running", node=self.args.node_name, state_dir=str(self.state),
           apiserver=self.api.configuration.host)
        (self.state / "localnode.ready").write_text(str(os.getpid()))  # `hack/cluster.sh up` waits for it
        self.stopping.wait()
        # Pod processes stay: the next local node adopts them (`stop-pods` ends them).
        ev(logging.INFO, "local node stopping; pod processes keep running", node=self.args.node_name)
        return 0


def stop_recorded(rundir_of_pod: Path, grace: float) -> None:
    """End every recorded container process under one pod's run folder: TERM, grace, KILL."""
    procs = []
    for rec in rundir_of_pod.glob("*/*/proc.json"):  # containers/ and init/
        try:
            r = json.loads(rec.read_text())
        except (OSError, ValueError):
            continue
        if alive(r.get("pid"), r.get("start")):
            procs.append((r["pid"], r["start"]))
            signal_group(r["pid"], r["start"], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while procs and time.monotonic() < deadline:
        procs = [p for p in procs if alive(*p)]
        time.sleep(0.1)
    for p in procs:
        signal_group(*p, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# One pod: from bound to deleted, in its own thread.


class PodWorker(threading.Thread):
    def __init__(self, node: LocalNode, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.node = node
        self.pod = pod
        self.uid = meta["uid"]
        self.ns, self.pod_name = meta["namespace"], meta["name"]
        self.wake = threading.Event()
        self.deleted = False  # the object is gone from the API
        self.dir = node.run_dir / self.uid
        self.logdir = node.logs_dir / self.ns / self.pod_name
        self.ip = node.pod_ip(pod)
        self.job = job_fields(pod)
        self.inits = [Container(c, self.dir / "init" / c["name"]) for c in pod["spec"].get("initContainers") or []]
        self.containers = [Container(c, self.dir / "containers" / c["name"]) for c in pod["spec"]["containers"]]
        for c in self.containers if self.inits else []:
            c.state = {"waiting": {"reason": "PodInitializing"}}
        self.init_failed = False
        self.prepared = False
        self.mounts: dict[str, Path] = {}
        self.failure: tuple[str, str] | None = None  # pod-level (reason, message) of a pod it cannot run
        self.started_at: str | None = None
        self.conditions: dict[str, dict] = {}
        self.last_status: dict | None = None

    @property
    def all_containers(self) -> list[Container]:
        return self.inits + self.containers

    def f(self, **kw) -> dict:
        return {"pod": f"{self.ns}/{self.pod_name}", **self.job, **kw}

    def update(self, pod: dict) -> None:
        self.pod = pod
        self.wake.set()

    def object_deleted(self, pod: dict) -> None:
        self.pod = pod
        self.deleted = True
        self.wake.set()

    def run(self) -> None:
        try:
            self.lifecycle()
            with self.node.lock:
                self.node.finished.add(self.uid)  # late events of a removed pod start nothing
        except Exception:
            ev(logging.ERROR, "pod worker crashed (the next event of the pod starts another)", exc_info=True,
               **self.f())
        finally:
            with self.node.lock:
                if self.node.workers.get(self.uid) is self:
                    del self.node.workers[self.uid]

    # -- the loop ------------------------------------------------------------------------------

    def lifecycle(self) -> None:
        pod = self.pod
        phase = pod["status"].get("phase")
        self.terminal = phase in ("Succeeded", "Failed")
        adopted = any([c.load() for c in self.all_containers])
        if self.terminal:
            self.prepared = True
            for c in self.all_containers:
                c.done = True
        else:
            self.check_runnable()
            if adopted:
                self.adopt()
        while True:
            if self.deleted or self.pod["metadata"].get("deletionTimestamp"):
                self.terminate()
                return
            if not self.terminal and self.failure is None:
                self.step()
            status = self.status()
            if status != self.last_status:
                self.write_status(status)
            # a finished pod only waits for its deletion: no need to poll it often
            self.wake.wait(5.0 if self.terminal else POLL)
            self.wake.clear()

    def check_runnable(self) -> None:
        spec = self.pod["spec"]
        bad = [c for c in self.all_containers if runnable_repo(c.spec.get("image", "")) is None]
        if bad:
            img = bad[0].spec.get("image", "")
            msg = (f"image {img!r} cannot run on the tfps local node: it runs only the project's images "
                   f"({', '.join(sorted(RUNNABLE_IMAGES))}, any registry and tag) as local processes")
            for c in bad:
                c.state = {"waiting": {"reason": "ErrImagePull", "message": msg}}
            self.fail("ErrImagePull", msg)
        elif any(c.spec.get("restartPolicy") == "Always" for c in self.inits):
            self.fail("UnsupportedPodSpec", "the tfps local node does not run sidecar init containers")

    def fail(self, reason: str, msg: str) -> None:
        self.failure = (reason, msg)
        self.terminal = True
        for c in self.all_containers:
            c.done = True
        ev(logging.WARNING, "pod cannot run", reason=reason, message=msg, **self.f())

    def adopt(self) -> None:
        # prepare() runs again (it keeps emptyDir contents and rewrites the other volumes in place)
        # so a container that restarts later finds its volumes.
        self.prepared = False
        for c in self.all_containers:
            if "running" in c.state and alive(c.pid, c.start):
                ev(logging.INFO, "adopted running container", container=c.name, pid=c.pid, **self.f())
                try:
                    env = container_env(self.pod, c.spec, self.ip, self.base_env(), self.node.lookups(self.ns),
                                        self.node.alloc)
                except Exception:
                    env = self.base_env()
                self.start_probes(c, env)
            elif "running" in c.state:
                c.popen = None  # ended while no node watched: its exit code is in the run folder
            elif "terminated" in c.state:
                c.done = True
                self.init_failed |= c in self.inits and c.state["terminated"]["exitCode"] != 0
            elif c.restarting:
                c.next_start = time.monotonic()
        self.started_at = self.pod["status"].get("startTime")

    def should_restart(self, c: Container, code: int) -> bool:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        if c in self.inits:  # an init container runs until it succeeds, unless the policy is Never
            return policy != "Never" and code != 0
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def step(self) -> None:
        if not self.prepared:
            try:
                self.prepare()
            except Exception as e:  # a missing Secret or an API hiccup: the kubelet retries too
                msg = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
                if self.containers[0].state.get("waiting", {}).get("message") != msg:
                    ev(logging.WARNING, "pod set-up failed, retrying", error=msg, **self.f())
                for c in self.containers:
                    if not c.running():  # an adopted process keeps running meanwhile
                        c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": msg}}
            else:
                self.prepared = True
        now = time.monotonic()
        for c in self.all_containers:
            if c.running() and c.kill_reason:
                ev(logging.INFO, "killing container, it will be restarted per restartPolicy", reason=c.kill_reason,
                   container=c.name, **self.f())
                c.kill_reason = None
                threading.Thread(target=self.kill_gracefully, args=(c.pid, c.start), daemon=True).start()
            if c.running():
                code = c.poll_exit()
                if code is not None:
                    self.exited(c, code)
        if self.init_failed:
            for c in self.containers:
                c.done = True
        # Init containers one after another, then all the others together.
        pending = next((c for c in self.inits if not c.done), None)
        for c in [pending] if pending else self.containers:
            if self.prepared and not c.running() and not c.done and now >= c.next_start:
                try:
                    self.start_container(c)
                except Exception as e:
                    c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                    c.next_start = now + 2
        if all(c.done for c in self.containers):
            self.terminal = True

    def kill_gracefully(self, pid: int, start: int | None) -> None:
        signal_group(pid, start, signal.SIGTERM)
        deadline = time.monotonic() + float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        while alive(pid, start) and time.monotonic() < deadline:
            time.sleep(0.1)
        signal_group(pid, start, signal.SIGKILL)

    def start_probes(self, c: Container, env: dict) -> None:
        spec = c.spec
        c.ready = not spec.get("readinessProbe")
        c.started_ok = not spec.get("startupProbe")
        c.kill_reason = None
        if any(spec.get(k) for k in ("startupProbe", "livenessProbe", "readinessProbe")):
            Prober(self, c, env).start()

    def exited(self, c: Container, code: int) -> None:
        c.popen = None
        term = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                "startedAt": c.state["running"]["startedAt"], "finishedAt": now_rfc3339(),
                "containerID": f"tfps://{c.pid}"}
        if code > 128:
            term["signal"] = code - 128
        message = self.termination_message(c, code)
        if message:
            term["message"] = message
        ev(logging.INFO, "container exited", container=c.name, exit_code=code, **self.f())
        if self.should_restart(c, code) and not self.pod["metadata"].get("deletionTimestamp"):
            backoff = min(CRASH_BACKOFF_MAX, 2.0 ** min(c.restart_count, 5))
            c.last_state = {"terminated": term}
            c.state = {"waiting": {"reason": "CrashLoopBackOff" if code else "Completed",
                                   "message": f"back-off {backoff:.0f}s restarting container {c.name}"}}
            c.next_start = time.monotonic() + backoff
            c.restarting = True
        else:
            c.state = {"terminated": term}
            c.done = True
            self.init_failed |= c in self.inits and code != 0
        c.record()

    def termination_message(self, c: Container, code: int) -> str:
        """The container's terminationMessagePath file, or with FallbackToLogsOnError and a failure,
        the tail of its log (the kubelet's limits: 4096 bytes, 80 lines)."""
        path = c.rundir / "termination-log"
        text = path.read_bytes()[-TERMINATION_MESSAGE_BYTES:].decode(errors="replace") if path.exists() else ""
        if not text.strip() and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            log_file = self.logdir / f"{c.name}.log"
            if log_file.exists():
                lines = log_file.read_bytes()[-TERMINATION_MESSAGE_BYTES:].decode(errors="replace").splitlines()
                text = "\n".join(lines[-80:])
        return text.strip()

    # -- preparing and starting ----------------------------------------------------------------

    def prepare(self) -> None:
        """Pod-level set-up: folders, hosts file, resolv.conf, volumes."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rotate_logs()
        write_in_place(self.dir / "resolv.conf", RESOLV_CONF)
        if not (self.dir / "hosts").exists():
            (self.dir / "hosts").write_text("")
        self.node.refresh_hosts(self.ns)
        self.mounts = self.prepare_volumes()
        self.started_at = self.started_at or now_rfc3339()

    def rotate_logs(self) -> None:
        marker = self.logdir / ".uid"
        if marker.exists() and marker.read_text() != self.uid:
            old = marker.read_text()[:8]
            self.logdir.rename(self.logdir.with_name(f"{self.pod_name}.{old}"))
        self.logdir.mkdir(parents=True, exist_ok=True)
        marker.write_text(self.uid)

    def prepare_volumes(self) -> dict[str, Path]:
        lookups = self.node.lookups(self.ns)
        out: dict[str, Path] = {}
        for v in self.pod["spec"].get("volumes") or []:
            name = v["name"]
            target = self.dir / "volumes" / name
            if "emptyDir" in v:
                target.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in v:
                hp = v["hostPath"]
                target = Path(hp["path"])
                if hp.get("type") == "DirectoryOrCreate":
                    target.mkdir(parents=True, exist_ok=True)
                elif not target.exists():
                    raise ConfigError(f"hostPath {target} does not exist (volume {name})")
            elif "secret" in v or "configMap" in v:
                is_secret = "secret" in v
                src = v["secret" if is_secret else "configMap"]
                data = (lookups.secret(src["secretName"], src.get("optional", False)) if is_secret
                        else lookups.configmap(src["name"], src.get("optional", False)))
                write_volume(target, project_items(data or {}, src.get("items")), src.get("defaultMode", 0o644))
            elif "downwardAPI" in v:
                write_volume(target, self.downward_files(v["downwardAPI"].get("items") or []),
                             v["downwardAPI"].get("defaultMode", 0o644))
            elif "projected" in v:
                files: dict[str, bytes] = {}
                for s in v["projected"].get("sources") or []:
                    if "serviceAccountToken" in s:
                        t = s["serviceAccountToken"]
                        files[t["path"]] = self.node.service_account_token(
                            self.pod, t.get("audience"), t.get("expirationSeconds", 3600)).encode()
                    elif "configMap" in s or "secret" in s:
                        is_secret = "secret" in s
                        src = s["secret" if is_secret else "configMap"]
                        data = (lookups.secret if is_secret else lookups.configmap)(
                            src["name"], src.get("optional", False))
                        files.update(project_items(data or {}, src.get("items")))
                    elif "downwardAPI" in s:
                        files.update(self.downward_files(s["downwardAPI"].get("items") or []))
                    else:
                        raise ConfigError(f"unsupported projected source in volume {name}")
                write_volume(target, files, v["projected"].get("defaultMode", 0o644))
            else:
                kind = next((k for k in v if k != "name"), "?")
                raise ConfigError(f"volume {name}: {kind} volumes are not supported by the tfps local node")
            out[name] = target
        return out

    def downward_files(self, items: list[dict]) -> dict[str, bytes]:
        files = {}
        for it in items:
            if "fieldRef" in it:
                files[it["path"]] = field_ref(self.pod, self.ip, it["fieldRef"]["fieldPath"]).encode()
            elif "resourceFieldRef" in it:
                c = next(c.spec for c in self.all_containers
                         if c.name == it["resourceFieldRef"].get("containerName"))
                files[it["path"]] = resource_ref(c, it["resourceFieldRef"], self.node.alloc).encode()
        return files

    def base_env(self) -> dict[str, str]:
        node = self.node
        env = {"PATH": f"{node.bin_path}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOSTNAME": pod_hostname(self.pod), "PYTHONUNBUFFERED": "1",
               "KUBERNETES_SERVICE_HOST": node.api_host, "KUBERNETES_SERVICE_PORT": node.api_port,
               "KUBERNETES_SERVICE_PORT_HTTPS": node.api_port,
               "KUBERNETES_PORT": f"tcp://{node.api_host}:{node.api_port}"}
        for k in ("HOME", "LANG", "LC_ALL", "TZ"):
            if k in os.environ:
                env[k] = os.environ[k]
        return env

    def mount_args(self, c: Container) -> list[str]:
        args = [str(self.dir / "hosts"), "/etc/hosts", "ro", str(self.dir / "resolv.conf"), "/etc/resolv.conf", "ro"]
        for m in c.spec.get("volumeMounts") or []:
            if m["name"] not in self.mounts:
                raise ConfigError(f"volumeMount {m['name']!r} names no volume of the pod")
            src = self.mounts[m["name"]]
            if m.get("subPath"):
                src = src / m["subPath"]
                if not src.exists():
                    src.mkdir(parents=True)
            args += [str(src), m["mountPath"], "ro" if m.get("readOnly") else "rw"]
        # Like a kubelet: the container may leave a short message at terminationMessagePath, which
        # ends up in its terminated state (the runtime reports its final result there).
        args += [str(c.rundir / "termination-log"), c.spec.get("terminationMessagePath", TERMINATION_LOG), "rw"]
        return args

    def start_container(self, c: Container) -> None:
        env = container_env(self.pod, c.spec, self.ip, self.base_env(), self.node.lookups(self.ns), self.node.alloc)
        argv = container_argv(c.spec, env)
        workdir = c.spec.get("workingDir") or "default:" + str(self.dir / "work")
        (self.dir / "work").mkdir(exist_ok=True)
        if c.restarting:
            c.restart_count += 1
            c.restarting = False
        c.rundir.mkdir(parents=True, exist_ok=True)
        (c.rundir / "exit").unlink(missing_ok=True)
        (c.rundir / "termination-log").write_bytes(b"")
        cmd = ["unshare", "--mount", "--uts", "--propagation", "private", "/bin/sh", "-c", LAUNCHER, "launcher",
               str(c.rundir / "exit"), workdir, pod_hostname(self.pod)[:63], str(self.dir), str(REPO), *self.mount_args(c),
               "--", *argv]
        with open(self.logdir / f"{c.name}.log", "ab") as out:
            c.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                       start_new_session=True, cwd=str(self.dir))
        c.pid, c.start = c.popen.pid, proc_start_ticks(c.popen.pid)
        c.state = {"running": {"startedAt": now_rfc3339()}}
        c.record()
        self.start_probes(c, env)
        ev(logging.INFO, "container started", container=c.name, pid=c.pid, ip=self.ip, argv=argv,
           restart_count=c.restart_count, **self.f())

    # -- stopping ------------------------------------------------------------------------------

    def grace_seconds(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        g = meta.get("deletionGracePeriodSeconds")
        if g is None:
            g = spec.get("terminationGracePeriodSeconds", 30)
        return float(g)

    def terminate(self) -> None:
        from kubernetes.client.rest import ApiException

        running = [c for c in self.all_containers if c.running() and alive(c.pid, c.start)]
        grace = self.grace_seconds()
        if running:
            ev(logging.INFO, "stopping pod", grace_seconds=grace, **self.f())
        for c in running:
            signal_group(c.pid, c.start, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.poll_exit() is None for c in running) and time.monotonic() < deadline:
            time.sleep(0.1)
        for c in running:
            if c.poll_exit() is None:
                ev(logging.INFO, "grace period over: SIGKILL", container=c.name, **self.f())
                signal_group(c.pid, c.start, signal.SIGKILL)
                while c.poll_exit() is None:
                    time.sleep(0.05)
        for c in running:
            if c.popen is not None:
                c.popen.wait()
            code = c.poll_exit()
            c.state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                      "startedAt": c.state["running"]["startedAt"], "finishedAt": now_rfc3339(),
                                      "containerID": f"tfps://{c.pid}"}}
            c.done = True
        if not self.deleted:
            try:
                if running:
                    self.write_status(self.status())
                self.node.core.delete_namespaced_pod(
                    self.pod_name, self.ns, grace_period_seconds=0,
                    body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
            except ApiException as e:
                if e.status not in (404, 409):
                    raise
        shutil.rmtree(self.dir, ignore_errors=True)
        ev(logging.INFO, "pod removed", **self.f())

    # -- status --------------------------------------------------------------------------------

    def phase(self) -> str:
        if self.failure or self.init_failed:
            return "Failed"
        if any(not c.done for c in self.inits):
            return "Pending"
        cs = self.containers
        if self.terminal and all(c.done for c in cs):
            ok = all(c.state.get("terminated", {}).get("exitCode") == 0 for c in cs)
            return "Succeeded" if ok else "Failed"
        if any(c.running() or c.last_state or c.restart_count for c in cs):
            return "Running"
        return "Pending"

    def condition(self, kind: str, ok: bool, reason: str | None = None) -> dict:
        status = "True" if ok else "False"
        prev = self.conditions.get(kind)
        if prev is None or prev["status"] != status:
            prev = {"type": kind, "status": status, "lastTransitionTime": now_rfc3339(), "lastProbeTime": None}
            if reason:
                prev["reason"] = reason
            self.conditions[kind] = prev
        return prev

    def status(self) -> dict:
        if self.terminal and self.last_status is None and self.failure is None and all(
                c.done for c in self.containers) and self.pod["status"].get("phase") in ("Succeeded", "Failed"):
            return self.pod["status"]  # finished before this node started: leave it as it is
        phase = self.phase()

        def container_status(c: Container, ready: bool) -> dict:
            s = {"name": c.name, "image": c.spec.get("image", ""), "imageID": "", "ready": ready,
                 "started": c.running() and c.started_ok, "restartCount": c.restart_count, "state": c.state}
            if c.last_state:
                s["lastState"] = c.last_state
            if c.pid and "waiting" not in c.state:
                s["containerID"] = f"tfps://{c.pid}"
            return s

        statuses = [container_status(c, c.running() and c.ready) for c in self.containers]
        succeeded = [c.done and c.state.get("terminated", {}).get("exitCode") == 0 for c in self.inits]
        init_statuses = [container_status(c, ok) for c, ok in zip(self.inits, succeeded)]
        ready = phase == "Running" and all(c.running() and c.ready for c in self.containers)
        not_ready_reason = None if ready else ("PodCompleted" if phase in ("Succeeded", "Failed")
                                               else "ContainersNotReady")
        conds = [self.condition("PodReadyToStartContainers", self.prepared),
                 self.condition("Initialized", all(succeeded),
                                None if all(succeeded) else "ContainersNotInitialized"),
                 self.condition("Ready", ready, not_ready_reason),
                 self.condition("ContainersReady", ready, not_ready_reason),
                 self.condition("PodScheduled", True)]
        st = {"phase": phase, "conditions": conds, "hostIP": HOST_IP, "hostIPs": [{"ip": HOST_IP}],
              "containerStatuses": statuses, "qosClass": self.pod["status"].get("qosClass", "BestEffort")}
        if init_statuses:
            st["initContainerStatuses"] = init_statuses
        if self.prepared and not self.failure:
            st["podIP"], st["podIPs"] = self.ip, [{"ip": self.ip}]
        if self.started_at or self.failure:
            st["startTime"] = self.started_at or now_rfc3339()
            self.started_at = st["startTime"]
        if self.failure:
            st["reason"], st["message"] = self.failure
        return st

    def write_status(self, status: dict) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.node.core.patch_namespaced_pod_status(self.pod_name, self.ns, {"status": status})
            if self.last_status is None or status["phase"] != self.last_status.get("phase"):
                ev(logging.INFO, "pod phase", phase=status["phase"], ip=status.get("podIP"), **self.f())
            self.last_status = status
        except ApiException as e:
            if e.status != 404:
                ev(logging.WARNING, "status update failed", error=e.reason, **self.f())


def project_items(data: dict, items: list[dict] | None) -> dict[str, bytes]:
    def b(v):
        return v if isinstance(v, bytes) else str(v).encode()

    if not items:
        return {k: b(v) for k, v in data.items()}
    out = {}
    for it in items:
        if it["key"] not in data:
            raise ConfigError(f"key {it['key']!r} not found")
        out[it["path"]] = b(data[it["key"]])
    return out


def write_volume(target: Path, files: dict[str, bytes], mode: int) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="localnode.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="register the node and run its pods until SIGTERM")
    r.add_argument("--kubeconfig", required=True, type=Path)
    r.add_argument("--state-dir", required=True, type=Path)
    r.add_argument("--node-name", default=NODE_NAME)
    r.add_argument("--cpu", default="16")
    r.add_argument("--memory", default="64Gi")
    r.add_argument("--pods", default="250")
    r.add_argument("--gpus", default="4", help="nvidia.com/gpu capacity advertised")
    r.add_argument("--ephemeral-storage", default="100Gi")
    r.add_argument("--kubelet-port", type=int, default=0, help="port of the log endpoint on 127.0.0.1 (0: any)")
    s = sub.add_parser("stop-pods", help="end every pod process this node recorded (after the node is stopped)")
    s.add_argument("--state-dir", required=True, type=Path)
    s.add_argument("--grace", type=float, default=5.0)
    args = ap.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    if args.cmd == "stop-pods":
        run_dir = args.state_dir / "run"
        for d in run_dir.iterdir() if run_dir.exists() else []:
            stop_recorded(d, args.grace)
            shutil.rmtree(d, ignore_errors=True)
        (args.state_dir / "pod-ips.json").unlink(missing_ok=True)
        return 0
    node = LocalNode(args)
    signal.signal(signal.SIGTERM, lambda *_: node.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: node.stopping.set())
    return node.run()


if __name__ == "__main__":
    sys.exit(main())
