"""Charts of `make demo` and `make bench`, drawn from their results dicts into image files.

matplotlib is optional (the `plot` extra): it is imported only when a chart is drawn, and without it
each chart function prints one line saying how to get it and returns None; the tables print anyway.
Figures are drawn with matplotlib's object API (no pyplot), so no global backend state is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

SKIP_LINE = (
    "chart skipped: matplotlib is not installed "
    '(pip install "kvtier[plot]"; in a checkout: .venv/bin/pip install -e ".[plot]")'
)
OFF_COLOR = "#9e9e9e"
# What served the prompt of a round with kvtier: a miss, or the tiers its hit came from.
SERVED_COLORS = {
    "miss": "#a6cee3",
    "cpu": "#1f78b4",
    "disk": "#ff7f00",
    "redis": "#e31a1c",
    "mixed": "#6a3d9a",
}
SERVED_LABELS = {
    "miss": "vLLM + kvtier: miss (computed, then stored)",
    "cpu": "vLLM + kvtier: CPU-tier hit",
    "disk": "vLLM + kvtier: disk-tier hit",
    "redis": "vLLM + kvtier: Redis-tier hit",
    "mixed": "vLLM + kvtier: hit from several tiers",
}
TIER_NAMES = {
    "miss": "miss",
    "cpu": "CPU hit",
    "disk": "disk hit",
    "redis": "Redis hit",
    "mixed": "mixed hit",
}
MET_COLOR = "#33a02c"
MISSED_COLOR = "#e31a1c"


class Headline(NamedTuple):
    """One benchmark figure and its target (None: reported, not judged)."""

    name: str
    value: float
    target: float | None
    higher_is_better: bool

    @property
    def met(self) -> bool | None:
        """Whether the figure meets its target; None without a target."""
        if self.target is None:
            return None
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    @property
    def margin(self) -> float | None:
        """The figure as a multiple of its target, turned so that above 1 means met."""
        if self.target is None:
            return None
        value, target = max(self.value, 1e-9), max(self.target, 1e-9)
        return value / target if self.higher_is_better else target / value

    @property
    def target_text(self) -> str:
        """The target as the table shows it: `>= 0.8`, `<= 5`, or empty."""
        if self.target is None:
            return ""
        return (">= " if self.higher_is_better else "<= ") + f"{self.target:g}"


def _figure_class() -> Any:
    """matplotlib's Figure class, or None (after printing SKIP_LINE) when matplotlib is missing."""
    try:
        # The package first: `from matplotlib.figure import ...` alone would succeed from a cached
        # submodule even where the package itself is unavailable.
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError:
        print(SKIP_LINE, flush=True)
        return None
    return Figure


def _save(fig: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"chart: {path}", flush=True)
    return path


def served_by(hit_tokens: Mapping[str, int]) -> str:
    """Which tier served a round's prompt: "miss", a tier's name, or "mixed"."""
    tiers = [tier for tier, tokens in hit_tokens.items() if tokens > 0]
    if not tiers:
        return "miss"
    return tiers[0] if len(tiers) == 1 else "mixed"


def demo_chart(results: Mapping[str, Any], path: Path) -> Path | None:
    """TTFT of each demo round without and with kvtier, the kvtier bar coloured by the tier that
    served it; returns the file written, or None without matplotlib."""
    figure_class = _figure_class()
    if figure_class is None:
        return None
    rounds = results["rounds"]
    if not rounds:
        raise ValueError("demo_chart: results['rounds'] is empty; it needs at least one round")
    fig = figure_class(figsize=(9.5, 5.2), layout="constrained")
    ax = fig.subplots()
    width = 0.38
    served = [served_by(r["hit_tokens"]) for r in rounds]
    for i, (row, tier) in enumerate(zip(rounds, served, strict=True)):
        off, on = row["ttft_off_ms"], row["ttft_on_ms"]
        ax.bar(i - width / 2, off, width, color=OFF_COLOR, label="vLLM alone (computes the whole prompt)")
        ax.bar(i + width / 2, on, width, color=SERVED_COLORS[tier], label=SERVED_LABELS[tier])
        ax.annotate(
            f"{off / max(on, 1e-9):.1f}x faster" if on < off else f"{on / max(off, 1e-9):.2f}x the time",
            (i + width / 2, on),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_xticks(range(len(rounds)), [_round_label(r, t) for r, t in zip(rounds, served, strict=True)])
    ax.set_ylabel("time to first token (ms)")
    ax.set_xlabel("chat round, the tier that served it, and the prompt tokens it loaded")
    ax.set_title("Time to first token per round of a chat, lower is better")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper left", fontsize=9)
    ax.set_ylim(0, max(max(r["ttft_off_ms"], r["ttft_on_ms"]) for r in rounds) * 1.25)
    ax.grid(axis="y", alpha=0.3)
    identical = all(r["identical"] for r in rounds)
    verdict = "every output identical to vLLM alone" if identical else "OUTPUTS DIFFER from vLLM alone"
    notes = [f"each round's prompt holds the whole conversation so far; {verdict}", results.get("setup", "")]
    fig.supxlabel("\n".join(n for n in notes if n), fontsize=8, color="#555555")
    return _save(fig, path)


def _round_label(row: Mapping[str, Any], served: str) -> str:
    tokens = sum(row["hit_tokens"].values())
    return f"{row['name']}\n{TIER_NAMES[served]}" + (f"\n{tokens} tokens" if tokens else "")


def targets_chart(headlines: Sequence[Headline], path: Path, title: str) -> Path | None:
    """Each figure that has a target, as a multiple of it (right of 1: met; log scale), labelled
    with its value and target; returns the file written, or None without matplotlib."""
    judged = [h for h in headlines if h.target is not None]
    if not judged:
        raise ValueError("targets_chart: no figure with a target in the results; nothing to draw")
    figure_class = _figure_class()
    if figure_class is None:
        return None
    fig = figure_class(figsize=(10, 0.42 * len(judged) + 1.6), layout="constrained")
    ax = fig.subplots()
    margins = [h.margin or 1.0 for h in judged]
    ys = range(len(judged))[::-1]  # the first figure on top, as in the table
    colors = [MET_COLOR if h.met else MISSED_COLOR for h in judged]
    # Bars grow from the target line: right when met, left when missed.
    ax.barh(list(ys), [m - 1.0 for m in margins], left=1.0, color=colors, height=0.6)
    ax.scatter(margins, list(ys), color=colors, s=18, zorder=3)  # visible where a bar is a sliver
    for y, h, m in zip(ys, judged, margins, strict=True):
        target = h.target_text.replace(">=", "\u2265").replace("<=", "\u2264")
        ax.annotate(
            f"{h.value:g}  (target {target}: {'met' if h.met else 'MISSED'})",
            (max(m, 1.0), y),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(list(ys), [h.name for h in judged], fontsize=9)
    ax.set_xscale("log", base=2)
    low = min(0.5, min(margins) / 1.3)
    high = max(2.0, max(margins) * 2.2)  # room for the labels right of the bars
    ax.set_xlim(low, high)
    ticks = [2.0**k for k in range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1)]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("figure relative to its target (above 1x: target met, green; below: missed, red)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    unjudged = len(headlines) - len(judged)
    if unjudged:
        fig.supxlabel(f"{unjudged} figures without a target are in the table only", fontsize=8)
    return _save(fig, path)
