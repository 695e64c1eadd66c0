"""The Helm chart in k8s/specedge, validated offline (no cluster can run here).

helm (from a PyPI wheel, see k8s/fetch_tools.py) lints and renders the chart for every
values file; the rendered objects are checked against the Kubernetes schemas
(kubernetes-validate), the RayService against the KubeRay v1.7.0 schema and admission rules,
and the RayService's serveConfigV2 against Ray Serve's own config schema, the app's
``AppConfig`` and the deployments ``deploy:build_app`` actually builds, so chart and app
cannot drift.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deploy.config import AppConfig, RouterConfig, hash_api_key
from tests.k8s.chart import (CHART, KUBE_VERSIONS, VALUES_DIR, by_kind, gpus_per_replica, helm,
                             kuberay_admission_errors, one, quantity, ray_container, render,
                             schema_errors, serve_config, template, worker_gpus)

VALUES = sorted(VALUES_DIR.glob("*.yaml"))
# chart defaults alone, then each documented values file
CASES = [pytest.param([], id="defaults")] + [pytest.param([v], id=v.stem) for v in VALUES]


def test_values_files_present():
    assert {v.stem for v in VALUES} >= {"cpu-dev", "gpu-qwen3-14b", "gpu-qwen3-32b-sharded"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """Each case rendered once: {case id: manifests}."""
    return {("defaults" if not v else v[0].stem): render(v) for v in ([], *([x] for x in VALUES))}


def _case_id(values: list[Path]) -> str:
    return values[0].stem if values else "defaults"


def _values(values: list[Path]) -> dict:
    """The merged values (chart defaults + file), as helm sees them, for the app block."""
    base = yaml.safe_load((CHART / "values.yaml").read_text())
    for v in values:
        _deep_merge(base, yaml.safe_load(v.read_text()))
    return base


def _deep_merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


# ------------------------------------------------------------------ helm lint / template

@pytest.mark.parametrize("values", CASES)
def test_helm_lint_strict(values):
    for kv in KUBE_VERSIONS:
        args = ["lint", "--strict", str(CHART), "--kube-version", kv]
        for v in values:
            args += ["-f", str(v)]
        r = helm(*args, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("values", CASES)
def test_rendered_objects_validate(values, rendered):
    docs = rendered[_case_id(values)]
    kinds = {d["kind"] for d in docs}
    assert "RayService" in kinds
    for kv in KUBE_VERSIONS:
        for doc in docs:
            errs = schema_errors(doc, kv)
            assert not errs, f"{doc['kind']}/{doc['metadata']['name']} (k8s {kv}): {errs}"
    rs = one(docs, "RayService")
    assert kuberay_admission_errors(rs) == []
    for tpl in _pod_templates(rs):
        for c in tpl["spec"]["containers"]:
            for section in ("requests", "limits"):
                for res, q in c.get("resources", {}).get(section, {}).items():
                    assert re.fullmatch(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(q)), (res, q)


def _pod_templates(rs: dict) -> list[dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster.get("workerGroupSpecs", [])]


def test_schema_rejects_what_kuberay_would(rendered):
    """The RayService schema and admission checks are not vacuous."""
    rs = one(rendered["gpu-qwen3-14b"], "RayService")
    bad = copy.deepcopy(rs)
    bad["spec"]["upgradeStrategy"]["type"] = "Recreate"       # a RayCluster-only strategy
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["gpu"] = 1
    bad["spec"]["serveConfig"] = "v1 field"
    errs = "\n".join(schema_errors(bad, KUBE_VERSIONS[0]))
    for needle in ("'Recreate' is not one of", "is not of type 'string'", "'gpu' was unexpected",
                   "'serveConfig' was unexpected"):
        assert needle in errs
    bad = copy.deepcopy(rs)
    g = bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    g["minReplicas"], g["maxReplicas"] = 3, 2
    bad["metadata"]["name"] = "x" * 48
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["volumes"][0]["hostPath"] = {"path": "/"}
    errs = "\n".join(kuberay_admission_errors(bad))
    for needle in ("minReplicas 3 > maxReplicas 2", "at most 47 characters", "exactly one source"):
        assert needle in errs


def test_long_release_name_fits_kuberay_limit():
    rs = one(render(release="a-very-long-release-name-for-a-platform-team-rollout"), "RayService")
    assert len(rs["metadata"]["name"]) <= 47
    assert kuberay_admission_errors(rs) == []


# ------------------------------------------------------------------ serveConfigV2 vs the app

@pytest.fixture(scope="module")
def serve_builder():
    """Ray Serve's own builder (what `serve build`/`serve deploy` run on an import path)."""
    from ray.serve._private.build_app import build_app as serve_build

    from deploy.application import build_app

    def build(app_cfg: dict):
        return serve_build(build_app(app_cfg["args"]), name=app_cfg["name"])

    return build


