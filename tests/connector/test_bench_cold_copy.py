"""The CPU-hit floor's reference copy: each copy moves bytes not touched since the pools were filled."""

from __future__ import annotations

import numpy as np

from kvtier.bench.floors import ColdCopy


def test_each_copy_takes_the_next_pieces_and_copies_them_whole() -> None:
    copy = ColdCopy(1 << 20, pool_bytes=4 << 20)  # 4 pieces of 1 MiB
    copy._src[:] = np.arange(4, dtype=np.uint8)[:, None] + 10  # piece i holds 10 + i
    seconds = [copy.once() for _ in range(4)]
    assert all(s > 0 for s in seconds)
    # Copy k wrote destination piece k from source piece k + 2 (mod 4): every piece once per round.
    assert [int(copy._dst[k].min()) for k in range(4)] == [12, 13, 10, 11]
    assert [int(copy._dst[k].max()) for k in range(4)] == [12, 13, 10, 11]


def test_a_pool_smaller_than_two_copies_still_alternates_two_pieces() -> None:
    copy = ColdCopy(3 << 20, pool_bytes=4 << 20)
    copy._src[0] = 7
    copy._src[1] = 9
    copy.once()
    copy.once()
    assert int(copy._dst[0][0]) == 9 and int(copy._dst[1][0]) == 7
