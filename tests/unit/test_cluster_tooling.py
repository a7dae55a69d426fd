"""hack/cluster.py without a running cluster: the PKI it makes, where it looks for binaries,
and how test sessions share one cluster."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import hack_module

hc = hack_module("cluster")


def openssl_text(cert: Path) -> str:
    return subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-text"], capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> hc.Paths:
    p = hc.Paths(tmp_path_factory.mktemp("state"))
    hc.ensure_pki(p)
    return p


def test_pki_certificates_chain_to_the_ca(pki):
    d = pki.pki
    for leaf in ("apiserver", "admin", "kubelet", "node", "kube-proxy"):
        out = subprocess.run(
            ["openssl", "verify", "-CAfile", str(d / "ca.crt"), str(d / f"{leaf}.crt")], capture_output=True, text=True
        )
        assert out.returncode == 0, out.stdout + out.stderr
    serving = openssl_text(d / "apiserver.crt")
    assert f"IP Address:{hc.node.NODE_IP}" in serving and "DNS:kubernetes.default.svc" in serving
    assert f"IP Address:{hc.node.KUBERNETES_SERVICE_IP}" in serving  # pods reach it by the Service
    assert "TLS Web Server Authentication" in serving
    admin = openssl_text(d / "admin.crt")
    assert "O = system:masters" in admin and "TLS Web Client Authentication" in admin
    kubelet = openssl_text(d / "kubelet.crt")  # the apiserver checks it on logs, exec, port-forward
    assert f"IP Address:{hc.node.NODE_IP}" in kubelet and "TLS Web Server Authentication" in kubelet
    node_identity = openssl_text(d / "node.crt")  # what the Node authorizer recognises
    assert f"CN = system:node:{hc.NODE_NAME}" in node_identity and "O = system:nodes" in node_identity
    assert (d / "sa.key").stat().st_mode & 0o077 == 0
    assert "PUBLIC KEY" in (d / "sa.pub").read_text()


def test_pki_is_made_once(pki):
    before = (pki.pki / "ca.crt").read_bytes()
    hc.ensure_pki(pki)
    assert (pki.pki / "ca.crt").read_bytes() == before


def test_kubeconfig_names_the_server_and_the_user(pki, tmp_path):
    hc.write_kubeconfig(pki, "https://198.19.0.1:6443")
    text = pki.kubeconfig.read_text()
    assert "server: https://198.19.0.1:6443" in text
    assert str(pki.pki / "admin.crt") in text
    hc.write_kubeconfig(pki, "https://198.19.0.1:6443", user="node", path=tmp_path / "node.kubeconfig")
    assert str(pki.pki / "node.crt") in (tmp_path / "node.kubeconfig").read_text()


def test_binaries_come_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TFPS_CACHE", str(tmp_path))
    versions = hc.read_versions()
    assert hc.binary("etcd") == tmp_path / "bin" / f"etcd-{versions['ETCD_VERSION']}" / "etcd"
    assert hc.binary("kubectl") == tmp_path / "bin" / f"kubernetes-{versions['KUBERNETES_VERSION']}" / "kubectl"
    assert "kube-apiserver" in hc.missing_binaries()
    link = tmp_path / "bin" / "current" / "kubectl"
    link.parent.mkdir(parents=True)
    link.write_text("")
    assert hc.binary("kubectl") == link


def test_apiserver_serves_on_the_node_address_and_etcd_stays_on_loopback(pki):
    info = {"etcd_port": 1, "etcd_peer_port": 2, "apiserver_port": 3}
    argv = hc.apiserver_argv(pki, info)
    assert f"--bind-address={hc.node.NODE_IP}" in argv and f"--advertise-address={hc.node.NODE_IP}" in argv
    assert f"--service-cluster-ip-range={hc.node.SERVICE_CIDR}" in argv
    assert "--authorization-mode=Node,RBAC" in argv
    assert "--kubelet-preferred-address-types=InternalIP" in argv
    assert "--etcd-servers=http://127.0.0.1:1" in argv
    assert all("127.0.0.1" in a for a in hc.etcd_argv(pki, info) if "urls" in a or "initial-cluster=" in a)


def test_sessions_dead_ones_are_forgotten(tmp_path):
    p = hc.Paths(tmp_path)
    hc.register_session(p, os.getpid())
    (p.sessions / "999999999").write_text(json.dumps([999999999, 1]))
    assert hc.live_sessions(p) == [os.getpid()]
    assert not (p.sessions / "999999999").exists()


def test_release_leaves_a_cluster_started_by_hand(tmp_path):
    p = hc.Paths(tmp_path)
    p.info.write_text(json.dumps({"owner": "manual"}))
    hc.register_session(p, os.getpid())
    assert hc.release(p, os.getpid()) is False
    assert hc.live_sessions(p) == []


def test_restart_needs_a_recorded_cluster(tmp_path):
    with pytest.raises(SystemExit, match="no cluster recorded"):
        hc.restart(hc.Paths(tmp_path), ["etcd", "kube-apiserver"])


def test_restart_is_a_command_that_takes_components(tmp_path):
    out = subprocess.run(
        [sys.executable, str(Path(hc.__file__)), "--state-dir", str(tmp_path), "restart", "etcd"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "no cluster recorded" in out.stderr
    out = subprocess.run(
        [sys.executable, str(Path(hc.__file__)), "restart", "nonsense"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "invalid choice" in out.stderr


def _component_pid(p: hc.Paths, comp: str, not_pid: int | None = None, timeout: float = 10.0) -> int:
    """The component's own process: the one child of its supervisor (other than `not_pid`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = [c for c in hc.children(hc.recorded_pid(p, comp) or 0) if c != not_pid]
        if kids:
            return kids[0]
        time.sleep(0.05)
    raise AssertionError(f"{comp} has no running process; log:\n{hc.tail(p.logfile(comp))}")


