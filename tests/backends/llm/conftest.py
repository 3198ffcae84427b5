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


@pytest.fixture(scope="package")
def repetitive() -> list[list[int]]:
    """Prompts that repeat spans (so prompt lookup finds drafts) and one that does not."""
    rng = random.Random(5)
    out = []
    for n, reps in ((5, 4), (9, 3), (3, 7), (23, 1)):
        span = [rng.randrange(2, 320) for _ in range(n)]
        out.append(span * reps + span[: n // 2])
    return out


@pytest.fixture(scope="package")
def repetitive_reference(llama_dir: Path, repetitive: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations (40 tokens) of `repetitive`."""
    return hf_greedy(llama_dir, repetitive, 40)


@pytest.fixture(scope="package")
def small_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """A vocabulary of 8 tokens (the sampled tokens' distribution has few cells), and a prompt
    that is the model's own greedy path, so that prompt lookup's drafts are often accepted."""
    folder = build_model(tmp_path_factory.mktemp("small") / "model", "llama", vocab_size=8)
    return folder, [2, 3, 4, 5, *hf_greedy(folder, [[2, 3, 4, 5]], 20)[0]]
