"""The local node's pure builders: which images it runs, pod addresses, hosts files, env."""
from __future__ import annotations

import importlib.util
import ipaddress
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "tfps_hack_localnode", Path(__file__).resolve().parents[2] / "hack" / "localnode.py")
ln = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ln
_spec.loader.exec_module(ln)


@pytest.mark.parametrize("image,repo", [
    ("tfps/worker:test", "tfps/worker"),
    ("tfps/ps", "tfps/ps"),
    ("ghcr.io/acme/tfps/operator:0.1.0", "tfps/operator"),
    ("localhost:5000/tfps/worker@sha256:" + "a" * 64, "tfps/worker"),
    ("registry:5000/tfps/ps:v1@sha256:" + "b" * 64, "tfps/ps"),
    ("busybox:1.36", None),
    ("tfps/trainer:1", None),
    ("acme/tfps-worker:1", None),
    ("tfps/worker-gpu:1", None),
])
def test_runnable_images_are_the_projects_own(image, repo):
    assert ln.runnable_repo(image) == repo


def test_pod_ips_are_stable_unique_and_in_range():
    net = ipaddress.ip_network("127.10.0.0/16")
    a = ln.ip_for("ns/a", set())
    assert ln.ip_for("ns/a", set()) == a
    assert ipaddress.ip_address(a) in net
    taken = {a}
    b = ln.ip_for("ns/a", taken)  # a collision probes onward
    assert b != a and ipaddress.ip_address(b) in net
    ips = set()
    for i in range(500):
        ip = ln.ip_for(f"ns/p{i}", ips)
        assert int(ip.rsplit(".", 1)[1]) not in (0, 255)
        ips.add(ip)
    assert len(ips) == 500


def _pod(name, hostname=None, subdomain=None, labels=None, ns="team"):
    spec = {"containers": []}
    if hostname:
        spec["hostname"] = hostname
    if subdomain:
        spec["subdomain"] = subdomain
    return {"metadata": {"name": name, "namespace": ns, "labels": labels or {}}, "spec": spec, "status": {}}


def test_hosts_file_lists_pods_a_headless_service_names():
    ps0 = _pod("j-ps-0", "j-ps-0", "j", {"job": "j"})
    w0 = _pod("j-worker-0", "j-worker-0", "j", {"job": "j"})
    other = _pod("x-0", "x-0", "x", {"job": "x"})  # no Service "x"
    services = {"j": {"spec": {"clusterIP": "None", "selector": {"job": "j"}}}}
    peers = [("127.10.0.1", ps0), ("127.10.0.2", w0), ("127.10.0.3", other)]
    text = ln.hosts_file(w0, "127.10.0.2", peers, services)
    lines = text.splitlines()
    assert "127.0.0.1\tlocalhost" in lines
    assert "127.10.0.2\tj-worker-0.j.team.svc.cluster.local j-worker-0" in lines
    assert "127.10.0.1\tj-ps-0.j.team.svc.cluster.local j-ps-0.j.team.svc j-ps-0.j.team j-ps-0.j" in lines
    assert "x-0.x.team.svc" not in text


def test_hosts_file_needs_headless_service_and_matching_selector():
    p = _pod("a", "a", "s", {"app": "one"})
    peers = [("127.10.0.9", p)]
    with_ip = {"s": {"spec": {"clusterIP": "10.96.0.7", "selector": {"app": "one"}}}}
    wrong_selector = {"s": {"spec": {"clusterIP": "None", "selector": {"app": "two"}}}}
    ok = {"s": {"spec": {"clusterIP": "None", "selector": {"app": "one"}}}}
    me = _pod("me")
    assert "a.s.team.svc" not in ln.hosts_file(me, "127.10.0.1", peers, with_ip)
    assert "a.s.team.svc" not in ln.hosts_file(me, "127.10.0.1", peers, wrong_selector)
    assert "a.s.team.svc" in ln.hosts_file(me, "127.10.0.1", peers, ok)


def test_write_in_place_keeps_the_inode(tmp_path):
    f = tmp_path / "hosts"
    ln.write_in_place(f, "one\n")
    inode = f.stat().st_ino
    ln.write_in_place(f, "two longer\n")
    assert f.read_text() == "two longer\n" and f.stat().st_ino == inode
    ln.write_in_place(f, "3\n")
    assert f.read_text() == "3\n"


def test_expand_follows_kubernetes_rules():
    env = {"A": "x", "B": "y"}
    assert ln.expand("$(A)-$(B)", env) == "x-y"
    assert ln.expand("$(MISSING)", env) == "$(MISSING)"
    assert ln.expand("$$(A)", env) == "$(A)"


def test_container_env_downward_api_and_refs():
    pod = {"metadata": {"name": "p", "namespace": "n", "uid": "u1", "labels": {"role": "ps"}},
           "spec": {"nodeName": "tfps-local", "serviceAccountName": "default"}, "status": {}}
    container = {"name": "tensorflow", "image": "tfps/ps:1", "resources": {"limits": {"nvidia.com/gpu": "2"}},
                 "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
                 "env": [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                         {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
                         {"name": "GPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.nvidia.com/gpu"}}},
                         {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
                         {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope",
                                                                        "optional": True}}},
                         {"name": "ADDR", "value": "$(IP):2222"}]}
    lookups = ln.Lookups(secret=lambda name, optional: {"pw": b"hunter2"},
                         configmap=lambda name, optional: {"K": "v"})
    env = ln.container_env(pod, container, "127.10.1.2", {"PATH": "/bin"}, lookups, {})
    assert env["IP"] == "127.10.1.2" and env["ADDR"] == "127.10.1.2:2222"
    assert env["ROLE"] == "ps" and env["GPUS"] == "2" and env["PW"] == "hunter2"
    assert env["CM_K"] == "v" and "OPT" not in env and env["PATH"] == "/bin"

    missing = dict(container, env=[{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope"}}}])
    with pytest.raises(ln.ConfigError, match="nope"):
        ln.container_env(pod, missing, "127.10.1.2", {}, lookups, {})


def test_container_argv_uses_the_tfps_entrypoint():
    assert ln.container_argv({"image": "tfps/ps:1", "args": ["ps", "--x"]}, {}) == ["tfps", "ps", "--x"]
    assert ln.container_argv({"image": "tfps/worker:1"}, {}) == ["tfps", "worker"]
    assert ln.container_argv({"image": "tfps/worker:1", "command": ["python", "-c", "pass"]}, {}) == [
        "python", "-c", "pass"]
    assert ln.container_argv({"image": "tfps/ps:1", "command": ["echo"], "args": ["$(A)"]}, {"A": "1"}) == [
        "echo", "1"]
