"""The documentation works as written: shell blocks run, links resolve, the reference is current.

Conventions (docs/contributing.md): fenced ```bash blocks run and must exit 0; ```bash expect-fail
blocks must exit non-zero; ```bash no-run blocks are shown only. Each runs with `bash -euo pipefail`
in an empty temp dir, with the repository's .venv/bin first on PATH and no KVTIER_* inherited.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.skips import missing

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
DASHBOARD = REPO / "deploy" / "grafana-dashboard.json"
REQUIRED_DOCS = ("quickstart", "configuration", "deployment", "operations", "troubleshooting")
BLOCK_TIMEOUT_S = 60
RUN_FLAGS = frozenset({"no-run", "expect-fail"})
# Shell spellings that would escape the runner: write ```bash (with a flag when it must not run).
FORBIDDEN_LANGS = frozenset({"sh", "shell", "zsh", "console-run"})

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_KVTIER_METRIC = re.compile(r"(?<![\w:])kvtier_[a-z_]+(?![\w-])")
_VLLM_METRIC = re.compile(r"(?<![\w-])vllm:[a-z_]+")  # not an image name such as kvtier-vllm:local
_METRIC_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int
    lang: str
    flags: tuple[str, ...]
    code: str

    @property
    def ident(self) -> str:
        """A readable test id: file:line."""
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md (when present) and every Markdown file under docs/."""
    files = sorted(DOCS.glob("*.md"))
    readme = REPO / "README.md"
    return ([readme] if readme.exists() else []) + files


