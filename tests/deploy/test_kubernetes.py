"""The Kubernetes manifests (deploy/kubernetes/), checked without a cluster or kubectl.

Each kustomization is rendered as `kubectl apply -k` renders what these files use (``resources``:
files and directories; ``namespace``), every object is validated against the Kubernetes schema
(kubernetes_validate, strict: unknown fields are errors), and the environment each container gets,
resolved from the manifests as the kubelet resolves it, is checked by running ``kvtier config``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.deploy.test_compose import option

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
SHAPES = ("node", "sidecar")
KUSTOMIZATIONS = sorted(p.parent.name for p in KUBE.glob("*/kustomization.yaml"))
# 1.33: the first release with sidecar containers GA; and the newest schema the package ships.
K8S_VERSIONS = ("1.33", kubernetes_validate.utils.latest_version())
KUSTOMIZATION_KEYS = frozenset({"apiVersion", "kind", "resources", "namespace"})
CLUSTER_SCOPED = frozenset({"Namespace"})
WORKLOADS = frozenset({"Deployment", "DaemonSet", "StatefulSet"})
KVTIER_IMAGE = "kvtier:"
VLLM_IMAGE = "kvtier-vllm:"
KVTIER_UID = 10001  # the Dockerfile's kvtier user
# Values of the Secrets the manifests expect the operator to create (docs/deployment.md).
SECRETS = {("redis-auth", "password"): "0123456789abcdef0123456789abcdef"}
KV_TRANSFER_CONFIG = {
    "kv_connector": "KVTierConnector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
GIB, MIB = 1 << 30, 1 << 20
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T|)")
_QUANTITY_UNITS = {"": 1, "Ki": 1 << 10, "Mi": MIB, "Gi": GIB, "Ti": 1 << 40}
_QUANTITY_UNITS |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


# ------------------------------------------------------------------------------------------ helpers
def render(directory: Path) -> list[dict[str, Any]]:
    """The objects of a kustomization: its resources (files, or directories rendered in turn), with
    its namespace set on every namespaced object."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert spec["kind"] == "Kustomization", directory
    unknown = set(spec) - KUSTOMIZATION_KEYS
    assert not unknown, f"{directory}: this renderer does not apply {sorted(unknown)}"
    objects: list[dict[str, Any]] = []
    for entry in spec["resources"]:
        target = (directory / entry).resolve()
        assert target.exists(), f"{directory}/kustomization.yaml: no such resource {entry}"
        if target.is_dir():
            objects += render(target)
        else:
            objects += [doc for doc in yaml.safe_load_all(target.read_text()) if doc is not None]
    namespace = spec.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
    return objects


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of this kind and name."""
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


@dataclass(frozen=True)
class Box:
    """One container of a workload's pod template."""

    workload: dict[str, Any]
    container: dict[str, Any]
    init: bool

    @property
    def pod(self) -> dict[str, Any]:
        """The pod spec the container runs in."""
        spec: dict[str, Any] = self.workload["spec"]["template"]["spec"]
        return spec

    @property
    def ident(self) -> str:
        """workload kind/name/container, for messages."""
        return f"{self.workload['kind']}/{self.workload['metadata']['name']}/{self.container['name']}"

    def mount_holding(self, path: str) -> tuple[str, tuple[str, ...]]:
        """(mount path, what backs it) of the deepest mount that contains path."""
        best: tuple[str, tuple[str, ...]] | None = None
        for mount in self.container.get("volumeMounts", []):
            inside = PurePosixPath(path).is_relative_to(mount["mountPath"])
            if inside and (best is None or len(mount["mountPath"]) > len(best[0])):
                best = (mount["mountPath"], self.backing(mount["name"]))
        assert best is not None, f"{self.ident}: nothing is mounted over {path}"
        return best

    def volume(self, name: str) -> dict[str, Any]:
        """The pod's volume of this name."""
        found = [v for v in self.pod.get("volumes", []) if v["name"] == name]
        assert len(found) == 1, f"{self.ident}: no volume {name}"
        return found[0]

    def backing(self, volume_name: str) -> tuple[str, ...]:
        """What a volume is: ("hostPath", path), or ("emptyDir", pod, name, medium)."""
        volume = self.volume(volume_name)
        if "hostPath" in volume:
            return ("hostPath", volume["hostPath"]["path"])
        assert "emptyDir" in volume, f"{self.ident}: volume {volume_name} is neither hostPath nor emptyDir"
        medium = volume["emptyDir"].get("medium", "")
        return ("emptyDir", self.workload["metadata"]["name"], volume_name, medium)

    def run_as(self, field: str) -> Any:
        """A securityContext field as it applies: the container's, else the pod's."""
        own = self.container.get("securityContext", {})
        return own[field] if field in own else self.pod.get("securityContext", {}).get(field)


