from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from .tiny_model import build_model, hf_greedy  # noqa: E402


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama") / "model", "llama")


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 17, 40, 5, 64, 33)]


@pytest.fixture(scope="session")
def reference(llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations (24 tokens) of `prompts`."""
    return hf_greedy(llama_dir, prompts, 24)
