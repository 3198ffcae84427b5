from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from .tiny_model import build_model, hf_greedy  # noqa: E402


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    """The tiny test models gain nothing from threads, and on a busy 2-core machine two OpenMP threads
    wait on each other at every op (seconds per test). Restored after this package."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama") / "model", "llama")


@pytest.fixture(scope="package")
def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 17, 40, 5, 64, 33)]


@pytest.fixture(scope="package")
def reference(llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations (24 tokens) of `prompts`."""
    return hf_greedy(llama_dir, prompts, 24)