def boxes(objects: list[dict[str, Any]]) -> Iterator[Box]:
    """Every container (init containers too) of every workload."""
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            spec = obj["spec"]["template"]["spec"]
            for container in spec.get("initContainers", []):
                yield Box(obj, container, True)
            for container in spec["containers"]:
                yield Box(obj, container, False)


def kvtier_boxes(objects: list[dict[str, Any]]) -> list[Box]:
    """The containers that run a kvtier service."""
    found = [b for b in boxes(objects) if b.container["image"].startswith(KVTIER_IMAGE)]
    return [b for b in found if b.container.get("args") == ["serve"]]


def vllm_boxes(objects: list[dict[str, Any]]) -> list[Box]:
    """The vLLM containers."""
    return [b for b in boxes(objects) if b.container["image"].startswith(VLLM_IMAGE)]


def expand(value: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined names are replaced, $$ is a literal $, and any other
    reference stays as written."""

    def replace(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _REF.sub(replace, value)


def config_map(objects: list[dict[str, Any]], name: str) -> dict[str, str]:
    """The data of a ConfigMap of the rendered objects."""
    data: dict[str, str] = named(objects, "ConfigMap", name).get("data", {})
    return data


def container_env(box: Box, objects: list[dict[str, Any]]) -> dict[str, str]:
    """The variables the kubelet gives a container: envFrom first, then env in order."""
    env: dict[str, str] = {}
    for source in box.container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"{box.ident}: unsupported envFrom {source}"
        env.update(config_map(objects, source["configMapRef"]["name"]))
    for item in box.container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
            continue
        ref = item["valueFrom"]
        if "secretKeyRef" in ref:
            key = (ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
            assert key in SECRETS, f"{box.ident}: secret {key} is not documented"
            env[item["name"]] = SECRETS[key]
        elif "configMapKeyRef" in ref:
            data = config_map(objects, ref["configMapKeyRef"]["name"])
            env[item["name"]] = data[ref["configMapKeyRef"]["key"]]
        else:
            pytest.fail(f"{box.ident}: unsupported valueFrom {ref}")
    return env


def link_prefix(service_name: str) -> str:
    """The prefix of the service-link variables Kubernetes makes for a Service."""
    return service_name.upper().replace("-", "_")


def service_links(services: list[dict[str, Any]], first_ip: int = 1) -> dict[str, str]:
    """The variables Kubernetes injects for these Services when service links are on. Each counts
    as having a cluster IP: a headless one gets none, but a user may give it one."""
    env: dict[str, str] = {}
    for i, service in enumerate(services, start=first_ip):
        ip, prefix = f"10.0.0.{i}", link_prefix(service["metadata"]["name"])
        ports = service["spec"]["ports"]
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        env[f"{prefix}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
        for port in ports:
            proto, number = port.get("protocol", "TCP"), port["port"]
            if port.get("name"):
                env[f"{prefix}_SERVICE_PORT_{link_prefix(port['name'])}"] = str(number)
            base = f"{prefix}_PORT_{number}_{proto}"
            env[base] = f"{proto.lower()}://{ip}:{number}"
            env |= {f"{base}_PROTO": proto.lower(), f"{base}_PORT": str(number), f"{base}_ADDR": ip}
    return env


def kvtier_config(env: Mapping[str, str], home: Path) -> subprocess.CompletedProcess[str]:
    """`kvtier config --json` with exactly this environment, plus PATH and HOME."""
    script = Path(sys.executable).parent / "kvtier"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "kvtier.app.cli"]
    full = {**env, "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    return subprocess.run(
        [*argv, "config", "--json"], env=full, cwd=home, capture_output=True, text=True, timeout=60
    )


def effective(box: Box, objects: list[dict[str, Any]], home: Path) -> dict[str, Any]:
    """The settings `kvtier config` reports for a container's environment (it must accept it)."""
    result = kvtier_config(container_env(box, objects), home)
    assert result.returncode == 0, f"{box.ident}: kvtier config exit {result.returncode}\n{result.stderr}"
    values: dict[str, Any] = {k: v["value"] for k, v in json.loads(result.stdout).items()}
    return values


def quantity(text: str | int) -> int:
    """Bytes of a Kubernetes quantity (8Gi, 512Mi, 5G)."""
    match = _QUANTITY.fullmatch(str(text))
    assert match, f"not a quantity: {text!r}"
    return int(float(match[1]) * _QUANTITY_UNITS[match[2]])


def argv(container: Mapping[str, Any]) -> list[str]:
    """A container's command line: command followed by args."""
    return [str(a) for a in container.get("command", []) + container.get("args", [])]


def served_by(vllm: Box, objects: list[dict[str, Any]]) -> Box:
    """The kvtier container a vLLM container uses: its own pod's sidecar, else the node's DaemonSet."""
    own = [b for b in kvtier_boxes(objects) if b.workload is vllm.workload]
    daemons = [b for b in kvtier_boxes(objects) if b.workload["kind"] == "DaemonSet"]
    found = own or daemons
    assert len(found) == 1, f"{vllm.ident}: expected one kvtier service, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module", params=SHAPES)
