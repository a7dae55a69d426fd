"""What a real node gives the pods, seen from inside them: the images run as containers with the
pod's securityContext and CPU limit enforced, the job's NetworkPolicy enforced, pod IPs in the
headless Service's Endpoints and EndpointSlices, every TF_CONFIG name resolving through cluster DNS,
`kubectl logs`, `exec` and `port-forward`, and no packet leaving the cluster's own addresses.

Nothing is mocked: kubelet, containerd, runc, CNI bridge, kube-proxy, CoreDNS and kube-router's
firewall are the real ones (hack/cluster.sh); the jobs run the project's images.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request
import uuid

import pytest
from jobrun import install_chart
from kubernetes import client
from support import wait_for

from tfps.api.spec import API_GROUP, API_VERSION, PLURAL, manifest_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SCRAPER = {"role": "scraper"}
PS_CPU_LIMIT = "1"  # one core of the node's two: TensorFlow must size its pools to 1, not 2


def _job(name: str) -> dict:
    """A job that keeps training while the tests look at it (async, many steps)."""
    small = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    ps_resources = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": PS_CPU_LIMIT, "memory": "1Gi"}}
    return manifest_for(
        name,
        {
            "replicaSpecs": {
                "PS": {
                    "replicas": 1,
                    "template": {"spec": {"containers": [{"name": "tensorflow", "resources": ps_resources}]}},
                },
                "Worker": {
                    "replicas": 1,
                    "template": {"spec": {"containers": [{"name": "tensorflow", "resources": small}]}},
                },
            },
            "training": {
                "model": "digits-mlp",
                "modelArgs": {"hidden": [16]},
                "batchSize": 16,
                "steps": 10_000_000,
                "consistency": {"mode": "async"},
            },
            "runPolicy": {"activeDeadlineSeconds": 900},
        },
    )


def _probe_pod(name: str, labels: dict) -> dict:
    """A pod outside any job, running the PS image idle, to connect from."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "probe",
                    "image": "tfps/ps:0.1.0",
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-c", "import time; time.sleep(3600)"],
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                }
            ],
        },
    }


class Node:
    """The module's jobs and pods, and the ways a test looks into them."""

    def __init__(self, cluster, namespace: str):
        self.cluster, self.ns = cluster, namespace
        self.core = client.CoreV1Api(cluster.api)

    def pod(self, name: str) -> client.V1Pod:
        return self.core.read_namespaced_pod(name, self.ns)

    def ip(self, name: str) -> str:
        return self.pod(name).status.pod_ip

    def exec(self, pod: str, code: str, check: bool = True) -> subprocess.CompletedProcess:
        """`kubectl exec` a Python snippet in the pod's first container (its own exit status)."""
        return self.cluster.exec_python(self.ns, pod, code, check=check)

    def connects(self, pod: str, ip: str, port: int) -> bool:
        code = (
            f"import socket,sys\ntry:\n socket.create_connection(({ip!r}, {port}), timeout=3).close()\n"
            f"except OSError as e:\n print(e); sys.exit(1)"
        )
        return self.exec(pod, code, check=False).returncode == 0


@pytest.fixture(scope="module")
def node(cluster):
    """A namespace with the chart installed (metrics admitted only from `role: scraper` pods), two
    running jobs (a and b) and two probe pods, one a scraper."""
    core = client.CoreV1Api(cluster.api)
    ns = cluster.create_namespace(f"node-{uuid.uuid4().hex[:6]}")
    custom = client.CustomObjectsApi(cluster.api)
    try:
        with install_chart(cluster, ns, "runtime.networkPolicy.metricsFrom[0].podSelector.matchLabels.role=scraper"):
            for job in ("a", "b"):
                custom.create_namespaced_custom_object(API_GROUP, API_VERSION, ns, PLURAL, _job(job))
            core.create_namespaced_pod(ns, _probe_pod("scraper", SCRAPER))
            core.create_namespaced_pod(ns, _probe_pod("stranger", {"role": "other"}))
            n = Node(cluster, ns)
            for pod in ("a-ps-0", "a-worker-0", "b-ps-0", "b-worker-0", "scraper", "stranger"):
                cluster.wait_pod(
                    ns, pod, lambda p: p is not None and p.status.phase == "Running", timeout=240, what="Running"
                )
            for job in ("a", "b"):  # training: the PS serves and its worker's Steps go over the data path
                wait_for(
                    f"job {job} training",
                    lambda job=job: (
                        '"event": "serving"' in cluster.pod_log(ns, f"{job}-ps-0")
                        and '"event": "data-path"' in cluster.pod_log(ns, f"{job}-worker-0")
                    ),
                    timeout=180,
                    interval=1,
                )
            yield n
            custom.delete_collection_namespaced_custom_object(API_GROUP, API_VERSION, ns, PLURAL)
    finally:
        cluster.delete_namespace(ns)


def test_containers_run_non_root_with_a_read_only_root_and_no_capabilities(node):
    operator = node.core.list_namespaced_pod(node.ns, label_selector="app.kubernetes.io/name=tfps").items[0]
    code = (
        "import json,os\n"
        "caps = lambda pid: [l.split()[1] for l in open(f'/proc/{pid}/status') if l.startswith('CapEff')][0]\n"
        "try:\n open('/written-by-test', 'w'); root_writable = True\n"
        "except OSError as e:\n root_writable = e.strerror\n"
        "print(json.dumps({'uid': os.getuid(), 'main_uid': os.stat('/proc/1').st_uid, 'caps': caps('self'),"
        " 'main_caps': caps(1), 'root': root_writable}))"
    )
    for pod in ("a-ps-0", "a-worker-0", operator.metadata.name):
        seen = json.loads(node.exec(pod, code).stdout)
        assert seen["uid"] == 10001 and seen["main_uid"] == 10001, (pod, seen)
        assert int(seen["caps"], 16) == 0 and int(seen["main_caps"], 16) == 0, (pod, seen)
        assert seen["root"] == "Read-only file system", (pod, seen)