@pytest.mark.parametrize("values", CASES)
def test_serve_config_is_what_the_app_accepts(values, rendered, serve_builder):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    rs = one(rendered[_case_id(values)], "RayService")
    cfg = serve_config(rs)
    schema = ServeDeploySchema(**cfg)  # Ray Serve's config-file model (serve deploy / KubeRay)
    assert schema.http_options.port == 8000 and schema.http_options.host == "0.0.0.0"
    (app,) = cfg["applications"]
    assert app["import_path"] == "deploy:build_app"
    parsed = AppConfig(**app["args"])  # the app's model, extra="forbid": no unknown keys
    assert app["route_prefix"] == parsed.route_prefix

    # the args are the values' `app` block, verbatim, plus the mounted tenants file
    expected = copy.deepcopy(_values(values)["app"])
    if "tenants_file" in parsed.router.model_fields_set:
        expected.setdefault("router", {})["tenants_file"] = parsed.router.tenants_file
    assert app["args"] == expected

    built = serve_builder(app)
    names = {d.name for d in built.deployments}
    assert built.ingress_deployment_name in names
    for override in app.get("deployments", []):
        assert override["name"] in names, f"override for a deployment the app lacks: {override['name']}"
        if "autoscaling_config" in override:
            assert override["num_replicas"] == "auto"
            AutoscalingConfig(**override["autoscaling_config"])


def _replica_demand(built, name: str = "Verifier") -> tuple[float, float]:
    """(CPUs, GPUs) one replica of a built deployment reserves (placement group or actor)."""
    (dep,) = [d for d in built.deployments if d.name == name]
    rc = dep._replica_config
    if rc.placement_group_bundles:
        return (sum(b.get("CPU", 0) for b in rc.placement_group_bundles),
                sum(b.get("GPU", 0) for b in rc.placement_group_bundles))
    return rc.resource_dict.get("CPU", 0), rc.resource_dict.get("GPU", 0)


@pytest.mark.parametrize("values", CASES)
def test_gpu_worker_group_matches_verifier(values, rendered, serve_builder):
    """GPUs requested = pipeline_parallel_size x num_gpus_per_stage x replicas, and every
    worker pod fits the replicas it is meant to hold (as the app's deployment asks)."""
    vals = _values(values)
    rs = one(rendered[_case_id(values)], "RayService")
    (app,) = serve_config(rs)["applications"]
    verifier = app["args"].get("verifier", {})
    gpr = gpus_per_replica(verifier)
    autoscaling = next((d["autoscaling_config"] for d in app.get("deployments", [])
                        if d["name"] == "Verifier" and "autoscaling_config" in d), None)
    lo, hi = ((autoscaling["min_replicas"], autoscaling["max_replicas"]) if autoscaling
              else (verifier.get("num_replicas", 1),) * 2)
    assert worker_gpus(rs) == (gpr * lo, gpr * hi)
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] == bool(autoscaling and gpr)

    cpus, gpus = _replica_demand(serve_builder(app))
    assert gpus == pytest.approx(verifier.get("pipeline_parallel_size", 1) * verifier.get("tensor_parallel_size", 1)
                                 * verifier.get("num_gpus_per_stage", 0))
    if gpr == 0:
        assert "workerGroupSpecs" not in cluster
        head = ray_container(cluster["headGroupSpec"]["template"])
        assert quantity(head["resources"]["limits"]["cpu"]) >= cpus * verifier.get("num_replicas", 1)
        return
    (group,) = cluster["workerGroupSpecs"]
    worker = ray_container(group["template"])
    per_pod = int(worker["resources"]["limits"][vals["gpuWorkers"]["gpuResourceName"]])
    # a pod holds per_pod / gpr replicas (a fraction when one replica spans several pods)
    assert quantity(worker["resources"]["limits"]["cpu"]) >= cpus * per_pod / gpr