def shape(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """(name, rendered objects) of each shape."""
    return request.param, render(KUBE / request.param)


# -------------------------------------------------------------------------------------------- tests
def test_both_shapes_and_their_base_are_kustomizations() -> None:
    """node/ and sidecar/ can be applied with kubectl apply -k; base/ holds what they share."""
    assert KUSTOMIZATIONS == ["base", "node", "sidecar"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_is_valid_kubernetes(name: str, version: str) -> None:
    """Every object of every kustomization passes the strict schema of this Kubernetes version."""
    objects = render(KUBE / name)
    assert objects
    ids = [(o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]) for o in objects]
    assert len(ids) == len(set(ids)), f"{name}: duplicate objects {ids}"
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} on {version}: {exc.message}")


def test_shapes_live_in_one_namespace(shape: tuple[str, list[dict[str, Any]]]) -> None:
    """Each shape creates the kvtier namespace and puts everything else in it."""
    name, objects = shape
    assert named(objects, "Namespace", "kvtier")
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"kvtier"}
    assert {o["kind"] for o in objects} >= {"ConfigMap", "Service", "Deployment", "NetworkPolicy"}, name


def test_pods_get_no_service_links_and_services_name_no_settings(
    shape: tuple[str, list[dict[str, Any]]],
) -> None:
    """enableServiceLinks is off in every pod, and no Service would inject a KVTIER_* variable other
    than the kvtier Service's own (which kvtier ignores) nor any VLLM_* (which vLLM reads)."""
    _name, objects = shape
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            assert obj["spec"]["template"]["spec"]["enableServiceLinks"] is False, obj["metadata"]["name"]
    for service in (o for o in objects if o["kind"] == "Service"):
        prefix = link_prefix(service["metadata"]["name"])
        assert prefix == "KVTIER" or not prefix.startswith("KVTIER_"), prefix
        assert prefix != "VLLM" and not prefix.startswith("VLLM_"), prefix


def test_kvtier_probes_mean_alive_and_ready_on_the_admin_port(
    shape: tuple[str, list[dict[str, Any]]],
) -> None:
    """Liveness asks /livez, startup and readiness ask /readyz, on the port kvtier's admin server
    binds. A sidecar has no readiness probe: it would take vLLM's pod out of its Services, and vLLM
    serves without kvtier."""
    name, objects = shape
    found = kvtier_boxes(objects)
    assert len(found) == 1
    for box in found:
        env = container_env(box, objects)
        admin_port = int(env["KVTIER_ADMIN_PORT"])
        assert env["KVTIER_ADMIN_HOST"] == "0.0.0.0"  # the kubelet probes the pod's IP
        ports = {p["name"]: p["containerPort"] for p in box.container["ports"]}
        probes = ["livenessProbe", "startupProbe"] + ([] if box.init else ["readinessProbe"])
        assert sorted(p for p in box.container if p.endswith("Probe")) == sorted(probes)
        assert box.init == (name == "sidecar")
        paths = {}
        for probe in probes:
            get = box.container[probe]["httpGet"]
            port = ports.get(get["port"], get["port"])
            assert port == admin_port, f"{box.ident} {probe}: port {get['port']}"
            paths[probe] = get["path"]
        expected = {"livenessProbe": "/livez", "readinessProbe": "/readyz", "startupProbe": "/readyz"}
        assert paths == {probe: expected[probe] for probe in probes}


