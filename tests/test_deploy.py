"""The deployment files, checked without a cluster or a Docker daemon: every Kustomize render validates against
the Kubernetes schemas (kubernetes-validate, offline) and the pinned CRDs, the pieces refer to each other
consistently, the endpoint picker's configurations are ones llm-d-router v0.10.0's picker accepts, and the
images install the
project with the same script as `make` and CI. tests/test_deploy_live.py checks them against running servers."""
from __future__ import annotations

import hashlib
import re
import shlex
import socket
import subprocess
import sys
import tomllib

import dockerfile
import jsonschema
import pytest
import yaml

from deploy_support import (CPU_RENDERS, CRDS, DEPLOY, GATEWAYS, K8S_VERSIONS, KUBE, RENDERS, arg_values, compose_value,
                            crd_schemas, epp_config, one, published_ports, render, server_container, validate)
from metrics_support import fake_llm_metrics
from triton_vlm.paths import REPO_ROOT
from triton_vlm.server.repository import check_parameters

DOCKER = DEPLOY / "docker"
IMAGE_PORTS = {"8000", "8001", "8002", "9000"}

# EndpointPickerConfig of llm-d-router v0.10.0's picker (apix/config/v1alpha1/endpointpickerconfig_types.go),
# decoded strictly (pkg/epp/config/loader: serializer.EnableStrict; each plugin's parameters with StrictDecoder)
_REF = {"type": "object", "required": ["pluginRef"], "additionalProperties": False,
        "properties": {"pluginRef": {"type": "string", "minLength": 1}, "weight": {"type": "number"}}}
_PLUGIN_REF = {"type": "object", "additionalProperties": False, "properties": {"pluginRef": {"type": "string"}}}
EPP_CONFIG_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "plugins"],
    "properties": {
        "apiVersion": {"const": "llm-d.ai/v1alpha1"},
        "kind": {"const": "EndpointPickerConfig"},
        "featureGates": {"type": "array", "items": {"type": "string"}},
        "plugins": {"type": "array", "items": {
            "type": "object", "required": ["type"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "type": {"type": "string"}, "parameters": {}}}},
        "schedulingProfiles": {"type": "array", "items": {
            "type": "object", "required": ["name", "plugins"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "plugins": {"type": "array", "items": _REF}}}},
        "saturationDetector": _PLUGIN_REF,
        "dataLayer": {"type": "object", "additionalProperties": False, "properties": {
            "injectDefaults": {"type": "boolean"}, "discovery": _PLUGIN_REF,
            "crossReplicaSyncerPluginRef": {"type": "string"}, "crossReplicaSyncInterval": {"type": "string"},
            "sources": {"type": "array", "items": {
                "type": "object", "required": ["pluginRef"], "additionalProperties": False,
                "properties": {"pluginRef": {"type": "string"},
                               "extractors": {"type": "array", "items": _PLUGIN_REF}}}}}},
        "flowControl": {"type": "object"},
        "requestHandler": {"type": "object"},
        "parser": _PLUGIN_REF,
    },
}
# plugin types llm-d-router v0.10.0 registers (cmd/epp/runner/runner.go) that our configurations may use, each with
# the parameters its factory decodes (strictly: an unknown key fails the picker's start)
_OBJ = {"type": "object"}
EPP_PLUGIN_PARAMS = {
    "metrics-data-source": {"scheme", "path", "port", "insecureSkipVerify", "caCertPath", "clientCertPath",
                            "clientKeyPath", "interval"},
    "core-metrics-extractor": {"engineLabelKey", "defaultEngine", "engineConfigs"},
    "endpoint-notification-source": set(),
    "token-producer": {"udsTokenizerConfig", "vllm", "estimate", "modelName"},
    "approx-prefix-cache-producer": {"autoTune", "blockSizeTokens", "blockSize", "maxPrefixBlocksToMatch",
                                     "maxPrefixTokensToMatch", "lruCapacityPerServer"},
    "precise-prefix-cache-producer": {"tokenProcessorConfig", "indexerConfig", "kvEventsConfig",
                                      "speculativeIndexing", "speculativeTTL"},
    "prefix-cache-scorer": {"prefixMatchInfoProducerName", "matchLengthWeight", "matchLengthScaleTokens"},
    "queue-scorer": set(), "running-requests-size-scorer": set(), "kv-cache-utilization-scorer": set(),
    "lora-affinity-scorer": set(), "max-score-picker": {"maxNumOfEndpoints"}, "single-profile-handler": set(),
}
# core-metrics-extractor's parameters (pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go)
EXTRACTOR_KEYS = {"engineLabelKey", "defaultEngine", "engineConfigs"}
ENGINE_KEYS = {"name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec",
               "cacheBlockSizeLabelName", "cacheNumBlocksLabelName", "cacheBlockSizeSpec", "cacheNumBlocksSpec",
               "customMetrics"}