def test_a_component_that_dies_is_started_again_and_a_stopped_one_is_not(tmp_path):
    """A real process stands in for a component (`sleep`): killed, its supervisor starts it again,
    as systemd does for the kubelet; `stop` ends both."""
    p = hc.Paths(tmp_path)
    hc.spawn(p, "kubelet", ["sleep", "300"])
    first = _component_pid(p, "kubelet")
    os.kill(first, signal.SIGKILL)
    second = _component_pid(p, "kubelet", not_pid=first)
    assert hc.recorded_pid(p, "kubelet") is not None
    assert "kubelet: killed by SIGKILL; starting it again" in p.logfile("kubelet").read_text()
    supervisor = hc.recorded_pid(p, "kubelet")
    hc.stop(p, "kubelet", timeout=5)
    assert hc.recorded_pid(p, "kubelet") is None and not p.pidfile("kubelet").exists()
    assert hc.proc_start_ticks(second) is None and hc.proc_start_ticks(supervisor) is None


def test_a_component_that_keeps_failing_is_given_up_on(tmp_path):
    """Each new start waits twice as long as the one before; after 5 restarts within two minutes
    the supervisor ends (run here with a first delay of 50 ms instead of a second)."""
    out = subprocess.run(
        [sys.executable, str(hc.SUPERVISE), "kube-proxy", "--first-delay", "0.05", "--", "false"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    delays = re.findall(r"kube-proxy: exit code 1; starting it again in (\S+)s", out.stdout)
    assert delays == ["0.05", "0.1", "0.2", "0.4", "0.8"], out.stdout
    assert "6 starts within 120s: giving up" in out.stdout


def test_kwok_addresses_stay_inside_the_clusters_own_block_and_off_the_real_node():
    import ipaddress

    kwok = hack_module("kwok")
    node = hack_module("node")
    own, hole = ipaddress.ip_network("198.18.0.0/15"), ipaddress.ip_network(kwok.BLACKHOLE)
    pods = ipaddress.ip_network(kwok.POD_CIDR)
    assert hole.subnet_of(own) and pods.subnet_of(hole) and ipaddress.ip_address(kwok.NODE_IP) in hole
    assert not hole.overlaps(ipaddress.ip_network(node.POD_CIDR))  # the real node's bridge
    argv = kwok.argv(Path("/k/kubeconfig"), Path("/k/stages.yaml"))
    assert f"--cidr={kwok.POD_CIDR}" in argv and f"--node-ip={kwok.NODE_IP}" in argv


def test_kwok_nodes_take_only_pods_placed_there():
    kwok = hack_module("kwok")
    node = kwok.node_manifest("kwok-gpu-0", cpu="8", memory="32Gi", gpus=4)
    assert node["status"]["capacity"] == {"cpu": "8", "memory": "32Gi", "pods": "250", "nvidia.com/gpu": "4"}
    assert node["spec"]["taints"] == [kwok.TAINT]  # the real node's pods never land here
    placed = kwok.placement()
    assert all(node["metadata"]["labels"][k] == v for k, v in placed["nodeSelector"].items())
    assert placed["tolerations"][0]["key"] == kwok.TAINT["key"]
    assert "nvidia.com/gpu" not in kwok.node_manifest("cpu-only")["status"]["capacity"]


# ---------------------------------------------------------------------------------------------
# `make demo`'s set-up (hack/build-demo.sh --plan): what it builds, in which lane, and the estimates

HACK = Path(hc.__file__).resolve().parent


def _fake_tool(folder: Path, name: str, rc: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / name
    tool.write_text(f"#!/bin/sh\nexit {rc}\n")
    tool.chmod(0o755)


def _demo_plan(tmp_path: Path, fake_bin: Path | None = None, kubeconfig: bool = False) -> dict[str, list]:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["TFPS_CACHE"] = str(tmp_path / "cache")
    if fake_bin is not None:  # only the fakes and the system's tools; no kubectl or helm of the machine
        env["PATH"] = f"{fake_bin}:/usr/bin:/bin"
    if kubeconfig:
        (tmp_path / "kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
        env["KUBECONFIG"] = str(tmp_path / "kubeconfig")
    out = subprocess.run(
        [str(HACK / "build-demo.sh"), "--plan"], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    plan: dict[str, list] = {"go": [], "net": []}
    for line in out.stdout.splitlines():
        lane, _, rest = line.partition(": ")
        if lane == "cluster":
            plan["cluster"] = [rest]
        else:
            name, seconds = rest.split()
            plan[lane].append((name, int(seconds)))
    return plan


def test_the_demo_builds_the_local_cluster_beside_the_venv_and_images_and_nothing_for_the_tests(tmp_path):
    plan = _demo_plan(tmp_path)
    assert plan["cluster"] == ["local"]
    go = [name for name, _ in plan["go"]]
    assert go == ["pause", "kubernetes", "etcd", "helm", "coredns", "kube-router"]
    assert [name for name, _ in plan["net"]] == ["venv", "images"]
    assert all(seconds > 0 for _, seconds in plan["go"] + plan["net"])  # a cold cache: the defaults


def test_the_demos_estimates_come_from_earlier_builds(tmp_path):
    versions = hc.read_versions()
    cache = tmp_path / "cache"
    etcd = cache / "bin" / f"etcd-{versions['ETCD_VERSION']}" / "etcd"
    _fake_tool(etcd.parent, "etcd")
    k8s = f"kubernetes-{versions['KUBERNETES_VERSION']}"
    (cache / "build-times.tsv").write_text(f"{k8s}\t1200\tthen\n{k8s}\t777\tlater\nimages\t42\tlater\n")
    plan = dict(_demo_plan(tmp_path)["go"] + _demo_plan(tmp_path)["net"])
    assert plan["kubernetes"] == 777  # the last one recorded
    assert plan["etcd"] == 0  # built already
    assert plan["images"] == 42


def test_the_demo_builds_no_cluster_binaries_for_a_cluster_that_answers(tmp_path):
    fake = tmp_path / "fake-bin"
    _fake_tool(fake, "kubectl")  # `kubectl version` answers
    plan = _demo_plan(tmp_path, fake, kubeconfig=True)
    assert plan["cluster"] == ["KUBECONFIG's"]
    helm_on_path = shutil.which("helm", path=f"{fake}:/usr/bin:/bin")
    assert [name for name, _ in plan["go"]] == ([] if helm_on_path else ["helm"])  # only what PATH lacks
    _fake_tool(fake, "helm")
    assert _demo_plan(tmp_path, fake, kubeconfig=True)["go"] == []
    assert [name for name, _ in _demo_plan(tmp_path, fake, kubeconfig=True)["net"]] == ["venv", "images"]


def test_the_demo_builds_the_local_cluster_when_kubeconfigs_cluster_does_not_answer(tmp_path):
    fake = tmp_path / "fake-bin"
    _fake_tool(fake, "kubectl", rc=1)
    _fake_tool(fake, "helm")
    plan = _demo_plan(tmp_path, fake, kubeconfig=True)
    assert plan["cluster"] == ["local"] and "kubernetes" in [name for name, _ in plan["go"]]


def test_the_build_scripts_take_only_the_tools_they_know(tmp_path):
    env = {**os.environ, "TFPS_CACHE": str(tmp_path)}
    for script, bad in (("build-cluster.sh", "kueue"), ("build-node.sh", "kubelet"), ("build-demo.sh", "--all")):
        out = subprocess.run([str(HACK / script), bad], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "unknown" in out.stderr, (script, out.stderr)


def test_make_demo_leaves_the_tests_tools_to_make_test_and_ci():
    makefile = (HACK.parent / "Makefile").read_text()
    demo = re.search(r"^demo:(.*)\n((?:\t.*\n)+)", makefile, re.M)
    assert demo and "cluster-tools" not in demo.group(1) and "hack/build-demo.sh" in demo.group(2)
    tools = re.search(r"^cluster-tools:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    test = re.search(r"^test:(.*)", makefile, re.M).group(1)
    assert "cluster-tools" in test
    ci = (HACK.parent / ".ci" / "run").read_text()
    for script in ("build-cluster.sh", "build-node.sh", "build-gang-crds.sh", "build-kueue.sh"):
        assert f"hack/{script}" in tools and f"hack/{script}" in ci