def test_sidecar_is_a_native_sidecar_started_before_vllm() -> None:
    """In the sidecar shape kvtier is an init container that keeps running (restartPolicy Always)."""
    objects = render(KUBE / "sidecar")
    (box,) = kvtier_boxes(objects)
    assert box.init and box.container["restartPolicy"] == "Always"
    (vllm,) = vllm_boxes(objects)
    assert vllm.workload is box.workload and not vllm.init


def test_vllm_runs_the_kvtier_connector(shape: tuple[str, list[dict[str, Any]]]) -> None:
    """vLLM is started as `vllm serve MODEL --kv-transfer-config JSON` naming KVTierConnector."""
    _name, objects = shape
    found = vllm_boxes(objects)
    assert len(found) == 1
    for box in found:
        args = argv(box.container)
        assert args[:2] == ["vllm", "serve"] and not args[2].startswith("-"), args
        raw = option(args, "--kv-transfer-config")
        assert raw is not None, f"{box.ident}: no --kv-transfer-config"
        assert json.loads(raw) == KV_TRANSFER_CONFIG


def test_kvtier_config_accepts_every_containers_environment(
    shape: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """kvtier config exits 0 with the environment of each container that has kvtier settings, and
    the service and its vLLM agree on the socket, the arena directory and the chunk size."""
    _name, objects = shape
    for vllm in vllm_boxes(objects):
        service = served_by(vllm, objects)
        client, server = effective(vllm, objects, tmp_path), effective(service, objects, tmp_path)
        for key in ("service_url", "shm_dir", "chunk_size"):
            assert client[key] == server[key], key
        assert server["service_url"] == "unix:///run/kvtier/kvtier.sock"
        assert server["redis_url"] == "redis://:***@redis:6379/0"
        assert server["admin_port"] == 9400 and server["disk_path"] == "/var/lib/kvtier/disk"


def test_kvtier_config_ignores_service_link_variables(
    shape: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """With the variables Kubernetes injects for this shape's Services, and for a Service named
    kvtier with a cluster IP, added to each container's environment, kvtier config still exits 0."""
    _name, objects = shape
    services = [o for o in objects if o["kind"] == "Service"]
    example = {"metadata": {"name": "kvtier"}, "spec": {"ports": [{"name": "admin", "port": 8080}]}}
    links = service_links(services) | service_links([example], first_ip=100)
    assert links["KVTIER_SERVICE_HOST"] == "10.0.0.100" and links["KVTIER_PORT"] == "tcp://10.0.0.100:8080"
    for box in [*kvtier_boxes(objects), *vllm_boxes(objects)]:
        env = {**links, **container_env(box, objects)}
        result = kvtier_config(env, tmp_path)
        assert result.returncode == 0, f"{box.ident}: kvtier config exit {result.returncode}\n{result.stderr}"


def test_socket_and_arena_are_one_tmpfs_directory_shared_at_one_path(
    shape: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """vLLM sees kvtier's socket and arena at the same paths, on the same tmpfs volume."""
    name, objects = shape
    for vllm in vllm_boxes(objects):
        service = served_by(vllm, objects)
        settings = effective(service, objects, tmp_path)
        socket_dir = str(PurePosixPath(urlsplit(settings["service_url"]).path).parent)
        for path in (socket_dir, settings["shm_dir"]):
            mounted, backing = service.mount_holding(path)
            assert vllm.mount_holding(path) == (mounted, backing), path
            if backing[0] == "hostPath":
                assert name == "node" and PurePosixPath(backing[1]).is_relative_to("/dev/shm"), backing
            else:
                assert name == "sidecar" and backing[3] == "Memory", backing
        service.mount_holding(settings["disk_path"])


def test_memory_limits_and_tmpfs_hold_the_arena(
    shape: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The arena is charged to kvtier's container: its memory limit (= request) exceeds cpu_size by
    1 GiB or more; a memory emptyDir holding it is 512 MiB or more above it, a disk one above disk_size."""
    _name, objects = shape
    for box in kvtier_boxes(objects):
        settings = effective(box, objects, tmp_path)
        resources = box.container["resources"]
        limit = quantity(resources["limits"]["memory"])
        assert quantity(resources["requests"]["memory"]) == limit, box.ident
        assert limit >= settings["cpu_size"] + GIB, (box.ident, limit, settings["cpu_size"])
        for path, size, margin in (
            (settings["shm_dir"], settings["cpu_size"], 512 * MIB),
            (settings["disk_path"], settings["disk_size"], 1),
        ):
            _mounted, backing = box.mount_holding(path)
            if backing[0] == "emptyDir":
                volume = box.volume(backing[2])["emptyDir"]
                assert quantity(volume["sizeLimit"]) >= size + margin, (box.ident, path, volume)


def test_kvtier_reaches_redis_and_redis_is_a_cache(
    shape: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """redis_url names the Redis Service and its port, the network policy lets kvtier pods in, and
    Redis runs with maxmemory, LRU eviction and no persistence within its memory limit."""
    _name, objects = shape
    service = named(objects, "Service", "redis")
    redis = named(objects, "Deployment", "redis")
    policy = named(objects, "NetworkPolicy", "redis")
    for box in kvtier_boxes(objects):
        url = urlsplit(container_env(box, objects)["KVTIER_REDIS_URL"])
        assert url.password == SECRETS[("redis-auth", "password")]
        assert (url.hostname, url.port) == ("redis", service["spec"]["ports"][0]["port"])
        allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        assert allowed.items() <= box.workload["spec"]["template"]["metadata"]["labels"].items()
    labels = redis["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    script = " ".join(argv(container))
    needed = ("--save ''", "--appendonly no", "--maxmemory-policy allkeys-lru", "requirepass $REDIS_PASSWORD")
    assert [n for n in needed if n not in script] == []
    maxmemory = re.search(r"--maxmemory (\d+)gb", script)
    assert maxmemory, script
    assert quantity(container["resources"]["limits"]["memory"]) > int(maxmemory[1]) * GIB


def test_selectors_and_named_ports_match(shape: tuple[str, list[dict[str, Any]]]) -> None:
    """Each workload selects its own pods; each Service selects pods that have its target port."""
    _name, objects = shape
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    for obj in workloads:
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items(), obj["metadata"]["name"]
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        pods = [w for w in workloads if selector <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {service['metadata']['name']} selects no pods"
        names = {p["name"] for b in boxes(pods) for p in b.container.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, (service["metadata"]["name"], port)


def test_containers_are_locked_down(shape: tuple[str, list[dict[str, Any]]]) -> None:
    """No privilege escalation, every capability dropped, non-root, RuntimeDefault seccomp; only the
    node shape's directory preparation runs as root, with CHOWN and FOWNER alone. kvtier and vLLM
    share the kvtier image's uid, since the socket and the arena are owner-only."""
    name, objects = shape
    for box in boxes(objects):
        context = box.container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, box.ident
        assert context["capabilities"]["drop"] == ["ALL"], box.ident
        assert box.pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", box.ident
        if box.container["name"] == "prepare-host-dirs":
            assert name == "node" and box.run_as("runAsUser") == 0
            assert set(context["capabilities"]["add"]) == {"CHOWN", "FOWNER"}
        else:
            assert box.run_as("runAsNonRoot") is True and "add" not in context["capabilities"], box.ident
            assert box.run_as("runAsUser") != 0, box.ident
    uids = {box.run_as("runAsUser") for box in [*kvtier_boxes(objects), *vllm_boxes(objects)]}
    assert uids == {KVTIER_UID}
    assert f"--uid {KVTIER_UID}" in (REPO / "Dockerfile").read_text()
    if name == "sidecar":  # the restricted Pod Security level allows no hostPath
        assert not [v for b in boxes(objects) for v in b.pod.get("volumes", []) if "hostPath" in v]
