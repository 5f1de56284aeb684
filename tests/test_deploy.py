"""deploy/: the Kustomize manifests render and validate, and what they point at exists on real servers.

Two replicas run locally (no Kubernetes) exactly as a pod lays them out: the init container's model repository
(config.pbtxt, version 1, the CPU overlay's engine settings as its engine.json), tritonserver and the OpenAI
frontend. Their probes, the endpoint picker's metric specs (read on the pool's target port, the frontend's
/metrics), the prometheus-adapter rules and the KV events ports of the manifests are checked against them.

The endpoint picker's configuration is checked field by field against what the pinned picker release accepts
(deploy/overlays/gateway/picker-release.yaml, written from that release's Go structs).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import kubernetes_validate
import pytest
import requests
import yaml
import zmq
from prometheus_client.parser import text_string_to_metric_families
from triton_server import free_port, free_ports, start_server, stop_server
from vllm_kv_schema import decode_positional, local, receive_all, replay

from serve.launch import DEFAULT_MODEL_REPOSITORY

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
OVERLAYS = ["base", "overlays/cpu", "overlays/gateway"]
PICKER_RELEASE = yaml.safe_load((DEPLOY / "overlays" / "gateway" / "picker-release.yaml").read_text())
K8S_VERSION = "1.32.0"
CUSTOM_KINDS = {"InferencePool", "HTTPRoute", "PodMonitor"}
# The endpoint picker's built-in metric specs per engine type (llm-d router,
# pkg/epp/framework/plugins/datalayer/extractor/metrics/factories.go), which the model-server protocol names
# (gateway-api-inference-extension docs/proposals/003-model-server-protocol). The pods are labelled "vllm" and
# scraped on the frontend's port; Triton's port still serves the TensorRT-LLM names.
PICKER_SPECS = {
    "triton-tensorrt-llm": {
        "queue": ("nv_trt_llm_request_metrics", {"request_type": "waiting"}),
        "running": ("nv_trt_llm_request_metrics", {"request_type": "scheduled"}),
        "kv_usage": ("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "fraction"}),
        "block_size": ("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "tokens_per"}),
        "num_blocks": ("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "max"}),
    },
    "vllm": {
        "queue": ("vllm:num_requests_waiting", {}),
        "running": ("vllm:num_requests_running", {}),
        "kv_usage": ("vllm:kv_cache_usage_perc", {}),
        "cache_info": ("vllm:cache_config_info", {}),
    },
}


def render(overlay: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY / overlay)], check=True, capture_output=True,
                         text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def port(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def engine_settings(docs: list[dict]) -> dict:
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("triton-llm-engine"))
    return json.loads(config_map["data"]["engine.json"])


def picker_config(docs: list[dict]) -> dict:
    config_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("triton-llm-epp"))
    return yaml.safe_load(config_map["data"]["epp-config.yaml"])


def adapter_rules() -> list[dict]:
    return yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]


def parse_selector(query: str) -> tuple[str, dict[str, str]]:
    """``name{a="x",b!=""}`` -> (name, the equality matchers)."""
    name, _, rest = query.partition("{")
    return name, dict(re.findall(r'(\w+)="([^"]*)"', rest))


# -- rendering and static checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_its_built_in_kinds_validate(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler", "PodMonitor", "PodDisruptionBudget",
            "NetworkPolicy"} <= kinds
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any schema error
    gpu = container(one(docs, "Deployment", "triton-llm"), "triton")["resources"]["limits"].get("nvidia.com/gpu")
    settings = engine_settings(docs)
    if overlay == "overlays/cpu":
        assert gpu is None and settings["device"] == "cpu"
    else:
        assert gpu == 1 and settings["device"] == "cuda"


def test_termination_grace_period_covers_prestop_drain_and_triton_exit_timeout():
    from serve.launch import EXIT_TIMEOUT_S

    docs = render("base")
    deployment = one(docs, "Deployment", "triton-llm")
    triton = container(deployment, "triton")
    drain_timeout = int(next(e["value"] for e in triton["env"] if e["name"] == "DRAIN_TIMEOUT_S"))
    assert "--drain-timeout-secs=$(DRAIN_TIMEOUT_S)" in triton["args"]
    assert float(engine_settings(docs)["drain_grace_s"]) < drain_timeout  # the engine's grace ends first
    prestop = {int(c["lifecycle"]["preStop"]["exec"]["command"][1])
               for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert (deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            == max(prestop) + drain_timeout + EXIT_TIMEOUT_S + 5)


def test_custom_resources_have_their_required_fields_and_point_at_real_ports():
    docs = render("overlays/gateway")
    deployment = one(docs, "Deployment", "triton-llm")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["llm-d.ai/engine-type"] in PICKER_SPECS
    openai, triton = container(deployment, "openai"), container(deployment, "triton")
    # InferencePool v1: spec.selector.matchLabels and spec.targetPorts (1-8, each a number) are required;
    # endpointPickerRef needs a name (and a port when its kind is Service).
    pool = one(docs, "InferencePool")["spec"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    assert 1 <= len(pool["targetPorts"]) <= 8 and [p["number"] for p in pool["targetPorts"]] == [port(openai, "openai")]
    epp_service = one(docs, "Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"].get("kind", "Service") == "Service"
    assert pool["endpointPickerRef"]["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    assert pool["endpointPickerRef"]["failureMode"] in ("FailOpen", "FailClose")
    epp = one(docs, "Deployment", "triton-llm-epp")
    assert epp_service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    assert f"--pool-name={one(docs, 'InferencePool')['metadata']['name']}" in container(epp, "epp")["args"]
    # HTTPRoute: parentRefs and a backendRef to the pool.
    route = one(docs, "HTTPRoute")["spec"]
    assert route["parentRefs"] and route["parentRefs"][0]["name"]
    backends = [b for rule in route["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "triton-llm"}]
    # Clients' routes only: the render endpoints answer without the key here (--open-render), so the Gateway
    # must not reach them (nor /tokenize, /docs, ...).
    paths = {(m["path"]["type"], m["path"]["value"]) for rule in route["rules"] for m in rule["matches"]}
    assert paths == {("Exact", "/v1/completions"), ("Exact", "/v1/chat/completions"), ("Exact", "/v1/responses"),
                     ("PathPrefix", "/v1/models")}
    # PodMonitor: selects the pods, scrapes the frontend's port (vLLM names) and Triton's (its vllm:* dropped there).
    monitor = one(docs, "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    endpoints = {e["port"]: e for e in monitor["podMetricsEndpoints"]}
    assert set(endpoints) == {"openai", "metrics"} and port(openai, "openai") and port(triton, "metrics")
    assert endpoints["metrics"]["metricRelabelings"] == [
        {"sourceLabels": ["__name__"], "regex": "vllm:.*", "action": "drop"}]
    # The picker's configuration: every reference resolves, and its ports and block size are the server's.
    config = picker_config(docs)
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    refs += [s["pluginRef"] for s in config["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in config["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= set(plugins)
    assert {"prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"} <= set(refs)
    # The picker scrapes the pool's target port (the frontend) at the data source's path, with the vLLM specs.
    assert plugins["metrics-data-source"]["parameters"]["path"] == "/metrics"
    assert "--triton-metrics-url=http://localhost:8002/metrics" in openai["args"]
    assert pod_labels["llm-d.ai/engine-type"] == "vllm"
    assert plugins["core-metrics-extractor"]["parameters"]["defaultEngine"] == pod_labels["llm-d.ai/engine-type"]
    kv = plugins["precise-prefix-cache-producer"]["parameters"]
    discovery = kv["kvEventsConfig"]["podDiscoveryConfig"]
    assert discovery["socketPort"] == port(triton, "kv-events")
    settings = engine_settings(docs)
    assert settings["kv_events_endpoint"] == f"tcp://*:{discovery['socketPort']}"
    assert settings["kv_events_replay_endpoint"] == f"tcp://*:{port(triton, 'kv-replay')}"
    assert settings["kv_events_topic"].startswith(kv["kvEventsConfig"]["topicFilter"])
    assert settings["kv_events_encoding"] == PICKER_RELEASE["kvEventsEncoding"]  # the layout the picker decodes
    config_pbtxt = (DEFAULT_MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()
    block_size = int(re.search(r'key: "block_size" value: \{ string_value: "(\d+)"', config_pbtxt).group(1))
    assert kv["tokenProcessorConfig"]["blockSizeTokens"] == settings.get("block_size", block_size)
    service = one(docs, "Service", "triton-llm")
    assert plugins["token-producer"]["parameters"]["vllm"]["url"] == f"http://triton-llm:{port(openai, 'openai')}"
    assert plugins["token-producer"]["parameters"]["modelName"] == "llm"  # the name the OpenAI API serves
    # The token producer sends no API key (its release has no field for one): the render routes are open there,
    # and only there.
    assert "--open-render" in openai["args"] and set(PICKER_RELEASE["parameters"]["token-producer"]["vllm"]) == {
        "url", "timeout", "mmTimeout"}
    for overlay in ("base", "overlays/cpu"):
        other = render(overlay)
        triton_there = container(one(other, "Deployment", "triton-llm"), "triton")
        assert "--open-render" not in container(one(other, "Deployment", "triton-llm"), "openai")["args"]
        # KV events carry every cached prompt's token ids: published only where the picker reads them.
        assert not any(key.startswith("kv_events") for key in engine_settings(other))
        assert {p["containerPort"] for p in triton_there["ports"]} == {8000, 8001, 8002}
    assert port(openai, "openai") in [p["port"] for p in service["spec"]["ports"]]


def test_autoscaler_reads_the_metrics_the_adapter_rules_publish():
    docs = render("base")
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    names = {m["pods"]["metric"]["name"] for m in hpa["metrics"]}
    assert names == {rule["name"]["as"] for rule in adapter_rules()}
    assert "llm_requests_waiting" in names  # the pool's queue, per replica
    assert hpa["scaleTargetRef"]["name"] == "triton-llm"
    assert "replicas" not in one(docs, "Deployment", "triton-llm")["spec"]  # the autoscaler owns the count


# -- the endpoint picker's configuration against its pinned release -------------------------------------------
SCALARS = {
    "string": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "quantity": lambda v: isinstance(v, (str, int)) and not isinstance(v, bool),
    "duration": lambda v: isinstance(v, str) and re.fullmatch(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+", v) is not None,
}


def unknown_fields(value, schema, path: str, plugin_type: str | None = None) -> list[str]:
    """Every place where ``value`` leaves ``schema`` (picker-release.yaml's notation), as "path: why"."""
    if schema == "opaque":
        return [f"{path}: a field whose type the pinned release's schema does not spell out"]
    if schema == "plugin-parameters":
        known = PICKER_RELEASE["parameters"]
        if plugin_type not in known:
            return [f"{path}: plugin type {plugin_type!r} is not in the pinned release"]
        return unknown_fields(value, known[plugin_type], path)
    if isinstance(schema, str):
        return [] if SCALARS[schema](value) else [f"{path}: {value!r} is not a {schema}"]
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{path}: not a list"]
        return [e for i, item in enumerate(value) for e in unknown_fields(item, schema[0], f"{path}[{i}]", plugin_type)]
    if not isinstance(value, dict):
        return [f"{path}: not an object"]
    errors = [f"{path}.{key}: unknown to {PICKER_RELEASE['release']}" for key in value if key not in schema]
    if schema.get("parameters") == "plugin-parameters" and value.get("type") not in PICKER_RELEASE["parameters"]:
        errors.append(f"{path}.type: plugin type {value.get('type')!r} is not in the pinned release")
    for key, item in value.items():
        if key in schema:
            kind = value.get("type") if schema[key] == "plugin-parameters" else plugin_type
            errors += unknown_fields(item, schema[key], f"{path}.{key}", kind)
    return errors


def test_picker_config_has_only_fields_the_pinned_release_knows_with_their_types():
    docs = render("overlays/gateway")
    config = picker_config(docs)
    assert unknown_fields(config, PICKER_RELEASE["config"], "config") == []
    assert config["apiVersion"] in PICKER_RELEASE["apiVersions"] and config["kind"] == PICKER_RELEASE["kind"]
    assert {p["type"] for p in config["plugins"]} <= set(PICKER_RELEASE["parameters"])
    # The image is the release whose fields these are; its probes ask health services it serves.
    epp = container(one(docs, "Deployment", "triton-llm-epp"), "epp")
    assert epp["image"] == PICKER_RELEASE["image"] and epp["image"].endswith(":" + PICKER_RELEASE["release"])
    assert {epp[p]["grpc"]["service"] for p in ("livenessProbe", "readinessProbe")} <= set(PICKER_RELEASE["healthServices"])


@pytest.mark.parametrize("bad, message", [
    ({"plugins": [{"type": "metrics-data-source", "parameters": {"port": 8002}}]}, "parameters.port: unknown"),
    ({"plugins": [{"type": "precise-prefix-cache-producer",
                   "parameters": {"kvEventsConfig": {"podDiscoveryConfig": {"replaySocketPort": 5558}}}}]},
     "replaySocketPort: unknown"),
    ({"plugins": [{"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": "2"}}]}, "is not a int"),
    ({"plugins": [{"type": "no-such-plugin"}]}, "is not in the pinned release"),
    ({"schedulingProfiles": [{"name": "x", "plugins": [{"pluginRef": "a", "weight": True}]}]}, "is not a float"),
    ({"plugins": [{"type": "token-producer", "parameters": {"estimate": {}}}]}, "does not spell out"),
])
def test_picker_schema_check_refuses_drift(bad, message):
    errors = unknown_fields(bad, PICKER_RELEASE["config"], "config")
    assert any(message in e for e in errors), errors


