"""The pure parts of `kvtier bench serve`: the workload, the KV memory of each run, and the figures.

The workload is vLLM's `prefix_repetition` dataset: `num_prefixes` prefixes, each shared by
`prompts_per_prefix` prompts that add a suffix of their own. Two KV memory sizes come out of it:
- constrained: room for `concurrency` requests of the longest prompt at once and little more, so
  most prefixes do not stay in vLLM's prefix cache between their uses;
- ceiling: room for every block the workload ever fills, so vLLM's prefix cache never evicts one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

RUNS = ("prefix_cache", "kvtier", "ceiling")
REFERENCE = "ceiling"  # every run's texts are compared with the first repetition's ceiling run
NULL_BLOCKS = 1  # vLLM's block pool keeps one block aside (its null block)


@dataclass(frozen=True)
class Workload:
    """What the client sends: prompts of a shared prefix and a suffix of their own, greedy outputs."""

    prefix_len: int = 1024
    suffix_len: int = 32
    output_len: int = 16
    num_prefixes: int = 16
    prompts_per_prefix: int = 8
    concurrency: int = 4
    block_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "prefix_len", "suffix_len", "output_len", "num_prefixes", "prompts_per_prefix",
            "concurrency", "block_size",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def num_prompts(self) -> int:
        """Requests the client sends."""
        return self.num_prefixes * self.prompts_per_prefix

    @property
    def max_model_len(self) -> int:
        """Longest sequence: prompt and output, plus one block for prompts that re-tokenize longer."""
        longest = self.prefix_len + self.suffix_len + self.output_len
        return (blocks(longest, self.block_size) + 1) * self.block_size


@dataclass(frozen=True)
class KVSizing:
    """KV memory of the engine, in blocks, for the constrained runs and for the ceiling."""

    constrained_blocks: int
    ceiling_blocks: int
    prefix_blocks: int  # one prefix's full blocks
    prefixes_in_constrained: int  # prefixes the constrained memory could hold if nothing ran


def blocks(tokens: int, block_size: int) -> int:
    """Blocks that hold tokens."""
    return math.ceil(tokens / block_size)


def size_kv(workload: Workload) -> KVSizing:
    """The KV memory of each run; ValueError when every prefix would fit in the constrained memory."""
    w = workload
    prefix_blocks = w.prefix_len // w.block_size
    if prefix_blocks == 0:
        raise ValueError(f"prefix_len ({w.prefix_len}) must be at least one block ({w.block_size} tokens)")
    per_request = blocks(w.max_model_len, w.block_size)
    constrained = w.concurrency * per_request + NULL_BLOCKS
    # Every prefix once, and every request's blocks past its prefix: nothing is ever evicted.
    ceiling = w.num_prefixes * prefix_blocks + w.num_prompts * (per_request - prefix_blocks) + NULL_BLOCKS
    fit = (constrained - NULL_BLOCKS) // prefix_blocks
    if fit >= w.num_prefixes:
        raise ValueError(
            f"all {w.num_prefixes} prefixes fit in the KV memory of {w.concurrency} concurrent requests "
            f"({fit} prefixes of {w.prefix_len} tokens): raise num_prefixes above {fit} or lower concurrency"
        )
    return KVSizing(constrained, max(ceiling, constrained), prefix_blocks, fit)


def run_order(repetition: int) -> tuple[str, ...]:
    """The configurations in the order repetition runs them: each takes each place in turn, so a
    slow spell of the machine does not always fall on the same one."""
    shift = repetition % len(RUNS)
    return RUNS[shift:] + RUNS[:shift]


def median(values: Sequence[float]) -> float:
    """The median; ValueError for no values."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> list[float]:
    """[lowest, highest] of the values."""
    if not values:
        raise ValueError("spread of no values")
    return [min(values), max(values)]


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, rounded to 3 places; ValueError when the denominator is not positive."""
    if denominator <= 0:
        raise ValueError(f"ratio over a non-positive value ({denominator})")
    return round(numerator / denominator, 3)


def count_matches(prompts: Sequence[str], texts: Sequence[str], reference: Mapping[str, str]) -> int:
    """How many prompts' generated texts equal the reference's text for the same prompt."""
    if len(prompts) != len(texts):
        raise ValueError(f"{len(prompts)} prompts but {len(texts)} generated texts")
    return sum(1 for prompt, text in zip(prompts, texts, strict=True) if reference.get(prompt) == text)


def by_prompt(prompts: Sequence[str], texts: Sequence[str]) -> dict[str, str]:
    """prompt -> generated text; ValueError when the lists differ in length or a prompt repeats."""
    if len(prompts) != len(texts):
        raise ValueError(f"{len(prompts)} prompts but {len(texts)} generated texts")
    out = dict(zip(prompts, texts, strict=True))
    if len(out) != len(prompts):
        raise ValueError(f"{len(prompts) - len(out)} prompts repeat: texts cannot be matched by prompt")
    return out


# Figures of one run, from vLLM's benchmark result: our name -> its key.
FIGURES = {
    "request_throughput": "request_throughput",
    "ttft_mean_ms": "mean_ttft_ms",
    "ttft_median_ms": "median_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
}


@dataclass(frozen=True)
class RunResult:
    """One run of one configuration: vLLM's figures, its texts in request order, and where its
    prompt tokens came from."""

    figures: dict[str, float]
    texts: list[str]
    prompt_tokens: dict[str, float]  # by source: local_compute, local_cache_hit, external_kv_transfer
    kvtier_hits: dict[str, float] = field(default_factory=dict)  # kvtier's hit tokens by tier

    @classmethod
    def from_vllm(
        cls,
        result: Mapping[str, Any],
        prompt_tokens: dict[str, float],
        kvtier_hits: Mapping[str, float] | None = None,
    ) -> RunResult:
        """From the JSON `vllm bench serve --save-result --save-detailed` wrote (and, for a kvtier
        run, its hit tokens by tier)."""
        missing = [key for key in (*FIGURES.values(), "generated_texts") if key not in result]
        if missing:
            raise ValueError(f"vLLM's benchmark result lacks {missing}")
        figures = {name: float(result[key]) for name, key in FIGURES.items()}
        texts = [str(t) for t in result["generated_texts"]]
        return cls(figures, texts, dict(prompt_tokens), dict(kvtier_hits or {}))


def _with_spread(name: str, values: Sequence[float], places: int) -> dict[str, Any]:
    return {
        name: round(median(values), places),
        f"{name}_runs": [round(v, places) for v in values],
        f"{name}_spread": [round(v, places) for v in spread(values)],
    }


def hit_fractions(prompt_tokens: Mapping[str, float]) -> dict[str, float]:
    """Shares of the prompt tokens served by vLLM's prefix cache and by kvtier."""
    total = sum(prompt_tokens.values())
    if total <= 0:
        return {"prefix_cache_hit_fraction": 0.0, "kvtier_hit_fraction": 0.0}
    return {
        "prefix_cache_hit_fraction": round(prompt_tokens.get("local_cache_hit", 0.0) / total, 3),
        "kvtier_hit_fraction": round(prompt_tokens.get("external_kv_transfer", 0.0) / total, 3),
    }


