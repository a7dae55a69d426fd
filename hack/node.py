"""The real node of the local cluster: its addresses, its configuration files, and the host state it
changes (network, rules, sysctls, mounts, cgroups), set up before it starts and removed at teardown.

One node per machine: its addresses are fixed, so its runtime state lives in fixed folders
(NODE_ROOT, NODE_RUN) whatever state folder the control plane uses, and a start after a crash, or
from another checkout, finds what the last one left and removes it first.

Addresses (every one on this machine, in network namespaces the cluster makes itself):
  198.18.0.0/24     pods, on bridge tfps0 (198.18.0.1); pods have no default route
  198.19.0.1/32     the node: on `lo`; the apiserver, kubelet, CoreDNS listen here
  198.19.128.0/24   Service ClusterIPs, only ever DNAT-ed locally by kube-proxy
A guard drops any packet from the pod range to another address, and IP forwarding stays off.

Standard library only (hack/cluster.py runs before the project's virtual environment exists).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import time
from pathlib import Path

log = logging.getLogger("tfps.node")

NODE_NAME = "tfps-local"
NODE_ROOT = Path("/var/lib/tfps-node")  # containerd's images and snapshots, kubelet's root, IPAM
NODE_RUN = Path("/run/tfps-node")  # containerd's socket and state, the host-state record
BRIDGE = "tfps0"
POD_CIDR = "198.18.0.0/24"
BRIDGE_IP = "198.18.0.1"
CLUSTER_NET = "198.18.0.0/15"
NODE_IP = "198.19.0.1"
NODE_NET = "198.19.0.0/16"  # pods reach the node and ClusterIPs through the bridge address
SERVICE_CIDR = "198.19.128.0/24"
KUBERNETES_SERVICE_IP = "198.19.128.1"
DNS_IP = NODE_IP  # CoreDNS runs on the host, on the node address
KUBELET_PORT = 10250
CLUSTER_DOMAIN = "cluster.local"
# Extended resources the node advertises as a cluster operator would (there is no GPU here, so no
# device plugin): the scheduler places GPU workers, and TensorFlow finds no GPU and uses the CPU.
EXTENDED_RESOURCES = {"nvidia.com/gpu": "4"}

GUARD = "TFPS-GUARD"
GUARD_FWD = "TFPS-GUARD-FWD"
GUARD_OUT = "TFPS-GUARD-OUT"
# What the kubelet, kube-proxy and our own set-up change; recorded at start, restored at teardown.
SYSCTLS = (
    "kernel/panic",
    "kernel/panic_on_oops",
    "vm/overcommit_memory",
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
)
# Chains of the node's parts: ours, the kubelet's and kube-proxy's (KUBE-*), kube-router's.
OWN_CHAIN = re.compile(r"^(TFPS-|KUBE-)")
CGROUP_ROOT = Path("/sys/fs/cgroup")

CONTAINERD_SOCK = NODE_RUN / "containerd" / "containerd.sock"


class HostCommandFailed(RuntimeError):
    pass


def sh(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, input=input)
    if check and proc.returncode != 0:
        raise HostCommandFailed(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


# ---------------------------------------------------------------------------------------------
# Configuration files (pure: paths in, text out)


def containerd_config(sandbox_image: str) -> str:
    return f"""version = 2
root = "{NODE_ROOT / "containerd"}"
state = "{NODE_RUN / "containerd" / "state"}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
                    "io.containerd.internal.v1.opt", "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = "{CONTAINERD_SOCK}"

[ttrpc]
  address = ""

[debug]
  level = "warn"

[metrics]
  address = ""

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  # The machine's capability bounding set lacks CAP_SYS_RESOURCE: nobody may lower oom_score_adj.
  restrict_oom_score_adj = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    discard_unpacked_layers = false
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{NODE_RUN / "cni"}"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = ""
"""


def cni_config() -> dict:
    """A bridge with no gateway role (so nothing turns on forwarding) and no masquerade; pods get
    one route, to the node's addresses through the bridge address, and no default route."""
    return {
        "cniVersion": "1.0.0",
        "name": "tfps",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": False,
                "isDefaultGateway": False,
                "ipMasq": False,
                "hairpinMode": True,
                "promiscMode": False,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(NODE_ROOT / "ipam"),
                    "ranges": [[{"subnet": POD_CIDR, "rangeStart": "198.18.0.10", "gateway": BRIDGE_IP}]],
                    "routes": [{"dst": NODE_NET, "gw": BRIDGE_IP}],
                },
            }
        ],
    }


def kubelet_config(pki: Path, resolv_conf: Path) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,  # this machine has cgroup v1 only
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCK}",
        "address": NODE_IP,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": str(pki / "kubelet.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet.key"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "clusterDNS": [DNS_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(resolv_conf),
        "podLogsDirectory": str(NODE_ROOT / "pod-logs"),
        "failSwapOn": False,
        # Small disks: never evict or collect images because a disk is fuller than a default threshold.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "0%",
            "nodefs.available": "0%",
            "nodefs.inodesFree": "0%",
            "imagefs.available": "0%",
        },
        "serializeImagePulls": False,
        "registerNode": True,
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        "nodeStatusUpdateFrequency": "4s",
        "nodeStatusReportFrequency": "1m",
        "syncFrequency": "10s",
        "shutdownGracePeriod": "0s",
        "maxPods": 110,
    }