# -- locked-down pods ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_locked_down_and_take_their_keys_from_secrets(overlay):
    docs = render(overlay)
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            if c["name"] != "model-repository":
                assert "/tmp" in mounts, c["name"]
    deployment = one(docs, "Deployment", "triton-llm")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 1000
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["cache"] and "emptyDir" in volumes["tmp"]
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for c in pod["containers"] for e in c.get("env", [])
               if "secretKeyRef" in e.get("valueFrom", {})}
    assert secrets == {"LLM_API_KEY": {"name": "triton-llm-api-key", "key": "api-key"},
                       "TRITON_ADMIN_KEY": {"name": "triton-llm-admin-key", "key": "admin-key"}}
    assert not any("value" in e and "KEY" in e["name"] for c in pod["containers"] for e in c.get("env", []))
    budget = one(docs, "PodDisruptionBudget")["spec"]
    assert budget["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_network_policies_admit_only_the_gateway_the_picker_and_prometheus():
    docs = render("overlays/gateway")
    pod_labels = one(docs, "Deployment", "triton-llm")["spec"]["template"]["metadata"]["labels"]
    epp_labels = one(docs, "Deployment", "triton-llm-epp")["spec"]["template"]["metadata"]["labels"]
    gateway = (("gateway.networking.k8s.io/gateway-name", "inference-gateway"),)
    prometheus = (("app.kubernetes.io/name", "prometheus"),)
    admitted = {"triton-llm": {}, "triton-llm-epp": {}}  # pods -> who -> ports
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        spec = policy["spec"]
        target = spec["podSelector"]["matchLabels"]["app"]
        labels = pod_labels if target == "triton-llm" else epp_labels
        assert spec["podSelector"]["matchLabels"].items() <= labels.items() and spec["policyTypes"] == ["Ingress"]
        for rule in spec["ingress"]:
            assert rule["from"], "a rule without sources admits everyone"
            for source in rule["from"]:
                assert "ipBlock" not in source and source["podSelector"]["matchLabels"]
                who = tuple(sorted(source["podSelector"]["matchLabels"].items()))
                admitted[target].setdefault(who, set()).update(p["port"] for p in rule["ports"])
    assert admitted["triton-llm"] == {gateway: {9000}, prometheus: {9000, 8002},
                                      tuple(sorted(epp_labels.items())): {9000, 5557, 5558}}
    assert admitted["triton-llm-epp"] == {gateway: {9002}, prometheus: {9090}}
    route = one(docs, "HTTPRoute")["spec"]
    assert route["parentRefs"][0]["name"] == "inference-gateway"
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {"triton-llm"}  # one namespace, created with the restricted Pod Security Standard
    assert one(docs, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# -- two replicas, as the pods run them -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two replicas on the CPU overlay's engine settings (their KV events ports moved to free ones; the second
    with max_num_seqs 2 so that requests wait), each with the OpenAI frontend."""
    docs = render("overlays/cpu")
    gateway_settings = engine_settings(render("overlays/gateway"))
    deployment = one(docs, "Deployment", "triton-llm")
    started = []
    for index in range(2):
        root = tmp_path_factory.mktemp(f"replica{index}")
        repository = root / "models"
        (repository / "llm" / "1").mkdir(parents=True)  # what the init container does
        shutil.copy(DEFAULT_MODEL_REPOSITORY / "llm" / "config.pbtxt", repository / "llm" / "config.pbtxt")
        shutil.copy(DEFAULT_MODEL_REPOSITORY / "llm" / "1" / "model.py", repository / "llm" / "1" / "model.py")
        # The CPU overlay's settings with the gateway overlay's KV events, as an operator combining the two.
        settings = {**engine_settings(docs), **{key: value for key, value in gateway_settings.items()
                                                if key.startswith("kv_events")}}
        events, replay_port = free_ports(2)
        settings["kv_events_endpoint"] = settings["kv_events_endpoint"].replace(":5557", f":{events}")
        settings["kv_events_replay_endpoint"] = settings["kv_events_replay_endpoint"].replace(":5558", f":{replay_port}")
        if index == 1:
            settings["max_num_seqs"] = 2
        (repository / "llm" / "1" / "engine.json").write_text(json.dumps(settings))
        started.append({"root": root, "repository": repository, "settings": settings,
                        "events": f"tcp://127.0.0.1:{events}", "replay": f"tcp://127.0.0.1:{replay_port}"})
    threads = [threading.Thread(target=lambda r=r: r.update(server=_start(r))) for r in started]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        for replica in started:
            if "server" not in replica:
                raise RuntimeError("a replica did not start")
            openai_port = free_port()
            replica["openai"] = subprocess.Popen(
                [sys.executable, "-m", "openai_frontend", "--port", str(openai_port), "--host", "127.0.0.1",
                 "--triton-url", replica["server"].grpc_url, "--model-repository", str(replica["repository"]),
                 "--triton-metrics-url", replica["server"].metrics_url],
                stdout=open(replica["root"] / "openai.log", "wb"), stderr=subprocess.STDOUT)
            replica["openai_url"] = f"http://127.0.0.1:{openai_port}"
        for replica in started:
            deadline = time.monotonic() + 120
            while not _ok(f"{replica['openai_url']}/health"):
                assert time.monotonic() < deadline and replica["openai"].poll() is None, \
                    (replica["root"] / "openai.log").read_text()[-3000:]
                time.sleep(0.5)
        yield deployment, started
    finally:
        for replica in started:
            if "openai" in replica:
                replica["openai"].terminate()
                replica["openai"].wait(30)
        stopping = [threading.Thread(target=stop_server, args=(r["server"],)) for r in started if "server" in r]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()


def _start(replica: dict):
    # A short drain: nothing is in flight when the test stops them (the pod's is DRAIN_TIMEOUT_S).
    return start_server(replica["root"] / "tritonserver.log", model_repository=replica["repository"],
                        env={"POD_IP": "127.0.0.1"}, extra_args=["--exit-timeout-secs=5"])


def _ok(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def scrape(replica: dict, frontend: bool = False) -> list:
    """Triton's metrics page, or with ``frontend`` the OpenAI frontend's /metrics (the pool's target port)."""
    url = f"{replica['openai_url']}/metrics" if frontend else replica["server"].metrics_url
    text = requests.get(url, timeout=5).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def matching(samples: list, name: str, labels: dict[str, str]) -> list:
    return [s for s in samples if s.name == name and labels.items() <= s.labels.items()]


def picker_values(replica: dict, engine: str) -> dict[str, float]:
    """What the picker reads for ``engine``: each spec must match exactly one series (else it would pick one).
    The vLLM names are read where the picker reads them, on the frontend's port; the TensorRT-LLM ones on Triton's."""
    samples = scrape(replica, frontend=engine == "vllm")
    values = {}
    for key, (name, labels) in PICKER_SPECS[engine].items():
        found = matching(samples, name, labels)
        assert len(found) == 1, f"{name}{labels}: {len(found)} series"
        values[key] = found[0].value if key != "cache_info" else found[0].labels
    return values


@pytest.mark.slow  # two real replicas: minutes
def test_two_replicas_both_answer_through_the_openai_frontend(replicas):
    from openai import OpenAI

    _, started = replicas
    for replica in started:
        client = OpenAI(base_url=f"{replica['openai_url']}/v1", api_key="unused")
        text = client.completions.create(model="llm", prompt="The capital of France is", max_tokens=4, temperature=0)
        assert text.choices[0].text and text.usage.completion_tokens == 4
        chat = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Hi!"}],
                                              max_completion_tokens=4, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 4
        # The render endpoints the picker's token producer calls give the engine's own prompt token count.
        body = {"model": "llm", "prompt": "The capital of France is"}
        rendered = requests.post(f"{replica['openai_url']}/v1/completions/render", json=body).json()
        assert len(rendered) == 1 and len(rendered[0]["token_ids"]) == text.usage.prompt_tokens
        body = {"model": "llm", "messages": [{"role": "user", "content": "Hi!"}]}
        rendered = requests.post(f"{replica['openai_url']}/v1/chat/completions/render", json=body).json()
        assert len(rendered["token_ids"]) == chat.usage.prompt_tokens


@pytest.mark.slow  # two real replicas: minutes
def test_probe_paths_answer_on_the_ports_they_name(replicas):
    deployment, started = replicas
    local_ports = {"http": lambda r: r["server"].http_url, "openai": lambda r: r["openai_url"]}
    probes = [(c["name"], kind, c[kind]) for c in deployment["spec"]["template"]["spec"]["containers"]
              for kind in ("startupProbe", "livenessProbe", "readinessProbe") if kind in c]
    assert {(name, kind) for name, kind, _ in probes} >= {("triton", "readinessProbe"), ("triton", "livenessProbe")}
    readiness = next(p for name, kind, p in probes if (name, kind) == ("triton", "readinessProbe"))
    assert readiness["httpGet"]["path"] == "/v2/models/llm/ready"  # the model's readiness, not the server's
    for replica in started:
        for name, kind, probe in probes:
            if "httpGet" in probe:
                url = local_ports[probe["httpGet"]["port"]](replica) + probe["httpGet"]["path"]
                assert requests.get(url, timeout=5).status_code == 200, (name, kind, url)


def wait_idle(replica: dict, timeout: float = 10.0) -> dict[str, float]:
    """The picker's values once waiting, running and KV usage all read 0 (asserts they do within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        now = picker_values(replica, "triton-tensorrt-llm")
        if now["queue"] == now["running"] == now["kv_usage"] == 0:
            return now
        assert time.monotonic() < deadline, now
        time.sleep(0.2)


@pytest.mark.slow  # two real replicas: minutes
def test_picker_and_adapter_metrics_exist_once_per_pod_and_follow_the_load(replicas):
    _, started = replicas
    busy = started[1]  # max_num_seqs 2: five requests make three wait
    idle = wait_idle(busy)  # the other tests' requests may have just ended (metrics follow within ~200 ms)
    settings_block = json.loads((busy["repository"] / "llm" / "1" / "engine.json").read_text()).get("block_size", 16)
    assert idle["block_size"] == settings_block and idle["num_blocks"] > 0
    vllm = picker_values(busy, "vllm")
    assert vllm["queue"] == vllm["running"] == vllm["kv_usage"] == 0
    assert vllm["cache_info"]["block_size"] == str(settings_block)
    assert vllm["cache_info"]["num_gpu_blocks"] == str(int(idle["num_blocks"]))
    for rule in adapter_rules():  # Prometheus scrapes them from the frontend's port too
        name, labels = parse_selector(rule["seriesQuery"])
        assert len(matching(scrape(busy, frontend=True), name, labels)) == 1, rule["seriesQuery"]

    def generate(i: int) -> None:
        requests.post(f"{busy['openai_url']}/v1/completions", timeout=300,
                      json={"model": "llm", "prompt": f"Write a long story number {i}.", "max_tokens": 96,
                            "temperature": 0, "ignore_eos": True})

    # Long enough that two run together through several of the model's metric updates (at most every 0.2 s) on a
    # fast machine too: with 16 tokens each, a pair ran together for less than one update.
    workers = [threading.Thread(target=generate, args=(i,)) for i in range(5)]
    for worker in workers:
        worker.start()
    peak = {"queue": 0.0, "running": 0.0, "kv_usage": 0.0}
    peak_vllm = dict(peak)
    while any(w.is_alive() for w in workers):
        for key, value in picker_values(busy, "triton-tensorrt-llm").items():
            if key in peak:
                peak[key] = max(peak[key], value)
        for key, value in picker_values(busy, "vllm").items():
            if key in peak_vllm:
                peak_vllm[key] = max(peak_vllm[key], value)
        time.sleep(0.1)
    for worker in workers:
        worker.join()
    assert peak["queue"] >= 1 and peak["running"] == 2 and 0 < peak["kv_usage"] <= 1, peak
    assert peak_vllm["queue"] >= 1 and peak_vllm["running"] == 2 and 0 < peak_vllm["kv_usage"] <= 1, peak_vllm
    wait_idle(busy)  # back to idle once the model has published its last stats


def histogram(samples: list, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram's single series."""
    count = [s.value for s in samples if s.name == f"{name}_count"]
    total = [s.value for s in samples if s.name == f"{name}_sum"]
    assert len(count) == len(total) == 1, name
    return count[0], total[0]


@pytest.mark.slow  # two real replicas: minutes
def test_frontend_metrics_measure_each_request_under_vllm_names(replicas):
    _, started = replicas
    replica = started[0]
    names = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds")
    before = scrape(replica, frontend=True)
    counts = {name: histogram(before, name)[0] if matching(before, f"{name}_count", {}) else 0.0 for name in names}
    success = sum(s.value for s in matching(before, "vllm:request_success_total", {"finished_reason": "length"}))
    generated = sum(s.value for s in matching(before, "vllm:generation_tokens_total", {}))
    body = {"model": "llm", "prompt": "Count to ten:", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for stream in (False, True):
        response = requests.post(f"{replica['openai_url']}/v1/completions", json={**body, "stream": stream}, timeout=120)
        assert response.status_code == 200
    after = scrape(replica, frontend=True)
    assert all(s.labels["model_name"] == "llm" for s in after if s.name.startswith("vllm:time_to_first_token"))
    assert histogram(after, names[0])[0] - counts[names[0]] == 2  # one first token per request
    assert histogram(after, names[1])[0] - counts[names[1]] == 2 * 5  # each later token once
    assert histogram(after, names[2])[0] - counts[names[2]] == 2
    assert 0 < histogram(after, names[0])[1] <= histogram(after, names[2])[1]
    assert sum(s.value for s in matching(after, "vllm:request_success_total", {"finished_reason": "length"})) - success == 2
    assert sum(s.value for s in matching(after, "vllm:generation_tokens_total", {})) - generated == 12
    # The engine's gauges come through from Triton's port, one series each; the frontend says it read them.
    assert [s.value for s in after if s.name == "llm_frontend_engine_metrics_up"] == [1.0]
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert len(matching(after, name, {})) == 1, name


@pytest.mark.slow  # two real replicas: minutes
def test_a_replica_publishes_kv_events_a_router_can_decode(replicas):
    _, started = replicas
    replica = started[0]
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    subscriber.connect(replica["events"])
    time.sleep(0.5)
    try:
        prompt = "A shared system prompt about the rivers of Europe and their deltas. " * 4
        for question in ("Which of these rivers is the longest, and how long is it in kilometres?",
                         "Which of these rivers is the widest at its mouth, and what makes it so wide?"):
            requests.post(f"{replica['openai_url']}/v1/completions", timeout=120,
                          json={"model": "llm", "prompt": prompt + question, "max_tokens": 2, "temperature": 0})
        messages = receive_all(subscriber, idle_s=1.0)
    finally:
        subscriber.close(linger=0)
    assert messages and {m[0] for m in messages} == {b"kv@127.0.0.1:9000@llm"}  # ${POD_IP} expanded
    stored = [e for _, _, payload in messages for e in decode_positional(payload) if e[0] == "BlockStored"]
    assert len(stored) >= 2 and stored[0][2] is None  # the first prompt's blocks, then the second's
    assert all(len(e[3]) == 16 * len(e[1]) for e in stored)  # the picker's layout, by position
    first_sequence = int.from_bytes(messages[0][1], "big")
    assert [m[1:] for m in replay(local(replica["replay"]), first_sequence)] == [m[1:] for m in messages]