def summarize(runs: Mapping[str, Sequence[RunResult]], prompts: Sequence[str]) -> dict[str, Any]:
    """Median and spread of each configuration's figures over its runs, texts matched with the
    first ceiling run's, and kvtier's throughput ratios (each repetition's own, then their median)."""
    if any(len(runs.get(name, ())) == 0 for name in RUNS):
        raise ValueError(f"every configuration needs a run: {RUNS}")
    repetitions = {len(runs[name]) for name in RUNS}
    if len(repetitions) != 1:
        raise ValueError(f"configurations ran different numbers of times: {repetitions}")
    reference = by_prompt(prompts, runs[REFERENCE][0].texts)
    out: dict[str, Any] = {}
    for name in RUNS:
        section: dict[str, Any] = {"requests": len(prompts)}
        for figure in FIGURES:
            places = 3 if figure == "request_throughput" else 1
            section.update(_with_spread(figure, [r.figures[figure] for r in runs[name]], places))
        matches = [count_matches(prompts, r.texts, reference) for r in runs[name]]
        section.update(_with_spread("texts_equal_to_ceiling", matches, 1))
        for key in ("prefix_cache_hit_fraction", "kvtier_hit_fraction"):
            section.update(_with_spread(key, [hit_fractions(r.prompt_tokens)[key] for r in runs[name]], 3))
        tiers = sorted({tier for r in runs[name] for tier in r.kvtier_hits})
        if tiers:
            section["kvtier_hit_tokens_by_tier"] = {
                tier: median([r.kvtier_hits.get(tier, 0.0) for r in runs[name]]) for tier in tiers
            }
        out[name] = section
    throughput = {name: [r.figures["request_throughput"] for r in runs[name]] for name in RUNS}
    for other in ("prefix_cache", "ceiling"):
        ratios = [ratio(k, o) for k, o in zip(throughput["kvtier"], throughput[other], strict=True)]
        out.update(_with_spread(f"throughput_ratio_vs_{other}", ratios, 3))
    return out