def kube_proxy_config(kubeconfig: Path) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "bindAddress": NODE_IP,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{NODE_IP}/32"],
        # Leave the machine's conntrack table size alone.
        "conntrack": {"maxPerCore": 0, "min": 0},
    }


def corefile(kubeconfig: Path, health_port: int, ready_port: int) -> str:
    """Cluster names only: there is no `forward`, so nothing is ever asked upstream."""
    return f"""{CLUSTER_DOMAIN}:53 in-addr.arpa:53 {{
    bind {DNS_IP}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
    }}
    cache 5
}}
"""


def kube_router_argv(binary: str, kubeconfig: Path) -> list[str]:
    """NetworkPolicy only: no routing, no service proxy (kube-proxy does that)."""
    return [
        binary,
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        f"--hostname-override={NODE_NAME}",
        f"--kubeconfig={kubeconfig}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--health-port=0",
        "--metrics-port=0",
        "--v=1",
    ]


# ---------------------------------------------------------------------------------------------
# Host network: addresses, bridge, guard


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return sh("iptables", "-w", "5", *args, check=check)


def guard_rules() -> list[tuple[str, str, list[str]]]:
    """(table, chain, rule) of the guard: a pod's packet may go to pods, the node address and
    ClusterIPs (which kube-proxy turns into node-local addresses); anything else is dropped before
    routing, so it never leaves. FORWARD and OUTPUT drop the same in case forwarding is turned on."""
    allowed = [POD_CIDR, f"{NODE_IP}/32", SERVICE_CIDR]
    pre = [["-s", POD_CIDR, "-d", a, "-j", "RETURN"] for a in allowed]
    pre.append(["-s", POD_CIDR, "-j", "DROP"])
    pre.append(["-i", BRIDGE, "!", "-s", POD_CIDR, "-j", "DROP"])
    fwd = [["-i", BRIDGE, "-o", BRIDGE, "-j", "RETURN"], ["-i", BRIDGE, "-j", "DROP"], ["-o", BRIDGE, "-j", "DROP"]]
    out = [
        ["-s", CLUSTER_NET, "-d", CLUSTER_NET, "-j", "RETURN"],
        ["-s", CLUSTER_NET, "-d", "127.0.0.0/8", "-j", "RETURN"],
        ["-s", CLUSTER_NET, "-j", "DROP"],
    ]
    return (
        [("raw", GUARD, r) for r in pre]
        + [("filter", GUARD_FWD, r) for r in fwd]
        + [("filter", GUARD_OUT, r) for r in out]
    )


def install_guard() -> None:
    hooks = {("raw", GUARD): "PREROUTING", ("filter", GUARD_FWD): "FORWARD", ("filter", GUARD_OUT): "OUTPUT"}
    for table, chain in hooks:
        _iptables("-t", table, "-N", chain)
    for table, chain, rule in guard_rules():
        _iptables("-t", table, "-A", chain, *rule)
    for (table, chain), hook in hooks.items():
        _iptables("-t", table, "-I", hook, "1", "-j", chain)


def guard_drops() -> int:
    """Packets the guard has dropped (its DROP rules' counters), for tests."""
    total = 0
    for table, chain in (("raw", GUARD), ("filter", GUARD_FWD), ("filter", GUARD_OUT)):
        out = _iptables("-t", table, "-L", chain, "-v", "-x", "-n", check=False).stdout
        for line in out.splitlines()[2:]:
            fields = line.split()
            if len(fields) > 2 and fields[2] == "DROP":
                total += int(fields[0])
    return total


