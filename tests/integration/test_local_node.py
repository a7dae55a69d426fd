"""The local node (hack/localnode.py) runs pods of the project's images as real local processes
and reports them the way a kubelet does: what `kubectl get pods` shows is what happened."""
from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from kubernetes import client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

IMAGE = "tfps/worker:test"


def pod(name: str, code: str, restart: str = "Never", **spec) -> dict:
    container = {"name": "tensorflow", "image": IMAGE, "command": ["python", "-c", code]}
    container.update(spec.pop("container", {}))
    return {"metadata": {"name": name, "labels": spec.pop("labels", {})},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 5, "containers": [container],
                     **spec}}


def phase_is(*phases):
    return lambda p: p is not None and p.status.phase in phases


def running(p) -> bool:
    return p is not None and p.status.phase == "Running" and bool(p.status.container_statuses) and \
        p.status.container_statuses[0].state.running is not None


def core(cluster) -> client.CoreV1Api:
    return client.CoreV1Api(cluster.api)


def test_node_registered_with_capacity(cluster):
    node = core(cluster).read_node(cluster.node_name)
    assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"
    assert node.status.capacity["nvidia.com/gpu"] == "4"
    assert node.status.allocatable["cpu"] == "16" and node.status.allocatable["memory"] == "64Gi"
    assert node.spec.taints is None
    lease = client.CoordinationV1Api(cluster.api).read_namespaced_lease(cluster.node_name, "kube-node-lease")
    assert lease.spec.holder_identity == cluster.node_name


