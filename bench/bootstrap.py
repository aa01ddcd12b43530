"""How far a ratio of pooled medians could move with other engines: a bootstrap over engine pairs.

The miss benchmark compares engines side by side, and engines built alike differ in the same
forward, so its ratio depends on which engines a run happened to start. Resampling whole pairs (each
pair keeps its own samples) and recomputing the ratio shows that spread next to the figure: a line
within the interval is not told apart by the run.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Hashable, Sequence


def pooled_median_ratio(num: Sequence[Sequence[float]], den: Sequence[Sequence[float]]) -> float:
    """median(every num sample) / median(every den sample), each pooled over all pairs."""
    pooled_num = [x for pair in num for x in pair]
    pooled_den = [x for pair in den for x in pair]
    return statistics.median(pooled_num) / statistics.median(pooled_den)


def pair_bootstrap_interval(
    num: Sequence[Sequence[float]],
    den: Sequence[Sequence[float]],
    level: float = 0.95,
    draws: int = 2000,
    seed: int = 0,
    strata: Sequence[Hashable] | None = None,
) -> tuple[float, float]:
    """The central `level` interval of pooled_median_ratio over resamples of whole pairs.

    strata (one label per pair): each resample keeps as many pairs of each label as the run had,
    so a design balanced between labels (which engine started first) stays balanced.
    """
    if len(num) != len(den) or not num:
        raise ValueError(f"need the same number (> 0) of pairs on both sides, got {len(num)} and {len(den)}")
    if not 0 < level < 1:
        raise ValueError(f"level must be between 0 and 1, got {level}")
    labels = list(strata) if strata is not None else [0] * len(num)
    if len(labels) != len(num):
        raise ValueError(f"need one stratum per pair, got {len(labels)} for {len(num)} pairs")
    groups = [[i for i, label in enumerate(labels) if label == key] for key in dict.fromkeys(labels)]
    rng = random.Random(seed)  # the same run gives the same interval

    def resample() -> list[int]:
        return [rng.choice(group) for group in groups for _ in group]

    ratios = sorted(
        pooled_median_ratio([num[i] for i in picks], [den[i] for i in picks])
        for picks in (resample() for _ in range(draws))
    )
    cut = int((1 - level) / 2 * draws)  # draws left out at each end
    return ratios[cut], ratios[draws - 1 - cut]