def test_the_ps_cpu_limit_is_its_cgroup_quota_and_the_cpus_it_sees(node):
    seen = json.loads(
        node.exec(
            "a-ps-0",
            (
                "import json,os\n"
                "r = lambda f: open('/sys/fs/cgroup/cpu/' + f).read().strip()\n"
                "print(json.dumps({'quota': r('cpu.cfs_quota_us'), 'period': r('cpu.cfs_period_us'),\n"
                "                  'cores': os.cpu_count()}))"
            ),
        ).stdout
    )
    assert int(seen["quota"]) == int(PS_CPU_LIMIT) * int(seen["period"]), seen
    assert seen["cores"] >= 2, "the limit, not the node's cores, must decide"
    threads = [
        json.loads(line)
        for line in node.cluster.pod_log(node.ns, "a-ps-0").splitlines()
        if '"event": "threads"' in line
    ]
    assert threads and threads[0]["threads"] == int(PS_CPU_LIMIT) and threads[0]["source"] == "cgroup", (
        threads,
        node.cluster.pod_log(node.ns, "a-ps-0")[:3000],
    )


def test_the_ps_and_the_worker_run_under_sched_batch(node):
    """Each sets SCHED_BATCH for itself at start, unprivileged (its pod has no capabilities), and
    the kernel says its main process runs under it."""
    for pod in ("a-ps-0", "a-worker-0"):
        seen = node.exec(pod, "import os; print(os.sched_getscheduler(1) == os.SCHED_BATCH)").stdout.strip()
        assert seen == "True", (pod, seen)


def test_network_policy_admits_the_job_and_refuses_other_jobs(node):
    a_ps, b_ps = node.ip("a-ps-0"), node.ip("b-ps-0")
    for port in (2222, 2223):  # gRPC and the data path
        assert node.connects("a-worker-0", a_ps, port), f"job a's worker cannot reach its own PS on {port}"
        assert not node.connects("a-worker-0", b_ps, port), f"job a's worker reached job b's PS on {port}"
        assert not node.connects("scraper", b_ps, port), f"a pod outside the job reached its PS on {port}"


def test_metrics_port_admits_only_the_allowed_peers(node):
    b_ps = node.ip("b-ps-0")
    assert node.connects("scraper", b_ps, 9090)
    assert not node.connects("stranger", b_ps, 9090)


def test_headless_service_has_pod_ips_and_tf_config_names_resolve(node, cluster):
    discovery = client.DiscoveryV1Api(cluster.api)
    ips = {node.ip("a-ps-0"), node.ip("a-worker-0")}

    def slice_ips():
        slices = discovery.list_namespaced_endpoint_slice(node.ns, label_selector="kubernetes.io/service-name=a").items
        return {addr for s in slices for e in s.endpoints or [] for addr in e.addresses}

    wait_for("the EndpointSlices to list both pod IPs", lambda: slice_ips() == ips, timeout=60, interval=0.5)
    endpoints = node.core.read_namespaced_endpoints("a", node.ns)
    assert {a.ip for s in endpoints.subsets or [] for a in s.addresses or []} == ips

    resolved = json.loads(
        node.exec(
            "a-worker-0",
            (
                "import json,os,socket\n"
                "cluster = json.loads(os.environ['TF_CONFIG'])['cluster']\n"
                "names = [hp.rsplit(':', 1)[0] for hps in cluster.values() for hp in hps]\n"
                "print(json.dumps({n: socket.gethostbyname(n) for n in names}))"
            ),
        ).stdout
    )
    assert resolved == {
        f"a-ps-0.a.{node.ns}.svc": node.ip("a-ps-0"),
        f"a-worker-0.a.{node.ns}.svc": node.ip("a-worker-0"),
    }


def test_kubectl_logs_exec_and_port_forward(node, cluster):
    logs = cluster.kubectl("logs", "-n", node.ns, "a-ps-0").stdout
    assert '"event": "threads"' in logs, logs[-1000:]
    assert node.exec("a-ps-0", "import socket; print(socket.gethostname())").stdout.strip() == "a-ps-0"

    local = socket.socket()
    local.bind(("127.0.0.1", 0))
    port = local.getsockname()[1]
    local.close()
    fwd = subprocess.Popen(
        ["kubectl", "port-forward", "-n", node.ns, "pod/a-ps-0", f"{port}:9090", "--address", "127.0.0.1"],
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def scraped():
            try:
                return opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                return ""

        body = wait_for("metrics through kubectl port-forward", scraped, timeout=30, interval=0.5)
        assert "tfps_ps_global_step" in body, body[:500]
    finally:
        fwd.terminate()
        fwd.wait(10)


def test_no_packet_leaves_the_cluster_addresses(node, cluster):
    """From a pod: an outside address has no route at all, and an address that is routed to the node
    but belongs to nothing of the cluster's is dropped by the guard (its counter grows)."""
    hc = cluster.hack
    before = hc.node.guard_drops()
    unreachable = node.exec(
        "stranger",
        (
            "import socket\n"
            "for addr in ('192.0.2.1', '8.8.8.8'):\n"
            "    try:\n        socket.create_connection((addr, 80), timeout=2)\n        print('connected', addr)\n"
            "    except OSError as e:\n        print(addr, e.errno)"
        ),
        check=False,
    ).stdout
    assert "connected" not in unreachable, unreachable
    assert not node.connects("stranger", "198.19.77.77", 80)
    assert hc.node.guard_drops() > before, "the guard dropped nothing"