def setup_network() -> None:
    sh("ip", "addr", "replace", f"{NODE_IP}/32", "dev", "lo")
    if sh("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "replace", f"{BRIDGE_IP}/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    write_sysctl("net/bridge/bridge-nf-call-iptables", "1")  # policies see pod-to-pod traffic on the bridge
    # Nothing of the cluster's is routed: pods reach each other on the bridge, and the node's
    # addresses (ClusterIPs DNAT-ed to them) are local. Restored at teardown.
    write_sysctl("net/ipv4/ip_forward", "0")
    install_guard()


def without_node_chains(dump: str) -> str | None:
    """An iptables-save dump less the node's chains and every jump to them; None when it has none."""
    kept, changed = [], False
    for line in dump.splitlines():
        declares = line.startswith(":") and OWN_CHAIN.match(line[1:])
        in_or_to = line.startswith("-A ") and (
            OWN_CHAIN.match(line.split()[1]) or re.search(r" -[jg] (TFPS-|KUBE-)", line)
        )
        if declares or in_or_to:
            changed = True
        else:
            kept.append(line)
    return "\n".join(kept) + "\n" if changed else None


def remove_rules() -> None:
    """Every chain of ours, the kubelet's, kube-proxy's and kube-router's, and the jumps to them,
    from iptables (IPv4 and IPv6), and their ipsets; other rules on the machine are kept."""
    for save, restore in (("iptables-save", "iptables-restore"), ("ip6tables-save", "ip6tables-restore")):
        rest = without_node_chains(sh(save, check=False).stdout)
        if rest is not None:
            sh(restore, "-w", "5", input=rest)
    for name in sh("ipset", "list", "-n", check=False).stdout.split():
        if name.startswith(("KUBE-", "kube-router", "TFPS-", "inet6:KUBE-")):
            sh("ipset", "destroy", name, check=False)


# ---------------------------------------------------------------------------------------------
# sysctls, recorded once per node start and restored at teardown


def read_sysctl(key: str) -> str | None:
    try:
        return Path("/proc/sys", key).read_text().strip()
    except OSError:
        return None


def write_sysctl(key: str, value: str) -> None:
    try:
        Path("/proc/sys", key).write_text(value)
    except OSError as err:
        log.warning("sysctl %s=%s: %s", key, value, err)


def record_host_state() -> None:
    record = NODE_RUN / "host-state.json"
    if record.exists():
        return  # recorded by a start whose teardown has not run: its values are the machine's own
    NODE_RUN.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"sysctls": {k: read_sysctl(k) for k in SYSCTLS}}))


def restore_host_state() -> None:
    record = NODE_RUN / "host-state.json"
    try:
        saved = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    for key, value in saved.get("sysctls", {}).items():
        if value is not None and read_sysctl(key) != value:
            write_sysctl(key, value)
    record.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Teardown of what the node leaves behind


def _pids_in_cgroups() -> set[int]:
    pids = set()
    for procs in CGROUP_ROOT.glob("*/kubepods/**/cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(p) for p in procs.read_text().split())
    return pids


def _shim_pids() -> set[int]:
    """containerd shims of this node's containerd (their command line names its socket)."""
    out = set()
    needle = str(CONTAINERD_SOCK).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmd.split(b"\0", 1)[0] and needle in cmd:
            out.add(int(d.name))
    return out


def kill_containers() -> None:
    """Every container process (they live in the kubepods cgroups) and every shim of ours."""
    for pid in _pids_in_cgroups() | _shim_pids():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (_pids_in_cgroups() or _shim_pids()) and time.monotonic() < deadline:
        time.sleep(0.1)


def unmount_under(*roots: Path) -> None:
    prefixes = tuple(str(r) + "/" for r in roots) + ("/run/netns/cni-",)
    mounts = [line.split()[1].replace("\\040", " ") for line in Path("/proc/mounts").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(prefixes) or m in map(str, roots)), key=len, reverse=True):
        sh("umount", "-l", point, check=False)
    for netns in Path("/run/netns").glob("cni-*") if Path("/run/netns").exists() else []:
        netns.unlink(missing_ok=True)


def remove_cgroups() -> None:
    for top in CGROUP_ROOT.glob("*/kubepods"):
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()
        try:
            top.rmdir()
        except OSError as err:
            log.warning("cgroup %s stays: %s", top, err)


def remove_network() -> None:
    if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        sh("ip", "link", "del", BRIDGE, check=False)
    sh("ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo", check=False)
    remove_rules()


def teardown(purge_images: bool = False) -> None:
    """Everything a node start changed on the host, in an order that works after a crash too:
    containers, mounts, cgroups, network, rules, ipsets, IP reservations, sysctls. The image store
    (NODE_ROOT/containerd) is kept unless purge_images: it is a cache, not state."""
    kill_containers()
    unmount_under(NODE_ROOT, NODE_RUN)
    remove_cgroups()
    remove_network()
    for path in (
        NODE_ROOT / "ipam",
        NODE_ROOT / "kubelet",
        NODE_ROOT / "pod-logs",
        Path("/var/lib/kubelet/device-plugins"),
        Path("/var/lib/cni"),
    ):
        sh("rm", "-rf", "--one-file-system", str(path), check=False)
    for link in Path("/var/log/containers").glob("*.log") if Path("/var/log/containers").exists() else []:
        link.unlink(missing_ok=True)
    restore_host_state()
    for path in (NODE_RUN / "containerd", NODE_RUN / "cni"):
        sh("rm", "-rf", "--one-file-system", str(path), check=False)
    if purge_images:
        sh("rm", "-rf", "--one-file-system", str(NODE_ROOT), check=False)


def prepare() -> None:
    """Clean what an earlier start left (a crash, or another checkout's cluster), then set up."""
    teardown()
    record_host_state()
    for d in (
        NODE_ROOT / "containerd",
        NODE_ROOT / "ipam",
        NODE_ROOT / "pod-logs",
        NODE_RUN / "containerd",
        NODE_RUN / "cni",
    ):
        d.mkdir(parents=True, exist_ok=True)
    (NODE_RUN / "cni" / "10-tfps.conflist").write_text(json.dumps(cni_config(), indent=1))
    setup_network()