ENGINE_LABEL = "llm-d.ai/engine-type"  # the extractor's default engineLabelKey (mapping_registry.go)
# nested parameters of the precise producer (llm-d-kv-cache's kvblock.TokenProcessorConfig, kvevents.Config)
TOKEN_PROCESSOR_KEYS = {"blockSize", "blockSizeTokens", "hashSeed"}
KV_EVENTS_KEYS = {"zmqEndpoint", "topicFilter", "concurrency", "engineType", "discoverPods", "podDiscoveryConfig"}
POD_DISCOVERY_KEYS = {"podLabelSelector", "podNamespace", "socketPort"}


# --- Kubernetes: schemas -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", RENDERS)
def test_every_rendered_manifest_validates_offline(path, monkeypatch):
    def no_network(*a, **k):
        raise AssertionError(f"validation tried the network: {a}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    docs = render(path)
    assert docs
    for version in K8S_VERSIONS:
        for doc in docs:
            try:
                validate(doc, version)
            except Exception as e:  # noqa: BLE001 - name the manifest in the failure
                pytest.fail(f"{path}: {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): {e}")


def test_schemas_catch_mistakes():
    """The validation is not a rubber stamp: a misspelt field, a wrong type and a bad enum value all fail."""
    dep = one(render("base"), "Deployment", "triton-vlm")
    dep["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(Exception, match="livenesProbe"):
        validate(dep, K8S_VERSIONS[-1])
    pool = one(render("overlays/inference-gateway"), "InferencePool")
    pool["spec"]["targetPorts"] = [{"number": "9000"}]
    with pytest.raises(jsonschema.ValidationError):
        validate(pool, K8S_VERSIONS[-1])
    pool = one(render("overlays/inference-gateway"), "InferencePool")
    pool["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        validate(pool, K8S_VERSIONS[-1])
    route = one(render("overlays/inference-gateway"), "HTTPRoute")
    route["spec"]["rules"][0]["backendRef"] = route["spec"]["rules"][0].pop("backendRefs")
    with pytest.raises(jsonschema.ValidationError):
        validate(route, K8S_VERSIONS[-1])


def test_pinned_crds_are_the_recorded_upstream_files_and_used():
    """Each pinned CRD is byte for byte the upstream file SOURCES.md records, and each renders' custom kind has
    one (a kind with neither a CRD nor a Kubernetes schema fails validation above)."""
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in (CRDS / "SOURCES.md").read_text().splitlines()
            if line.startswith("| ")]
    recorded = {cols[0]: cols[-1] for cols in rows if cols[0].endswith(".yaml")}
    files = sorted(CRDS.glob("*.yaml"))
    assert {f.name for f in files} == set(recorded)
    for f in files:
        assert hashlib.sha256(f.read_bytes()).hexdigest() == recorded[f.name], f.name
    used = {(d["apiVersion"], d["kind"]) for path in RENDERS for d in render(path)}
    assert {("inference.networking.k8s.io/v1", "InferencePool"),
            ("llm-d.ai/v1alpha2", "InferenceObjective"),
            ("gateway.networking.k8s.io/v1", "HTTPRoute"), ("monitoring.coreos.com/v1", "PodMonitor"),
            ("monitoring.coreos.com/v1", "PrometheusRule")} <= used & set(crd_schemas())


# --- Kubernetes: the pieces fit --------------------------------------------------------------------------------
def test_server_deployment_probes_volumes_and_security():
    for path in RENDERS:
        docs = render(path)
        pod = one(docs, "Deployment", "triton-vlm")["spec"]["template"]["spec"]
        c = server_container(docs)
        assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
        startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
        launcher_wait = float(arg_values(c["args"], "--timeout")[-1])
        assert startup >= launcher_wait >= 600, (path, startup, launcher_wait)  # the model load fits in both
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
        model, adapters = mounts["/models/llava"], mounts["/adapters"]
        assert model["readOnly"] and adapters["readOnly"]
        assert all("persistentVolumeClaim" in volumes[m["name"]] for m in (model, adapters))
        assert arg_values(c["args"], "--model") == ["/models/llava"]
        assert arg_values(c["args"], "--lora-dir") == ["/adapters"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == 1) == (path not in CPU_RENDERS), (path, gpus)
        assert ("--device=cuda" in c["args"]) == (path not in CPU_RENDERS)


def test_server_arguments_are_the_launchers():
    """Every flag the manifests and images pass exists in `triton-vlm-serve --help`, and every --set key is a
    parameter some model declares."""
    help_text = subprocess.run([sys.executable, "-m", "triton_vlm.server", "--help"], capture_output=True,
                               text=True, timeout=60, check=True).stdout
    arg_lists = [server_container(render(p))["args"] for p in RENDERS]
    for name in ("cpu", "gpu"):
        arg_lists.append(_instruction(name, "CMD"))
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    arg_lists += [s["command"] for s in compose["services"].values()]
    for args in arg_lists:
        for a in args:
            if a.startswith("--"):
                assert re.search(rf"\s{re.escape(a.split('=')[0])}[\s,]", help_text), a
        sets = {}
        for item in arg_values(args, "--set"):
            key, _, value = item.partition("=")
            model, _, key = key.rpartition(".")
            sets.setdefault(model or "*", {})[key] = value.replace("${VISION_BACKEND:-tensorrt}", "tensorrt")
        check_parameters(sets)


def test_service_podmonitor_and_hpa_refer_to_the_server():
    docs = render("base")
    c = server_container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    pod_labels = one(docs, "Deployment", "triton-vlm")["spec"]["template"]["metadata"]["labels"]
    svc = one(docs, "Service", "triton-vlm")
    assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {arg_values(c["args"], f"--{n}-port")[0] for n in ("http", "grpc", "metrics")} == \
        {str(ports[n]) for n in ("http", "grpc", "metrics")}
    mon = one(docs, "PodMonitor")
    assert mon["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [e["port"] for e in mon["spec"]["podMetricsEndpoints"]] == ["metrics"]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "triton-vlm"}
    [metric] = hpa["spec"]["metrics"]
    [rule] = [r for g in one(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    adapter = yaml.safe_load((KUBE / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    [custom] = adapter["rules"]["custom"]
    assert custom["seriesQuery"].split("{")[0] == rule["record"]
    assert re.fullmatch(custom["name"]["matches"], rule["record"])
    assert custom["name"]["as"] == metric["pods"]["metric"]["name"]
    assert "by (namespace, pod)" in rule["expr"]  # the adapter maps these labels to the pod resource


# --- who reaches Triton's own ports -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["base", "overlays/gpu", *GATEWAYS])
def test_shipped_services_publish_only_the_openai_port(path):
    """Triton's HTTP and gRPC serve every model (and Triton 2.51's HTTP JSON parser dies on 5 MB of `[`): no
    Service of the shipped deployments reaches them, only the OpenAI API, which checks the key; the key comes
    from a Secret, into the environment."""
    docs = render(path)
    c = server_container(docs)
    assert published_ports(docs, c) == {"triton-vlm": {9000}}
    [env] = [e for e in c["env"] if e["name"] == "TRITON_VLM_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "triton-vlm-api-key", "key": "api-key", "optional": True}
    assert not [a for a in c["args"] if "api-key" in a]  # never on a command line


def test_triton_protocols_overlay_publishes_them_behind_a_network_policy():
    docs = render("overlays/triton-protocols")
    c = server_container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert published_ports(docs, c) == {"triton-vlm": {9000}, "triton-vlm-triton": {8000, 8001}}
    pod_labels = one(docs, "Deployment", "triton-vlm")["spec"]["template"]["metadata"]["labels"]
    policy = one(docs, "NetworkPolicy", "triton-vlm-server")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    open_to_all, admitted = set(), {}
    for rule in policy["ingress"]:
        numbers = {ports[p["port"]] for p in rule["ports"]}  # every rule names a port of the container
        if "from" in rule:
            for port in numbers:
                admitted.setdefault(port, []).extend(rule["from"])
        else:
            open_to_all |= numbers
    assert open_to_all == {9000}
    assert admitted[8000] == admitted[8001] == [{"podSelector": {"matchLabels": {"triton-vlm/triton-client": "true"}}}]
    assert set(admitted) == {8000, 8001, 8002}


def test_compose_listens_on_loopback_unless_told():
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        def hosts(env):
            return {port: host for host, port, _ in (compose_value(p, env).rsplit(":", 2) for p in service["ports"])}

        assert hosts({}) == dict.fromkeys(IMAGE_PORTS, "127.0.0.1")
        assert hosts({"TRITON_VLM_BIND": "0.0.0.0"}) == {**dict.fromkeys(IMAGE_PORTS, "127.0.0.1"), "9000": "0.0.0.0"}
        assert hosts({"TRITON_VLM_BIND": "0.0.0.0", "TRITON_VLM_TRITON_BIND": "0.0.0.0"}) == \
            dict.fromkeys(IMAGE_PORTS, "0.0.0.0")
        key = service["environment"]["TRITON_VLM_API_KEY"]
        assert compose_value(key, {"TRITON_VLM_API_KEY": "k"}) == "k" and compose_value(key, {}) == ""
        assert not [a for a in service["command"] if "api-key" in a]
        # in the container: every interface (Docker forwards to the container's address), no key asked for
        assert service["command"][:3] == ["--host", "0.0.0.0", "--insecure"]


def test_containers_listen_on_every_interface_and_say_how_the_key_is_required():
    """The launcher listens on 127.0.0.1 unless told; in a container the published ports reach the container's
    address, so the images and manifests say --host 0.0.0.0 (the images through $TRITON_VLM_HOST), which the
    launcher refuses without a key unless --insecure is explicit."""
    for name in ("cpu", "gpu"):
        env = {k: v for i in _instructions(name) if i.cmd == "ENV" for k, v in zip(i.value[::2], i.value[1::2])}
        assert env.get("TRITON_VLM_HOST") == "0.0.0.0", env
        assert "--insecure" not in _instruction(name, "CMD")  # a bare `docker run` without a key is refused
    for path in RENDERS:
        args = server_container(render(path))["args"]
        assert arg_values(args, "--host") == ["0.0.0.0"] and "--insecure" in args, (path, args)


@pytest.mark.parametrize("path", GATEWAYS)
def test_gateway_pool_route_objectives_and_picker_fit(path):
    docs = render(path)
    c = server_container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    pod_labels = one(docs, "Deployment", "triton-vlm")["spec"]["template"]["metadata"]["labels"]
    pool = one(docs, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"][0]["number"] == ports["openai"] == 9000  # the OpenAI-compatible API
    epp_svc = one(docs, "Service", pool["spec"]["endpointPickerRef"]["name"])
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    epp = one(docs, "Deployment", "triton-vlm-epp")
    assert epp_svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    [route_rule] = one(docs, "HTTPRoute")["spec"]["rules"]
    assert route_rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                          "name": pool["metadata"]["name"]}]
    objectives = [d for d in docs if d["kind"] == "InferenceObjective"]
    assert {o["metadata"]["name"] for o in objectives} == {"french", "sentence"}  # the demo adapters
    assert all(o["spec"]["poolRef"]["name"] == pool["metadata"]["name"] for o in objectives)
    spec = epp["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert arg_values(spec["containers"][0]["args"], "--pool-name") == [pool["metadata"]["name"]]
    rules = {(g, r) for rule in one(docs, "Role")["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools"), ("llm-d.ai", "inferenceobjectives"),
            ("inference.networking.x-k8s.io", "inferenceobjectives")} <= rules  # the deprecated group too
    assert epp["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0"
    assert pod_labels[ENGINE_LABEL] == epp_config(docs)[1]["name"]


@pytest.mark.parametrize("path", GATEWAYS)
def test_endpoint_picker_config_is_one_the_picker_accepts(path):
    config, engine = epp_config(render(path))
    jsonschema.validate(config, EPP_CONFIG_SCHEMA)
    names = {p.get("name") or p["type"] for p in config["plugins"]}
    assert len(names) == len(config["plugins"])
    for plugin in config["plugins"]:
        assert set(plugin.get("parameters") or {}) <= EPP_PLUGIN_PARAMS[plugin["type"]], plugin
    refs = [r["pluginRef"] for prof in config["schedulingProfiles"] for r in prof["plugins"]]
    refs += [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= names
    [extractor] = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    assert set(extractor["parameters"]) <= EXTRACTOR_KEYS
    assert all(set(e) <= ENGINE_KEYS for e in extractor["parameters"]["engineConfigs"])
    assert engine["queuedRequestsSpec"].startswith("triton_vlm_engine_waiting_requests")
    assert engine["runningRequestsSpec"].startswith("triton_vlm_engine_running_requests")
    assert engine["kvUsageSpec"].startswith("triton_vlm_engine_kv_cache_reserved_perc")  # what admission sees
    assert engine["loraSpec"] == "triton_vlm_lora_requests_info"
    assert engine["cacheNumBlocksSpec"].startswith("triton_vlm_engine_kv_blocks_total")
    [profile] = config["schedulingProfiles"]
    scorers = {r["pluginRef"] for r in profile["plugins"] if r["pluginRef"].endswith("-scorer")}
    assert scorers == {"queue-scorer", "running-requests-size-scorer", "kv-cache-utilization-scorer",
                       "lora-affinity-scorer", "prefix-cache-scorer"}
    by_type = {p["type"]: p.get("parameters") or {} for p in config["plugins"]}
    producer = by_type["prefix-cache-scorer"]["prefixMatchInfoProducerName"]
    assert producer in by_type and "token-producer" in by_type  # the scorer's producer, and its tokens' producer
    if path.endswith("precise"):
        assert producer == "precise-prefix-cache-producer"
        params = by_type[producer]
        assert set(params["tokenProcessorConfig"]) <= TOKEN_PROCESSOR_KEYS
        assert set(params["kvEventsConfig"]) <= KV_EVENTS_KEYS
        assert set(params["kvEventsConfig"]["podDiscoveryConfig"]) <= POD_DISCOVERY_KEYS
        assert {"pluginRef": producer} in [e for src in config["dataLayer"]["sources"] for e in src["extractors"]]
    else:  # approximate: no engine support, a tokenizer-free estimate of the prompt's tokens
        assert producer == "approx-prefix-cache-producer" and by_type["token-producer"] == {"estimate": {}}


def test_precise_overlay_wires_the_engines_kv_events_to_the_picker():
    """The servers publish KV-cache events where the picker's precise producer dials each pod (its socketPort),
    under llm-d's topic layout; the render sidecar is where the token producer asks for token ids."""
    docs = render("overlays/inference-gateway-precise")
    c = server_container(docs)
    sets = dict(a.split("=", 1) for a in arg_values(c["args"], "--set"))
    config, _ = epp_config(docs)
    params = {p["type"]: p.get("parameters") or {} for p in config["plugins"]}
    port = params["precise-prefix-cache-producer"]["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"]
    assert sets["llm.kv_events_endpoint"] == f"tcp://*:{port}"
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["kv-events"] == port
    topic = sets["llm.kv_events_topic"]
    assert topic.startswith(params["precise-prefix-cache-producer"]["kvEventsConfig"]["topicFilter"])
    assert re.fullmatch(r"kv@\$\(POD_IP\)@[\w.-]+", topic)
    assert any(e["name"] == "POD_IP" and e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP" for e in c["env"])
    assert "kv-events" not in str([d for d in docs if d["kind"] == "Service"])  # no Service publishes it
    epp = one(docs, "Deployment", "triton-vlm-epp")["spec"]["template"]["spec"]
    render_port = {p["containerPort"] for ct in epp["containers"] if ct["name"] == "vllm-render" for p in ct["ports"]}
    url = params["token-producer"]["vllm"]["url"]
    assert url == f"http://localhost:{render_port.pop()}"
    [sidecar] = [ct for ct in epp["containers"] if ct["name"] == "vllm-render"]
    assert sidecar["args"][0] == params["token-producer"]["modelName"] == arg_values(c["args"], "--model")[0]
    from triton_vlm.engine.engine import EngineConfig

    block = params["precise-prefix-cache-producer"]["tokenProcessorConfig"]["blockSize"]
    assert block == EngineConfig().block_size  # the engine's (its events then map 1:1 onto the index's blocks)


# --- the KV-cache gauge ----------------------------------------------------------------------------------------
def test_kv_cache_usage_gauge_is_a_fraction_of_the_blocks(monkeypatch):
    from triton_vlm.triton import metrics as M

    fake = fake_llm_metrics(monkeypatch)
    fake.show()
    assert fake.value(M.KV_USAGE) == 0.0 and fake.series[M.KV_USAGE].labels == {"model": "llm"}
    fake.show(kv_blocks_used=48, kv_blocks_total=64)
    assert fake.value(M.KV_USAGE) == 0.75
    assert fake.value("triton_vlm_engine_kv_blocks_used") == 48.0


# --- images ----------------------------------------------------------------------------------------------------
def _instructions(name: str):
    return dockerfile.parse_file(str(DOCKER / f"{name}.Dockerfile"))


def _instruction(name: str, cmd: str) -> list[str]:
    [found] = [list(i.value) for i in _instructions(name) if i.cmd == cmd.upper()]
    return found


def _arg_default(name: str, arg: str) -> str:
    for i in _instructions(name):
        if i.cmd == "ARG" and i.value[0].startswith(arg + "="):
            return i.value[0].split("=", 1)[1]
    raise AssertionError(f"no ARG {arg} in {name}.Dockerfile")


@pytest.mark.parametrize("name", ["cpu", "gpu"], ids=["cpu-image", "nvidia-image"])
def test_images_install_with_the_shared_script_and_run_unprivileged(name):
    steps = _instructions(name)
    assert [i.cmd for i in steps].count("FROM") == 1
    [run] = [i for i in steps if i.cmd == "RUN" and "install.sh" in i.value[0]]
    [call] = [shlex.split(part) for part in run.value[0].split("&&") if "install.sh" in part]
    script = call[call.index("bash") + 1]
    assert script == "/opt/triton-vlm/deploy/docker/install.sh"
    [copy] = [i for i in steps if i.cmd == "COPY"]
    assert list(copy.value) == [".", "/opt/triton-vlm"]  # the checkout, so the script's path exists in the image
    assert (DOCKER / "install.sh").exists()
    assert ("--gpu" in call) == (name == "gpu")
    [user] = [i.value[0] for i in steps if i.cmd == "USER"]
    assert user in ("${UID}", "1000") and _arg_default(name, "UID") == "1000"
    exposed = {p for i in steps if i.cmd == "EXPOSE" for p in i.value}
    assert exposed == IMAGE_PORTS
    entry = _instruction(name, "ENTRYPOINT")
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry == ["triton-vlm-serve"] and scripts["triton-vlm-serve"] == "triton_vlm.server.cli:main"
    ignore = (DOCKER / f"{name}.Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv", ".cache"} <= set(ignore)  # BuildKit's per-Dockerfile ignore file


def test_gpu_image_is_on_the_triton_release_compose_names():
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    gpu = compose["services"]["triton-vlm"]
    assert gpu["build"]["dockerfile"] == "deploy/docker/gpu.Dockerfile"
    base = _arg_default("gpu", "TRITON_IMAGE")
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", base)
    assert gpu["build"]["args"]["TRITON_IMAGE"] == base
    assert compose["services"]["triton-vlm-cpu"]["build"]["dockerfile"] == "deploy/docker/cpu.Dockerfile"
    for service in compose["services"].values():
        assert (REPO_ROOT / service["build"]["dockerfile"]).exists()
        assert {p.split(":")[-1] for p in service["ports"]} == IMAGE_PORTS
        assert any(v.endswith(":/models/llava:ro") for v in service["volumes"])
        assert any(v.endswith(":/adapters:ro") for v in service["volumes"])
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_make_and_ci_install_with_the_images_script():
    """`make install` (run by `make test`, which .ci/run runs) calls the same script the Dockerfiles call, and
    the script pins the torch that pyproject.toml pins."""
    recipe = (REPO_ROOT / "Makefile").read_text().split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "deploy/docker/install.sh" in recipe and "pip install" not in recipe
    assert "make test" in (REPO_ROOT / ".ci" / "run").read_text()
    script = (DOCKER / "install.sh").read_text()
    [pinned] = re.findall(r"^TORCH_VERSION=(\S+)$", script, re.M)
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch=={pinned}" in deps
    subprocess.run(["bash", "-n", str(DOCKER / "install.sh")], check=True)


def test_image_build_step_prepares_the_server_tree(tmp_path):
    """The images' own build step (copying the tritonserver tree into the cache as the runtime user) works."""
    [run] = [i.value[0] for i in _instructions("cpu") if i.cmd == "RUN" and "prepare_server_tree" in i.value[0]]
    argv = shlex.split(run)
    assert argv[0] == "python3"
    env = {"TRITON_VLM_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, *argv[1:]], env=env, check=True, timeout=120)
    [tree] = tmp_path.glob("tritonserver-*")
    assert (tree / "bin" / "tritonserver").exists()
    assert (tree / "backends" / "python" / "triton_python_backend_stub").exists()
