"""A Hugging Face-format model folder's weights: (sharded) safetensors, one tensor at a time."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from pier.contract.backend import LoadProgress

STAGE = "loading weights"
PROGRESS_INTERVAL_S = 0.25  # within a shard, at most this often: a report may cross a process boundary


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"weight files named by the index are missing: {', '.join(missing)}")
    return files


def iter_weights(folder: Path, progress: Callable[[LoadProgress], None] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every weight file, loaded on CPU one at a time.
    `progress` hears how far it has come: at the start, after each shard, and within a shard
    every PROGRESS_INTERVAL_S (the bytes of the tensors handed on so far)."""
    from safetensors import safe_open

    files = safetensors_files(folder)
    sizes = [f.stat().st_size for f in files]
    total, done, last = sum(sizes), 0, time.monotonic()
    if progress is not None:
        progress(LoadProgress(STAGE, 0, len(files), 0, total))
    for i, path in enumerate(files):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type: a corrupt or truncated file
            raise ValueError(f"weight file {path.name}: {exc}") from None
        with handle as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as exc:  # noqa: BLE001 - as above, for the tensor's bytes
                    raise ValueError(f"weight file {path.name}, tensor {name}: {exc}") from None
                done += tensor.nbytes
                yield name, tensor
                if progress is not None and time.monotonic() - last >= PROGRESS_INTERVAL_S:
                    last = time.monotonic()
                    progress(LoadProgress(STAGE, i, len(files), done, total))
        done = sum(sizes[:i + 1])  # the header too: the last report of a shard counts the whole file
        if progress is not None:
            last = time.monotonic()
            progress(LoadProgress(STAGE, i + 1, len(files), done, total))


class WeightMap:
    """Checkpoint tensor names -> where each goes, filled by a model as it builds its layers.

    `load` hands every known tensor to its target (names it does not know are left alone, as
    transformers leaves unused tensors) and raises ValueError naming a required tensor that is missing."""

    def __init__(self) -> None:
        self._targets: dict[str, Callable[[torch.Tensor], None]] = {}
        self._optional: set[str] = set()

    def add(self, name: str, target: Callable[[torch.Tensor], None], optional: bool = False) -> None:
        self._targets[name] = target
        if optional:
            self._optional.add(name)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `weights`; returns the names loaded."""
        seen: set[str] = set()
        for name, tensor in weights:
            target = self._targets.get(name)
            if target is not None:
                target(tensor)
                seen.add(name)
        missing = sorted(set(self._targets) - seen - self._optional)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"weight {missing[0]} missing from the safetensors files{more}")
        return seen
