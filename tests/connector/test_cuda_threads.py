"""Every kvtier thread that makes a CUDA runtime call binds the KV cache's device first, and every
device is passed explicitly: on a rank whose KV cache is on cuda:1, nothing kvtier does opens a
context on cuda:0. Checked on the CPU by recording ``torch.cuda.set_device`` and CUDA's runtime calls.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtier.connector import copy, pinning
from kvtier.connector.pinning import bind_device, clear_cuda_error, pin_host_buffer, pin_pieces

CUDA1 = torch.device("cuda", 1)


class _Cuda:
    """A stand-in for the CUDA runtime: each call is recorded with the device its thread had bound."""

    def __init__(self, refuse_at: int | None = None, last_error: bool = True) -> None:
        self.bound: dict[str, torch.device] = {}
        self.calls: list[tuple[str, str, torch.device | None, Any]] = []
        self.refuse_at = refuse_at  # the register call (0-based) CUDA refuses
        if last_error:
            self.cudaGetLastError = lambda: self._record("cudaGetLastError", None)

    def _record(self, call: str, arg: Any) -> None:
        name = threading.current_thread().name
        self.calls.append((call, name, self.bound.get(name), arg))

    def set_device(self, device: torch.device) -> None:
        self.bound[threading.current_thread().name] = torch.device(device)

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        registers = sum(c[0] == "cudaHostRegister" for c in self.calls)
        self._record("cudaHostRegister", size)
        return 1 if registers == self.refuse_at else 0

    def cudaHostUnregister(self, address: int) -> int:
        self._record("cudaHostUnregister", address)
        return 0


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Cuda]:
    fake = _Cuda()
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    yield fake


def test_the_save_waiter_binds_the_kv_caches_device_before_it_waits_for_an_event(cuda: _Cuda) -> None:
    class Ended:
        def synchronize(self) -> None:
            cuda._record("synchronize", None)

    reported: list[BaseException | None] = []
    waiter = copy.cuda_save_waiter(CUDA1, None)
    try:
        waiter.submit(copy._await_save, Ended(), reported.append)
        waiter.wait()
    finally:
        waiter.close()
    assert cuda.calls == [("synchronize", "kvtier-cuda-saves", CUDA1, None)] and reported == [None]


def test_pinning_registers_and_unregisters_with_the_given_devices_context(cuda: _Cuda) -> None:
    cuda.refuse_at = 2  # the third piece: the two before are unregistered, the error cleared
    buf = memoryview(bytearray(5 * 8192))
    caller = threading.current_thread().name
    assert pin_host_buffer(buf, CUDA1, slot_bytes=8192, piece_bytes=16384) == []
    assert [(call, name, device) for call, name, device, _ in cuda.calls] == [
        ("cudaHostRegister", caller, CUDA1),
        ("cudaHostRegister", caller, CUDA1),
        ("cudaHostRegister", caller, CUDA1),
        ("cudaGetLastError", caller, CUDA1),
        ("cudaHostUnregister", caller, CUDA1),
        ("cudaHostUnregister", caller, CUDA1),
    ]
    assert [size for call, _, _, size in cuda.calls if call == "cudaHostRegister"] == [16384, 16384, 8192]


def test_clearing_an_error_without_cudaGetLastError_launches_on_the_given_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _Cuda(last_error=False)
    launched: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch, "zeros", lambda *shape, device: launched.append(device))
    clear_cuda_error(CUDA1)
    assert launched == [CUDA1] and fake.bound == {threading.current_thread().name: CUDA1}


def test_a_device_without_its_index_is_refused_and_other_devices_bind_nothing(cuda: _Cuda) -> None:
    with pytest.raises(ValueError, match="names no device index"):
        bind_device(torch.device("cuda"))
    bind_device(torch.device("cpu"))
    assert cuda.bound == {}


@pytest.mark.parametrize(
    ("size", "slot", "piece", "pieces"),
    [
        (10 * 8192, 8192, 3 * 8192, [(0, 24576), (24576, 24576), (49152, 24576), (73728, 8192)]),
        # 5000-byte slots take 8192-byte extents: a 20000-byte limit holds two whole slots.
        (6 * 8192, 5000, 20000, [(0, 16384), (16384, 16384), (32768, 16384)]),
        # A slot larger than the limit is one piece of its own, never split.
        (3 * 12288, 12000, 4096, [(0, 12288), (12288, 12288), (24576, 12288)]),
        (4096, 4096, pinning.PIN_PIECE_BYTES, [(0, 4096)]),
    ],
)
def test_pin_pieces_end_on_slot_and_page_boundaries(
    size: int, slot: int, piece: int, pieces: list[tuple[int, int]]
) -> None:
    assert pin_pieces(size, slot, piece) == pieces
