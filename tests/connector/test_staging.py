"""The CUDA copier's staging buffers come out of the headroom vLLM leaves after sizing its KV cache:
full pieces where that is ample, fewer layers a piece where it is short, a refusal (the worker then
stays idle, saying why) where not even one layer of a chunk per buffer fits."""

from __future__ import annotations

import pytest

from kvtier.connector.staging import LANES, PIECE_BYTES, RING, STAGING_SHARE, StagingError, layers_per_piece

MIB = 1 << 20


def test_ample_headroom_gives_full_pieces_of_at_most_every_layer() -> None:
    assert layers_per_piece(MIB, 80, free_bytes=14 << 30) == PIECE_BYTES // MIB == 16
    assert layers_per_piece(MIB, 4, free_bytes=14 << 30) == 4  # a small model: the whole chunk
    assert layers_per_piece(32 * MIB, 80, free_bytes=14 << 30) == 1  # a layer larger than a piece


def test_short_headroom_gives_pieces_of_fewer_layers_within_its_share() -> None:
    free = 64 * MIB  # the share is 8 MiB: two layers of 1 MiB in each of the four buffers
    layers = layers_per_piece(MIB, 80, free_bytes=free)
    assert layers == 2 and LANES * RING * layers * MIB <= free // STAGING_SHARE


def test_no_room_for_one_layer_per_buffer_is_refused_with_the_figures() -> None:
    assert layers_per_piece(MIB, 80, free_bytes=4 * MIB) == 1  # past the share, within what is free
    with pytest.raises(StagingError, match=r"has 3145728 bytes free .* needs 4194304"):
        layers_per_piece(MIB, 80, free_bytes=3 * MIB)
