"""Fixtures of the end-to-end tests: the tiny model and the no-connector baseline."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.models import TINY, build_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a tiny random-weight Llama with a locally trained tokenizer, built once per session."""
    path: Path = tmp_path_factory.mktemp("models") / "tiny-llama"
    return str(build_model(path, TINY))