@pytest.mark.parametrize("sets, message", [
    ({"app.verifier.num_gpus_per_stage": 1, "app.verifier.pipeline_parallel_size": 4,
      "gpuWorkers.gpusPerPod": 3}, "multiple or a divisor"),
    ({"app.verifier.num_gpus_per_stage": 1, "app.verifier.num_replicas": 3,
      "gpuWorkers.gpusPerPod": 2}, "do not fill whole pods"),
    # tensor-parallel ranks share one node (STRICT_PACK): a pod holds whole replicas (issue 64)
    ({"app.verifier.num_gpus_per_stage": 1, "app.verifier.tensor_parallel_size": 4,
      "gpuWorkers.gpusPerPod": 2}, "places a verifier replica's 4 GPUs on one node (STRICT_PACK)"),
    ({"serve.autoscaling.enabled": True, "serve.autoscaling.minReplicas": 3,
      "serve.autoscaling.maxReplicas": 2}, "must not exceed"),
    ({"serve.autoscaling.enabled": True, "app.topology": "colocated"}, "needs app.topology split"),
    # the values schema embeds AppConfig's JSON schema: helm refuses bad app settings
    ({"app.verifier.pipeline_paralel_size": 2}, "additional properties 'pipeline_paralel_size' not allowed"),
    ({"app.verifier.pipeline_parallel_size": 0}, "/app/verifier/pipeline_parallel_size"),
    ({"app.target.dtype": "fp8"}, "/app/target/dtype"),
    # the resource wiring AppConfig refuses (issue 53), refused by the schema before Serve sees it
    ({"app.target.device": "cuda", "app.verifier.num_gpus_per_stage": 0},
     "/app/verifier/num_gpus_per_stage': exclusiveMinimum"),
    ({"app.target.device": "cuda", "app.verifier.num_gpus_per_stage": 1, "app.server_draft.model.model": "embedded",
      "app.server_draft.model.device": "cuda"}, "/app/topology': value must be 'colocated'"),
    ({"tenants.entries": [{"name": "a b", "api_key": "0123456789"}]}, "/tenants/entries/0/name"),
    ({"gpuWorker": {"gpusPerPod": 2}}, "additional properties 'gpuWorker' not allowed"),
])
def test_chart_refuses_inconsistent_settings(sets, message):
    r = template(sets=sets, check=False)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_values_schema_is_generated_from_app_config():
    """k8s/specedge/values.schema.json is k8s/values_schema.py's output for today's AppConfig."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("values_schema", CHART.parent / "values_schema.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    def norm(node):  # titles are cosmetic and vary across pydantic releases
        if isinstance(node, dict):
            return {k: norm(v) for k, v in node.items() if k != "title"}
        return [norm(v) for v in node] if isinstance(node, list) else node

    committed = json.loads((CHART / "values.schema.json").read_text())
    assert norm(committed) == norm(json.loads(mod.render())), \
        "AppConfig changed: regenerate with `.venv/bin/python k8s/values_schema.py`"


def test_app_typos_fail_the_drift_check():
    """Past the values schema (--skip-schema-validation), the AppConfig check still catches them."""
    for bad in ({"pipeline_paralel_size": 2}, {"pipeline_parallel_size": 0}):
        ((key, val),) = bad.items()
        r = template(sets={f"app.verifier.{key}": val}, extra=["--skip-schema-validation"])
        (app,) = serve_config(one([d for d in yaml.safe_load_all(r.stdout) if d], "RayService"))["applications"]
        with pytest.raises(ValidationError):
            AppConfig(**app["args"])


def test_gpu_count_scales_with_pipeline_and_replicas():
    for pp, g, n, gpp in [(1, 1, 3, 0), (2, 1, 2, 0), (4, 1, 2, 8), (2, 0.5, 2, 0), (8, 1, 1, 4)]:
        rs = one(render(sets={"app.verifier.pipeline_parallel_size": pp, "app.target.device": "cuda",
                              "app.verifier.num_gpus_per_stage": g, "app.verifier.num_replicas": n,
                              "gpuWorkers.gpusPerPod": gpp}), "RayService")
        assert worker_gpus(rs) == (gpus_per_replica({"pipeline_parallel_size": pp, "num_gpus_per_stage": g}) * n,) * 2
        assert kuberay_admission_errors(rs) == []


# ------------------------------------------------------------------ tenants, metrics, networking

def _mounts(rs: dict) -> list[tuple[dict, dict]]:
    return [(tpl, c) for tpl in _pod_templates(rs) for c in tpl["spec"]["containers"]]


@pytest.mark.parametrize("case", ["cpu-dev", "gpu-qwen3-14b"])
def test_tenants_secret_is_the_routers_file(case, rendered, tmp_path):
    docs = rendered[case]
    rs, secret = one(docs, "RayService"), one(docs, "Secret")
    (app,) = serve_config(rs)["applications"]
    tenants_file = Path(app["args"]["router"]["tenants_file"])
    ((key, text),) = secret["stringData"].items()
    assert key == tenants_file.name
    assert "api_key:" not in text, "plain keys must not reach the cluster"
    (tmp_path / key).write_text(text)
    tenants = RouterConfig(tenants_file=str(tmp_path / key)).load_tenants()
    entries = _values([VALUES_DIR / f"{case}.yaml"])["tenants"]["entries"]
    assert [t.name for t in tenants] == [e["name"] for e in entries]
    for t, e in zip(tenants, entries):
        want = hash_api_key(e["api_key"]) if "api_key" in e else e["api_key_sha256"]
        assert t.api_key_sha256 == want
        assert t.weight == e["weight"] and t.max_sessions == e["max_sessions"]
        assert t.tokens_per_second == e["tokens_per_second"]
    for tpl, c in _mounts(rs):
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tenants"]
        assert mount["mountPath"] == str(tenants_file.parent) and mount["readOnly"]
        (vol,) = [v for v in tpl["spec"]["volumes"] if v["name"] == "tenants"]
        assert vol["secret"]["secretName"] == secret["metadata"]["name"]
        digest = hashlib.sha256(text.strip().encode()).hexdigest()
        assert tpl["metadata"]["annotations"]["checksum/tenants"] == digest


def test_existing_tenants_secret(rendered):
    docs = rendered["gpu-qwen3-32b-sharded"]
    assert not by_kind(docs, "Secret")
    rs = one(docs, "RayService")
    (app,) = serve_config(rs)["applications"]
    assert app["args"]["router"]["tenants_file"] == "/etc/specedge/tenants/tenants.yaml"
    for tpl in _pod_templates(rs):
        (vol,) = [v for v in tpl["spec"]["volumes"] if v["name"] == "tenants"]
        assert vol["secret"]["secretName"] == "specedge-tenants"


def test_no_tenants_means_no_tenants_file(rendered):
    (app,) = serve_config(one(rendered["defaults"], "RayService"))["applications"]
    assert "tenants_file" not in app["args"].get("router", {})


@pytest.mark.parametrize("case", ["gpu-qwen3-14b", "gpu-qwen3-32b-sharded"])
def test_pod_monitor_scrapes_ray_metrics_port(case, rendered):
    docs = rendered[case]
    rs, pm = one(docs, "RayService"), one(docs, "PodMonitor")
    selector = pm["spec"]["selector"]["matchLabels"]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    cluster = rs["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"]] + cluster.get("workerGroupSpecs", [])
    for g in groups:
        labels = g["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        port = int(g["rayStartParams"]["metrics-export-port"])
        ports = {p["name"]: p["containerPort"] for p in ray_container(g["template"])["ports"]}
        assert ports[endpoint["port"]] == port
    assert pm["spec"]["namespaceSelector"]["matchNames"] == ["llm"]


def test_pdb_ingress_and_network_policy_target_the_ray_pods(rendered):
    docs = rendered["gpu-qwen3-32b-sharded"]
    rs = one(docs, "RayService")
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    worker_labels = group["template"]["metadata"]["labels"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= worker_labels.items()
    head_labels = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert not pdb["spec"]["selector"]["matchLabels"].items() <= head_labels.items()

    serve_svc = rs["spec"]["serveService"]
    ingress = one(docs, "Ingress")
    backends = [p["backend"]["service"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    svc_ports = {p["name"] for p in serve_svc["spec"]["ports"]}
    for b in backends:
        assert b["name"] == serve_svc["metadata"]["name"] and b["port"]["name"] in svc_ports

    np_ = one(docs, "NetworkPolicy")
    sel = np_["spec"]["podSelector"]["matchLabels"]
    assert sel.items() <= worker_labels.items() and sel.items() <= head_labels.items()
    head_ports = {p["name"] for p in ray_container(rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])["ports"]}
    for rule in np_["spec"]["ingress"]:
        for p in rule.get("ports", []):
            assert isinstance(p["port"], int) or p["port"] in head_ports


def test_serve_service_targets_serve_port(rendered):
    for docs in rendered.values():
        rs = one(docs, "RayService")
        (port,) = rs["spec"]["serveService"]["spec"]["ports"]
        for tpl in _pod_templates(rs):
            ports = {p["name"]: p["containerPort"] for p in ray_container(tpl)["ports"]}
            assert ports[port["targetPort"]] == serve_config(rs)["http_options"]["port"]


def test_install_docs_name_every_values_file():
    readme = (CHART.parent / "README.md").read_text()
    for v in VALUES:
        assert f"k8s/values/{v.name}" in readme
    assert "helm upgrade" in readme and "helm install" in readme


def test_helm_binary_is_v4():
    out = helm("version", "--short").stdout
    assert out.startswith("v4."), out


# ------------------------------------------------------------------ node loss and GCS restarts (issue 65)

def _worker_template(rs: dict) -> dict:
    (group,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group["template"]


def test_gcs_fault_tolerance_values_render_kuberay_options(rendered):
    """gcsFaultTolerance: KubeRay's gcsFaultToleranceOptions (the Redis address, the password from a Secret), checked
    against the KubeRay v1.7.0 schema by test_rendered_objects_validate; off by default."""
    assert "gcsFaultToleranceOptions" not in one(rendered["defaults"], "RayService")["spec"]["rayClusterConfig"]
    ft = one(rendered["gpu-qwen3-14b"], "RayService")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    values = _values([VALUES_DIR / "gpu-qwen3-14b.yaml"])["gcsFaultTolerance"]
    assert ft["redisAddress"] == values["redisAddress"]
    assert ft["redisPassword"] == {"valueFrom": {"secretKeyRef": values["passwordSecret"]}}
    assert "value" not in ft["redisPassword"], "the password comes from a Secret, never from values"
    rs = one(render(sets={"gcsFaultTolerance.enabled": True, "gcsFaultTolerance.redisAddress": "redis:6379",
                          "gcsFaultTolerance.redisUsername": "ray",
                          "gcsFaultTolerance.externalStorageNamespace": "specedge-prod"}), "RayService")
    ft = rs["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert ft == {"redisAddress": "redis:6379", "redisUsername": {"value": "ray"},
                  "externalStorageNamespace": "specedge-prod"}  # no Secret named: a Redis without a password
    assert schema_errors(rs, KUBE_VERSIONS[-1]) == [] and kuberay_admission_errors(rs) == []
    r = template(sets={"gcsFaultTolerance.enabled": True}, check=False)
    assert r.returncode != 0 and "redisAddress" in r.stderr, r.stderr


def test_gcs_fault_tolerance_schema_and_admission_are_not_vacuous(rendered):
    rs = one(rendered["gpu-qwen3-14b"], "RayService")
    bad = copy.deepcopy(rs)
    ft = bad["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    del ft["redisAddress"]
    ft["redisPasword"] = {"value": "x"}
    errs = "\n".join(schema_errors(bad, KUBE_VERSIONS[0]))
    assert "'redisAddress' is a required property" in errs and "'redisPasword' was unexpected" in errs, errs
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["redis-password"] = "x"
    bad["metadata"].setdefault("annotations", {})["ray.io/ft-enabled"] = "true"
    errs = "\n".join(kuberay_admission_errors(bad))
    assert "redis-password" in errs and "ft-enabled" in errs, errs


def test_verifier_pods_spread_over_nodes(rendered):
    """GPU worker pods (one verifier replica each) avoid sharing a node: a topology spread over hostnames and a
    preferred pod anti-affinity, both selecting the worker pods only; the PDB limits drains to one at a time."""
    rs = one(rendered["gpu-qwen3-14b"], "RayService")
    tpl = _worker_template(rs)
    labels = tpl["metadata"]["labels"]
    head_labels = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"]
    (spread,) = tpl["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    sel = spread["labelSelector"]["matchLabels"]
    assert sel.items() <= labels.items() and not sel.items() <= head_labels.items()
    (pref,) = tpl["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["podAffinityTerm"]["labelSelector"]["matchLabels"] == sel
    assert pref["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    pdb = one(rendered["gpu-qwen3-14b"], "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["selector"]["matchLabels"] == sel
    assert "topologySpreadConstraints" not in rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]


def test_verifier_spread_options():
    gpu = {"app.target.device": "cuda", "app.verifier.num_gpus_per_stage": 1, "app.verifier.num_replicas": 3}
    hard = _worker_template(one(render(sets={**gpu, "gpuWorkers.podAntiAffinity": "required",
                                             "gpuWorkers.topologySpread.topologyKeys": [
                                                 "kubernetes.io/hostname", "topology.kubernetes.io/zone"],
                                             "gpuWorkers.topologySpread.whenUnsatisfiable": "DoNotSchedule"}),
                                    "RayService"))
    (term,) = hard["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert [c["topologyKey"] for c in hard["spec"]["topologySpreadConstraints"]] == [
        "kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    assert {c["whenUnsatisfiable"] for c in hard["spec"]["topologySpreadConstraints"]} == {"DoNotSchedule"}
    off = _worker_template(one(render(sets={**gpu, "gpuWorkers.podAntiAffinity": "none",
                                            "gpuWorkers.topologySpread.enabled": False}), "RayService"))
    assert "affinity" not in off["spec"] and "topologySpreadConstraints" not in off["spec"]
    # an affinity of the operator's own is kept, and its own podAntiAffinity wins
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}},
           "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    tpl = _worker_template(one(render(sets={**gpu, "gpuWorkers.affinity": own}), "RayService"))
    assert tpl["spec"]["affinity"] == own
    tpl = _worker_template(one(render(sets={**gpu, "gpuWorkers.affinity": {"nodeAffinity": own["nodeAffinity"]}}),
                               "RayService"))
    assert set(tpl["spec"]["affinity"]) == {"nodeAffinity", "podAntiAffinity"}
    r = template(sets={**gpu, "gpuWorkers.podAntiAffinity": "always"}, check=False)
    assert r.returncode != 0 and "podAntiAffinity" in r.stderr, r.stderr