def parse_blocks(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a Markdown file, and its text with those blocks blanked out."""
    blocks: list[Block] = []
    prose: list[str] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, info = len(match["indent"]), match["fence"], match["info"].strip()
        start, body = i + 1, []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            same = close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence)
            if same and close and not close["info"].strip():
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        words = info.split()
        lang = words[0].lower() if words else ""
        blocks.append(Block(path, start, lang, tuple(words[1:]), "\n".join(body) + "\n"))
        prose.extend([""] * (len(body) + 2))
        i += 1
    return blocks, prose


def all_blocks() -> list[Block]:
    """Every fenced block of every doc file."""
    return [block for path in doc_files() for block in parse_blocks(path)[0]]


def shell_blocks() -> list[Block]:
    """The ```bash blocks that run (plain or expect-fail)."""
    return [b for b in all_blocks() if b.lang == "bash" and "no-run" not in b.flags]


def venv_bin() -> Path:
    """The directory with the project's `kvtier` and `python`."""
    candidate = REPO / ".venv" / "bin"
    return candidate if (candidate / "kvtier").exists() else Path(sys.executable).parent


def run_block(block: Block) -> tuple[int, str]:
    """Run a block as documented; returns (exit status, combined output). Kills it at the limit."""
    with tempfile.TemporaryDirectory(prefix="kvtier-doc-") as tmp:
        runtime = Path(tmp) / ".run"
        runtime.mkdir(mode=0o700)
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVTIER_")}
        env.update(
            PATH=f"{venv_bin()}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
            HOME=tmp,
            XDG_RUNTIME_DIR=str(runtime),
            VIRTUAL_ENV=str(venv_bin().parent),
        )
        proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"{block.ident}: still running after {BLOCK_TIMEOUT_S}s\n{out}")
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything the block left in the background
        return proc.returncode, out


def load_generator() -> ModuleType:
    """docs/gen_config_reference.py as a module (docs/ is not a package)."""
    path = DOCS / "gen_config_reference.py"
    spec = importlib.util.spec_from_file_location("gen_config_reference", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: Counter[str] = Counter()
    result: set[str] = set()
    for line in parse_blocks(path)[1]:
        match = _HEADING.match(line)
        if match:
            slug = github_slug(match[2])
            result.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
            seen[slug] += 1
    return result


def exported_kvtier_metrics() -> set[str]:
    """Family and sample names the service's /metrics exposes, from kvtier.app.metrics' own registry."""
    from kvtier.app.metrics import ServiceMetrics, build_registry  # kvtier's own: an ImportError fails
    from kvtier.storage.base import StoreStats, TierStats

    tiers = {name: TierStats(errors={"timeout": 1}) for name in ("cpu", "disk", "redis")}
    stats = StoreStats(
        tiers=tiers,
        leases_active=0,
        slots_in_use=0,
        slots_total_bytes=0,
        write_queue_depth=0,
        writes_dropped=0,
        namespaces=0,
    )
    metrics = ServiceMetrics()
    metrics.calls["lookup"] = 1
    metrics.call_errors[("lookup", "auth")] = 1
    metrics.protocol_errors["malformed"] = 1
    registry = build_registry(lambda: stats, metrics)
    names: set[str] = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def known_vllm_metrics() -> set[str]:
    """Base names of vLLM's Prometheus metrics, read from the installed vLLM's source."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        missing("vLLM is not installed (make test installs its CPU build)")
    source = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    names = set(re.findall(r"\"(vllm:[a-z_]+)\"", source.read_text()))
    # kvtier's connector registers its own families on vLLM's /metrics.
    own = Path(__file__).resolve().parents[2] / "connector" / "prom.py"
    return names | set(re.findall(r"\"(vllm:[a-z_]+)\"", own.read_text()))


def strip_suffix(name: str) -> str:
    """A sample name without its Prometheus type suffix."""
    for suffix in _METRIC_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the Grafana dashboard."""
    data = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in data["panels"] for t in p.get("targets", [])]


def promql_texts() -> list[tuple[str, str]]:
    """(where, text) of everything that names metrics: doc prose and blocks, and the dashboard."""
    texts = [(str(path.relative_to(REPO)), path.read_text()) for path in doc_files()]
    texts += [(f"{DASHBOARD.name} expr", expr) for expr in dashboard_exprs()]
    return texts


# -------------------------------------------------------------------------------------------- tests
def test_required_docs_exist() -> None:
    """The pages the README links to are there."""
    for name in REQUIRED_DOCS:
        assert (DOCS / f"{name}.md").is_file(), name


def test_configuration_reference_is_current() -> None:
    """docs/configuration.md equals what the generator makes from the settings model now."""
    expected = load_generator().render()
    actual = (DOCS / "configuration.md").read_text()
    assert actual == expected, "stale: run .venv/bin/python docs/gen_config_reference.py"


def test_configuration_reference_lists_every_setting() -> None:
    """Each setting and its environment variable appear in the reference."""
    from kvtier.app.settings import ENV_PREFIX, FIELD_NAMES

    text = (DOCS / "configuration.md").read_text()
    for name in FIELD_NAMES:
        assert f"`{name}`" in text and f"`{ENV_PREFIX}{name.upper()}`" in text, name


def test_block_info_strings_follow_the_convention() -> None:
    """Shell code is fenced as bash with known flags only, so nothing escapes the runner."""
    for block in all_blocks():
        assert block.lang not in FORBIDDEN_LANGS, f"{block.ident}: use ```bash (+ no-run if needed)"
        if block.lang == "bash":
            unknown = set(block.flags) - RUN_FLAGS
            assert not unknown, f"{block.ident}: unknown flags {sorted(unknown)}"
            assert len(block.flags) <= 1, f"{block.ident}: pick one flag"
            assert block.code.strip(), f"{block.ident}: empty block"


def test_docs_have_runnable_examples() -> None:
    """The runner has something to run (a parse error would otherwise pass silently)."""
    blocks = shell_blocks()
    assert len(blocks) >= 5
    assert any("expect-fail" in b.flags for b in blocks)


@pytest.mark.parametrize("block", shell_blocks(), ids=lambda b: b.ident)
def test_shell_block_runs_as_written(block: Block) -> None:
    """The block exits 0, or non-zero when marked expect-fail."""
    status, out = run_block(block)
    if "expect-fail" in block.flags:
        assert status != 0, f"{block.ident}: expected a failure, got exit 0\n{out}"
        assert "Traceback" not in out, f"{block.ident}: failed with a traceback\n{out}"
    else:
        assert status == 0, f"{block.ident}: exit {status}\n{block.code}\n{out}"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(path: Path) -> None:
    """Relative links point at existing files, and #fragments at headings of Markdown targets."""
    prose = "\n".join(parse_blocks(path)[1])
    prose = re.sub(r"`[^`\n]*`", "", prose)  # inline code is not a link
    problems = []
    for target in _LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{target}: no heading #{fragment} in {dest.name}")
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_kvtier_metric_names_exist() -> None:
    """Every kvtier_* metric named in the docs and the dashboard is one the service exports."""
    exported = exported_kvtier_metrics()
    unknown = {
        f"{where}: {name}"
        for where, text in promql_texts()
        for name in _KVTIER_METRIC.findall(text)
        if name not in exported
    }
    assert not unknown, sorted(unknown)


def test_vllm_metric_names_exist() -> None:
    """Every vllm:* metric named in the docs and the dashboard exists in the installed vLLM."""
    known = known_vllm_metrics()
    unknown = {
        f"{where}: {name}"
        for where, text in promql_texts()
        for name in _VLLM_METRIC.findall(text)
        if strip_suffix(name) not in known and name not in known
    }
    assert not unknown, sorted(unknown)


def _balanced(expr: str) -> bool:
    """Brackets of a PromQL expression pair up (outside quoted strings)."""
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in re.sub(r'"[^"]*"', '""', expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def test_promql_is_well_formed() -> None:
    """Each PromQL line of the docs and each dashboard expression has balanced brackets."""
    exprs = dashboard_exprs()
    for block in all_blocks():
        if block.lang == "promql":
            exprs += [chunk for chunk in re.split(r"\n(?=\S)", block.code.strip()) if chunk]
    assert exprs
    bad = [e for e in exprs if not _balanced(e)]
    assert not bad, bad


def test_grafana_dashboard_is_importable() -> None:
    """The dashboard is JSON Grafana imports: a title, a uid, a Prometheus data source variable."""
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    assert data["title"] and data["uid"] and data["schemaVersion"] >= 30
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in data["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
    text = " ".join(dashboard_exprs())
    for needed in ("kvtier_hit_tokens_total", "kvtier_tier_bytes", "histogram_quantile"):
        assert needed in text
    assert "kvtier_tier_errors_total" in text