def test_pod_succeeds_with_exit_code_0(cluster, namespace):
    core(cluster).create_namespaced_pod(namespace, pod("ok", "print('hello from', __import__('os').getpid())"))
    p = cluster.wait_pod(namespace, "ok", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Succeeded"
    term = p.status.container_statuses[0].state.terminated
    assert term.exit_code == 0 and term.reason == "Completed"
    assert p.status.host_ip == "127.0.0.1"
    assert ipaddress.ip_address(p.status.pod_ip) in ipaddress.ip_network("127.10.0.0/16")
    assert p.status.start_time is not None
    assert "hello from" in cluster.pod_log(namespace, "ok")
    shown = cluster.kubectl("get", "pod", "ok", "-n", namespace, "--no-headers").stdout
    assert "Completed" in shown


def test_pod_exit_3_fails_with_exit_code_3(cluster, namespace):
    core(cluster).create_namespaced_pod(namespace, pod("three", "import sys; print('bye'); sys.exit(3)"))
    p = cluster.wait_pod(namespace, "three", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Failed"
    cs = p.status.container_statuses[0]
    assert cs.state.terminated.exit_code == 3 and cs.state.terminated.reason == "Error"
    assert cs.restart_count == 0


def test_termination_message_reaches_the_status(cluster, namespace):
    """What a container writes to /dev/termination-log (or its custom terminationMessagePath) is
    its terminated state's message, as with a kubelet; FallbackToLogsOnError uses the log tail."""
    api = core(cluster)
    api.create_namespaced_pod(namespace, pod("msg", "open('/dev/termination-log', 'w').write('{\"accuracy\": 0.97}')"))
    api.create_namespaced_pod(namespace, pod("custom", "open('/tmp/tfps-done', 'w').write('custom path')",
                                             container={"terminationMessagePath": "/tmp/tfps-done"}))
    api.create_namespaced_pod(namespace, pod("fallback", "import sys; print('the last words'); sys.exit(2)",
                                             container={"terminationMessagePolicy": "FallbackToLogsOnError"}))
    done = phase_is("Succeeded", "Failed")
    msg = cluster.wait_pod(namespace, "msg", done, what="a final phase").status.container_statuses[0]
    assert msg.state.terminated.message == '{"accuracy": 0.97}'
    custom = cluster.wait_pod(namespace, "custom", done, what="a final phase").status.container_statuses[0]
    assert custom.state.terminated.message == "custom path"
    fallback = cluster.wait_pod(namespace, "fallback", done, what="a final phase").status.container_statuses[0]
    assert fallback.state.terminated.exit_code == 2 and "the last words" in fallback.state.terminated.message


def test_default_entrypoint_is_tfps(cluster, namespace):
    """The images' ENTRYPOINT is `tfps`: a container with only args runs `tfps ARGS`."""
    body = pod("entry", "")
    del body["spec"]["containers"][0]["command"]
    body["spec"]["containers"][0]["args"] = ["--help"]
    core(cluster).create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "entry", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Succeeded", cluster.pod_log(namespace, "entry")
    assert "usage: tfps" in cluster.pod_log(namespace, "entry")


def test_unknown_image_fails_with_err_image_pull(cluster, namespace):
    body = pod("alien", "")
    body["spec"]["containers"][0]["image"] = "docker.io/library/busybox:1.36"
    core(cluster).create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "alien", phase_is("Running", "Succeeded", "Failed"), what="a phase")
    assert p.status.phase == "Failed"
    assert p.status.reason == "ErrImagePull"
    waiting = p.status.container_statuses[0].state.waiting
    assert waiting.reason == "ErrImagePull" and "busybox:1.36" in waiting.message
    assert p.status.pod_ip is None
    assert "ErrImagePull" in cluster.kubectl("get", "pod", "alien", "-n", namespace, "--no-headers").stdout


SERVER = """
import os, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((os.environ['POD_IP'], 2222)); s.listen()
print('listening on', os.environ['POD_IP'], flush=True)
conn, peer = s.accept()
print('got', conn.recv(100).decode(), 'from', peer[0], flush=True)
conn.sendall(b'pong'); conn.close()
"""

CLIENT = """
import os, socket, time
name = 'server.job.' + os.environ['NS'] + '.svc'
deadline = time.time() + 120
while True:
    try:
        ip = socket.gethostbyname(name)
        c = socket.create_connection((name, 2222), timeout=5)
        break
    except OSError as e:
        if time.time() > deadline: raise
        time.sleep(0.3)
c.sendall(b'ping from ' + os.environ['POD_IP'].encode())
print('resolved', name, ip, 'reply', c.recv(100).decode(), flush=True)
print('fqdn', socket.gethostbyname(name + '.cluster.local'), flush=True)
"""


def test_pods_reach_each_other_by_dns_name(cluster, namespace):
    """Like a TrainingJob's pods: a headless Service, hostname + subdomain, and the peer's DNS name.
    The client starts first, so it sees the server appear in its (rewritten) hosts file."""
    api = core(cluster)
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    api.create_namespaced_service(namespace, {"metadata": {"name": "job"}, "spec": {
        "clusterIP": "None", "selector": {"job": "demo"}, "ports": [{"name": "grpc", "port": 2222}]}})
    api.create_namespaced_pod(namespace, pod("client", CLIENT, hostname="client", subdomain="job",
                                             labels={"job": "demo"}, container={"env": env}))
    cluster.wait_pod(namespace, "client", running, what="Running")
    api.create_namespaced_pod(namespace, pod("server", SERVER, hostname="server", subdomain="job",
                                             labels={"job": "demo"}, container={"env": env}))
    server = cluster.wait_pod(namespace, "server", phase_is("Succeeded", "Failed"), what="a final phase")
    client_pod = cluster.wait_pod(namespace, "client", phase_is("Succeeded", "Failed"), what="a final phase")
    assert server.status.phase == "Succeeded", cluster.pod_log(namespace, "server")
    assert client_pod.status.phase == "Succeeded", cluster.pod_log(namespace, "client")
    server_ip, client_ip = server.status.pod_ip, client_pod.status.pod_ip
    assert server_ip != client_ip
    assert f"resolved server.job.{namespace}.svc {server_ip} reply pong" in cluster.pod_log(namespace, "client")
    assert f"fqdn {server_ip}" in cluster.pod_log(namespace, "client")
    # Pods share the host's network namespace: a connection's source address is 127.0.0.1.
    assert f"got ping from {client_ip}" in cluster.pod_log(namespace, "server")


def test_names_need_a_headless_service(cluster, namespace):
    """Without a Service named like the subdomain, cluster DNS has no record: neither does the node."""
    code = ("import socket, os\ntry:\n    print(socket.gethostbyname('lonely.nosvc.' + os.environ['NS'] + '.svc'))\n"
            "except OSError as e:\n    print('unresolved', e)\n")
    env = [{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    core(cluster).create_namespaced_pod(namespace, pod("lonely", code, hostname="lonely", subdomain="nosvc",
                                                       container={"env": env}))
    p = cluster.wait_pod(namespace, "lonely", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Succeeded"
    assert "unresolved" in cluster.pod_log(namespace, "lonely")


def pid_in_log(cluster, namespace: str, name: str) -> int:
    deadline = time.monotonic() + 60
    while not (m := re.search(r"pid (\d+)", cluster.pod_log(namespace, name))):
        assert time.monotonic() < deadline, cluster.pod_log(namespace, name)
        time.sleep(0.2)
    return int(m.group(1))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def wait_gone(cluster, namespace: str, name: str, timeout: float = 60) -> float:
    t0 = time.monotonic()
    cluster.wait_pod(namespace, name, lambda p: p is None, timeout=timeout, what="deletion")
    return time.monotonic() - t0


def test_delete_sends_sigterm_and_removes_pod(cluster, namespace):
    code = ("import os, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (print('SIGTERM received', flush=True), sys.exit(0)))\n"
            "print('pid', os.getpid(), flush=True)\ntime.sleep(600)\n")
    core(cluster).create_namespaced_pod(namespace, pod("sleeper", code))
    cluster.wait_pod(namespace, "sleeper", running, what="Running")
    pid = pid_in_log(cluster, namespace, "sleeper")
    assert pid_alive(pid)
    core(cluster).delete_namespaced_pod("sleeper", namespace)
    wait_gone(cluster, namespace, "sleeper")
    assert not pid_alive(pid)
    assert "SIGTERM received" in cluster.pod_log(namespace, "sleeper")


def test_delete_kills_after_grace_period(cluster, namespace):
    code = ("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('pid', os.getpid(), flush=True)\ntime.sleep(600)\n")
    core(cluster).create_namespaced_pod(namespace, pod("stubborn", code))
    cluster.wait_pod(namespace, "stubborn", running, what="Running")
    pid = pid_in_log(cluster, namespace, "stubborn")
    core(cluster).delete_namespaced_pod("stubborn", namespace, grace_period_seconds=1)
    wait_gone(cluster, namespace, "stubborn")
    assert not pid_alive(pid)


def test_on_failure_restarts_in_place(cluster, namespace):
    """restartPolicy OnFailure: the first run fails, the restart (same emptyDir) succeeds."""
    code = ("import os, sys\nmark = '/scratch/ran-before'\n"
            "if os.path.exists(mark):\n    print('second run'); sys.exit(0)\n"
            "open(mark, 'w').close(); print('first run'); sys.exit(4)\n")
    body = pod("flaky", code, restart="OnFailure", volumes=[{"name": "scratch", "emptyDir": {}}],
               container={"volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]})
    core(cluster).create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "flaky", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Succeeded", cluster.pod_log(namespace, "flaky")
    cs = p.status.container_statuses[0]
    assert cs.restart_count == 1
    assert cs.last_state.terminated.exit_code == 4
    log = cluster.pod_log(namespace, "flaky")
    assert log.index("first run") < log.index("second run")
    assert not os.path.exists("/scratch/ran-before")  # the mount stayed inside the pod


INSPECT = """
import json, os
from kubernetes import client, config
sa = '/var/run/secrets/kubernetes.io/serviceaccount'
config.load_incluster_config()
out = {
  'version': client.VersionApi().get_code().git_version,
  'sa_namespace': open(sa + '/namespace').read(),
  'secret_file': open('/etc/creds/password').read(),
  'env': {k: os.environ.get(k) for k in ('POD_NAME', 'POD_NS', 'NODE', 'PASSWORD', 'MODE', 'GREETING',
                                          'KUBERNETES_SERVICE_HOST')},
}
print('RESULT', json.dumps(out), flush=True)
"""


def test_pod_env_volumes_and_service_account(cluster, namespace):
    api = core(cluster)
    api.create_namespaced_secret(namespace, {"metadata": {"name": "creds"},
                                             "data": {"password": base64.b64encode(b"s3cret").decode()}})
    api.create_namespaced_config_map(namespace, {"metadata": {"name": "settings"}, "data": {"MODE": "sync"}})
    env = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
           {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
           {"name": "GREETING", "value": "hi $(POD_NAME)"}]
    body = pod("inspect", INSPECT, volumes=[{"name": "creds", "secret": {"secretName": "creds"}}],
               container={"env": env, "envFrom": [{"configMapRef": {"name": "settings"}}],
                          "volumeMounts": [{"name": "creds", "mountPath": "/etc/creds", "readOnly": True}]})
    api.create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "inspect", phase_is("Succeeded", "Failed"), what="a final phase")
    log = cluster.pod_log(namespace, "inspect")
    assert p.status.phase == "Succeeded", log
    out = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
    assert out["version"].startswith("v1.")
    assert out["sa_namespace"] == namespace
    assert out["secret_file"] == "s3cret"
    assert out["env"] == {"POD_NAME": "inspect", "POD_NS": namespace, "NODE": cluster.node_name,
                          "PASSWORD": "s3cret", "MODE": "sync", "GREETING": "hi inspect",
                          "KUBERNETES_SERVICE_HOST": "127.0.0.1"}


def test_node_restart_adopts_running_pods(cluster, namespace):
    """A restarted local node neither loses nor duplicates a pod's process, still learns its exit
    code, and restarts it later with its volumes (restartPolicy OnFailure)."""
    import subprocess

    code = ("import os, sys, time\nprint('pid', os.getpid(), flush=True)\n"
            "if os.path.exists('/scratch/go'): sys.exit(0)\n"
            "while not os.path.exists('/scratch/go'): time.sleep(0.2)\nsys.exit(5)\n")
    body = pod("survivor", code, restart="OnFailure", volumes=[{"name": "scratch", "emptyDir": {}}],
               container={"volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]})
    uid = core(cluster).create_namespaced_pod(namespace, body).metadata.uid
    cluster.wait_pod(namespace, "survivor", running, what="Running")
    pid = pid_in_log(cluster, namespace, "survivor")

    cluster_sh = str(Path(__file__).resolve().parents[2] / "hack" / "cluster.sh")
    env = {**cluster.env, "TFPS_STATE": str(cluster.state_dir)}
    subprocess.run([cluster_sh, "stop", "localnode"], env=env, check=True, timeout=60)
    assert pid_alive(pid)
    subprocess.run([cluster_sh, "up", f"--session={os.getpid()}"], env=env, check=True, timeout=300,
                   capture_output=True)
    time.sleep(2)  # give a duplicate, if there were one, the time to start
    assert pid_alive(pid)
    assert cluster.pod_log(namespace, "survivor").count("pid ") == 1
    p = core(cluster).read_namespaced_pod("survivor", namespace)
    assert p.status.phase == "Running" and p.status.container_statuses[0].restart_count == 0

    (cluster.state_dir / "run" / uid / "volumes" / "scratch" / "go").touch()
    p = cluster.wait_pod(namespace, "survivor", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Succeeded", cluster.pod_log(namespace, "survivor")
    cs = p.status.container_statuses[0]
    assert cs.restart_count == 1 and cs.last_state.terminated.exit_code == 5


def test_kubectl_logs_reads_the_pods_output(cluster, namespace):
    """`kubectl logs` goes apiserver -> the local node's endpoint on 127.0.0.1 -> the log file."""
    core(cluster).create_namespaced_pod(namespace, pod("talker", "for i in range(3): print('line', i)"))
    cluster.wait_pod(namespace, "talker", phase_is("Succeeded", "Failed"), what="a final phase")
    out = cluster.kubectl("logs", "-n", namespace, "talker").stdout
    assert out.splitlines() == ["line 0", "line 1", "line 2"]
    assert cluster.kubectl("logs", "-n", namespace, "talker", "--tail=1").stdout == "line 2\n"


GATED_SERVER = """
import http.server, os, time
while not os.path.exists('/gate/open'):
    time.sleep(0.1)
print('serving', flush=True)
http.server.HTTPServer((os.environ['POD_IP'], 8080), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_readiness_probe_gates_ready(cluster, namespace):
    """Running but not Ready until the readiness probe (HTTP, named port) succeeds."""
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    body = pod("web", GATED_SERVER, restart="Always", volumes=[{"name": "gate", "emptyDir": {}}], container={
        "env": env, "ports": [{"name": "http", "containerPort": 8080}],
        "volumeMounts": [{"name": "gate", "mountPath": "/gate"}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1}})
    uid = core(cluster).create_namespaced_pod(namespace, body).metadata.uid
    cluster.wait_pod(namespace, "web", running, what="Running")
    time.sleep(2)  # a few probes fail meanwhile
    p = core(cluster).read_namespaced_pod("web", namespace)
    assert p.status.container_statuses[0].ready is False
    assert {c.type: c.status for c in p.status.conditions}["Ready"] == "False"
    (cluster.state_dir / "run" / uid / "volumes" / "gate" / "open").touch()
    ready = cluster.wait_pod(namespace, "web", lambda p: p.status.container_statuses[0].ready, what="ready")
    assert {c.type: c.status for c in ready.status.conditions}["Ready"] == "True"
    assert "serving" in cluster.pod_log(namespace, "web")


UNHEALTHY_LATER = """
import os, sys, time
if os.path.exists('/state/ran'):
    print('second run', flush=True); sys.exit(0)
open('/state/ran', 'w').close(); open('/state/healthy', 'w').close()
print('first run', flush=True); time.sleep(2); os.remove('/state/healthy'); time.sleep(600)
"""


def test_liveness_probe_failure_restarts_container(cluster, namespace):
    """Exec probes run inside the pod's mounts; the startup probe holds the liveness probe back
    until the process is up; a failing liveness probe kills the container, which restarts."""
    health = {"exec": {"command": ["test", "-f", "/state/healthy"]}, "periodSeconds": 1}
    body = pod("sick", UNHEALTHY_LATER, restart="OnFailure", volumes=[{"name": "state", "emptyDir": {}}], container={
        "volumeMounts": [{"name": "state", "mountPath": "/state"}],
        "startupProbe": {**health, "failureThreshold": 120},
        "livenessProbe": {**health, "failureThreshold": 2}})
    core(cluster).create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "sick", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Succeeded", cluster.pod_log(namespace, "sick")
    cs = p.status.container_statuses[0]
    assert cs.restart_count == 1 and cs.last_state.terminated.exit_code == 143
    assert "second run" in cluster.pod_log(namespace, "sick")


def test_two_containers_share_the_pod(cluster, namespace):
    """Every container of a pod runs, on the pod's one IP; the pod succeeds when both have."""
    body = pod("pair", "import socket, os\ns = socket.create_server((os.environ['POD_IP'], 7000))\n"
                       "c, _ = s.accept(); print('main got', c.recv(10).decode())")
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    body["spec"]["containers"][0]["env"] = env
    body["spec"]["containers"].append({
        "name": "sidecar", "image": "tfps/ps:test", "env": env, "command": ["python", "-c",
            "import socket, os, time\nfor _ in range(600):\n    try:\n"
            "        socket.create_connection((os.environ['POD_IP'], 7000)).sendall(b'hi'); break\n"
            "    except OSError: time.sleep(0.1)\n"]})
    core(cluster).create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "pair", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Succeeded", cluster.pod_log(namespace, "pair")
    assert {c.name: c.state.terminated.exit_code for c in p.status.container_statuses} == {
        "tensorflow": 0, "sidecar": 0}
    assert "main got hi" in cluster.pod_log(namespace, "pair")


def test_volume_over_the_nodes_state_folder(cluster, namespace):
    """A pod may mount a volume where the node keeps its files (an emptyDir at /tmp while the
    state folder is under /tmp): its hosts file, token and exit code must still reach it."""
    code = ("import os, socket, sys\nsa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
            "print('hosts', socket.gethostbyname('covered'), 'token', len(open(sa + '/token').read()) > 0,\n"
            "      'hidden', os.listdir(sys.argv[1]))\nsys.exit(6)\n")
    body = pod("covered", code, hostname="covered", volumes=[{"name": "cover", "emptyDir": {}}],
               container={"args": [str(cluster.state_dir)],
                          "volumeMounts": [{"name": "cover", "mountPath": str(cluster.state_dir)}]})
    core(cluster).create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "covered", phase_is("Succeeded", "Failed"), what="a final phase")
    log = cluster.pod_log(namespace, "covered")
    assert p.status.container_statuses[0].state.terminated.exit_code == 6, log
    assert f"hosts {p.status.pod_ip} token True hidden []" in log


def test_volume_over_the_checkout_keeps_the_program_visible(cluster, namespace):
    """A volume over the folder that holds the checkout and its venv (the chart's emptyDir at
    /tmp while CI clones under /tmp) must not hide `tfps`/`python` from the pod."""
    repo = Path(__file__).resolve().parents[2]
    code = "import sys, tfps.runtime; print('ran', sys.executable)"
    body = pod("covered-code", code, volumes=[{"name": "cover", "emptyDir": {}}],
               container={"volumeMounts": [{"name": "cover", "mountPath": str(repo.parent)}]})
    core(cluster).create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "covered-code", phase_is("Succeeded", "Failed"), what="a final phase")
    log = cluster.pod_log(namespace, "covered-code")
    assert p.status.phase == "Succeeded", log
    assert "ran " in log


def test_init_containers_run_first_in_order(cluster, namespace):
    def init(name, code):
        return {"name": name, "image": "tfps/worker:test", "command": ["python", "-c", code],
                "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}

    body = pod("initialized", "print(open('/shared/order').read())", volumes=[{"name": "shared", "emptyDir": {}}],
               container={"volumeMounts": [{"name": "shared", "mountPath": "/shared"}]},
               initContainers=[init("one", "open('/shared/order', 'a').write('one ')"),
                               init("two", "open('/shared/order', 'a').write('two')")])
    core(cluster).create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "initialized", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Succeeded", cluster.pod_log(namespace, "initialized")
    assert [s.state.terminated.exit_code for s in p.status.init_container_statuses] == [0, 0]
    assert "one two" in cluster.pod_log(namespace, "initialized")


def test_failed_init_container_fails_the_pod(cluster, namespace):
    body = pod("blocked", "print('main ran')",
               initContainers=[{"name": "check", "image": "tfps/worker:test",
                                "command": ["python", "-c", "raise SystemExit(9)"]}])
    core(cluster).create_namespaced_pod(namespace, body)
    p = cluster.wait_pod(namespace, "blocked", phase_is("Succeeded", "Failed"), what="a final phase")
    assert p.status.phase == "Failed"
    assert p.status.init_container_statuses[0].state.terminated.exit_code == 9
    assert p.status.container_statuses[0].state.terminated is None
    assert "main ran" not in cluster.pod_log(namespace, "blocked")
    assert "Init:Error" in cluster.kubectl("get", "pod", "blocked", "-n", namespace, "--no-headers").stdout
