"""Block copies between KV tensors and slot buffers keep every byte, in both layouts."""

from __future__ import annotations

import pytest
import torch

from connector.copy import BlockCopier, LayoutError, block_planes

NUM_BLOCKS = 12


def _kv_cpu(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, 2, 4, 8, generator=g).to(torch.bfloat16)


def _kv_split(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, NUM_BLOCKS, 4, 8, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("make", [_kv_cpu, _kv_split])
def test_save_then_load_restores_blocks(make) -> None:
    src_layers = [make(1), make(2), make(3)]
    copier = BlockCopier(src_layers, NUM_BLOCKS, blocks_per_chunk=4)
    buf = bytearray(copier.chunk_bytes)
    slot = copier.slot_view(buf)
    copier.save(slot, [5, 2, 9, 7])
    dst_layers = [torch.zeros_like(t) for t in src_layers]
    loader = BlockCopier(dst_layers, NUM_BLOCKS, blocks_per_chunk=4)
    loader.load(loader.slot_view(buf), 1, [3, 4, 6])  # blocks 2, 9, 7 of the source
    for src, dst in zip(src_layers, dst_layers, strict=True):
        bdim = 0 if src.shape[0] == NUM_BLOCKS else 1
        for s_id, d_id in [(2, 3), (9, 4), (7, 6)]:
            assert torch.equal(src.select(bdim, s_id), dst.select(bdim, d_id))
        assert not dst.select(bdim, 0).any()


def test_slot_layout_is_layer_block_page() -> None:
    layers = [_kv_cpu(7), _kv_cpu(8)]
    copier = BlockCopier(layers, NUM_BLOCKS, blocks_per_chunk=2)
    buf = bytearray(copier.chunk_bytes)
    copier.save(copier.slot_view(buf), [3, 10])
    page = copier.layout.page_bytes
    assert bytes(buf[page : 2 * page]) == layers[0][10].view(torch.uint8).numpy().tobytes()
    assert bytes(buf[2 * page : 3 * page]) == layers[1][3].view(torch.uint8).numpy().tobytes()


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(LayoutError):
        block_planes(torch.zeros(5, 3), NUM_BLOCKS)
    copier = BlockCopier([_kv_cpu(1)], NUM_BLOCKS, blocks_per_chunk=2)
    with pytest.raises(LayoutError):
        copier.slot_view(bytearray(copier.chunk_bytes + 1))
