"""Multi-LoRA: PEFT adapters read, checked and served beside the base model (vLLM's --enable-lora).

An adapter is a PEFT folder: `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`, ...) and `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight`
[r, in] and `.lora_B.weight` [out, r] per projection). `read_adapter` checks it whole before anything
is served from it and refuses, with vLLM's words, what vLLM refuses (DoRA, `modules_to_save`, a LoRA
bias, a rank above `max_lora_rank`); unlike vLLM it also refuses a tensor of the wrong shape (vLLM
takes it and generates garbage) and names the file of a corrupt safetensors file. A refusal is a
`LoRAError` (a ValueError: the caller's adapter is wrong, an HTTP 400), "no adapter at that path" a
`LoRANotFound` (404).

`LoRAManager` keeps the adapters served, by name, each with an id: ids are never reused, so a
reload under the same name (`load_inplace`) gets a new id, and the prefix cache, which keys blocks
by the id (kv_cache.py), can never hand one adapter's KV to another's request. The weights of up to
`max_cpu_loras` adapters sit in the layers (`layers/lora.py`'s LoRALinearMethod, LRU; an adapter a
request still uses is never evicted), others are read again from their folder when a step needs them.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .config import INTERNAL_PREFIX, LoRAConfig, LoRAModulePath, parse_lora_modules
from .layers.linear import Linear
from .layers.lora import LoRABatch, LoRALinearMethod

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class LoRAError(ValueError):
    """The adapter is wrong (HTTP 400): the message names the field, tensor or file."""

    status = 400


class LoRANotFound(LoRAError):
    """No adapter at the path (HTTP 404)."""

    status = 404


@dataclass(frozen=True)
class Target:
    """Where a checkpoint module's delta goes: slice `index` of `linear`, its B rows put in the
    layout the layer stores them in (`rows`: RoPE's pair layout for q and k)."""

    linear: Linear
    index: int
    rows: Callable[[torch.Tensor], torch.Tensor]


ModuleDelta = tuple[torch.Tensor, torch.Tensor, float]  # A [r, in], B [out, r], scaling


def read_adapter(path: Path, max_rank: int, targets: dict[str, Target]) -> dict[str, ModuleDelta]:
    """The adapter at `path`, checked against `max_rank` and the model's projections (`targets`:
    checkpoint module name -> where it goes). Raises LoRANotFound, or LoRAError naming what is wrong."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise LoRANotFound(f"No adapter found for {path}")
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{config_path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{config_path}: not a JSON object")
    missing = {"r", "lora_alpha", "target_modules"} - set(cfg)
    if missing:
        raise LoRAError(f"Missing required configuration fields: {missing}")
    if cfg.get("modules_to_save") is not None:
        raise LoRAError("vLLM only supports modules_to_save being None.")
    if cfg.get("use_dora"):
        raise LoRAError("vLLM does not yet support DoRA.")
    if cfg.get("bias", "none") != "none":
        raise LoRAError("Adapter bias is not supported.")
    r, alpha = cfg["r"], cfg["lora_alpha"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoRAError("LoRA rank r must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"{config_path}: lora_alpha must be a number, got {alpha!r}")
    ranks = [r, *(v for v in (cfg.get("rank_pattern") or {}).values() if isinstance(v, int))]
    if max(ranks) > max_rank:
        raise LoRAError(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_rank}.")
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise LoRANotFound(f"No adapter found for {path}")
    tensors = _read_tensors(weights)
    if not tensors:
        raise LoRAError(f"{path} doesn't contain tensors")
    parts: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR.match(name[len(_PREFIX):] if name.startswith(_PREFIX) else "")
        if m is None:
            raise LoRAError(f"{name} is unsupported LoRA weight")
        parts.setdefault(m["module"], {})[m["ab"]] = (name, tensor)
    unexpected = sorted(set(parts) - set(targets))
    if unexpected:
        expected = sorted({n.rsplit(".", 1)[-1] for n in targets})
        raise LoRAError(f"While loading {path}, expected target modules in {expected} but received "
                        f"{sorted({n.rsplit('.', 1)[-1] for n in unexpected})}. Please verify that the loaded LoRA "
                        "module is correct")
    rslora = bool(cfg.get("use_rslora"))
    alphas = cfg.get("alpha_pattern") or {}
    out: dict[str, ModuleDelta] = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{weights}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        (a_name, a), (b_name, b) = ab["A"], ab["B"]
        t = targets[module]
        rank = a.shape[0] if a.dim() == 2 else -1
        inputs = t.linear.checkpoint_input_size  # a tensor-parallel shard's checkpoint sizes: the whole
        want_a = [rank, inputs]
        want_b = [t.linear.checkpoint_sizes[t.index], rank]
        for name, tensor, want in ((a_name, a, want_a), (b_name, b, want_b)):
            if list(tensor.shape) != want or rank < 1:
                raise LoRAError(f"{weights}: tensor {name} has shape {list(tensor.shape)}, expected "
                                f"{want if rank >= 1 else '[rank, ' + str(inputs) + ']'}")
        if rank > max_rank:
            raise LoRAError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
        a_alpha = next((v for k, v in alphas.items() if re.search(rf"(^|\.){re.escape(k)}$", module)), alpha)
        out[module] = (a, b, float(a_alpha) / (math.sqrt(rank) if rslora else rank))
    return out


def _read_tensors(weights: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoRAError(f"{weights}: not a readable safetensors file ({exc})") from None


@dataclass
class Adapter:
    """An adapter served by name: its id (new at every load), folder and base model's name."""

    name: str
    id: int
    path: Path
    base_model_name: str | None = None


def lora_targets(model: Any) -> dict[str, Target]:
    """Checkpoint module name -> Target for every projection of the model's decoder layers (those
    that say their checkpoint names: `checkpoint_parts`). ValueError for a model without them."""
    targets: dict[str, Target] = {}
    for i, layer in enumerate(getattr(model, "layers", ())):
        parts = getattr(layer, "checkpoint_parts", None)
        if parts is None:
            break
        for linear, names in parts(f"model.layers.{i}."):
            for index, name in enumerate(names):
                def rows(t: torch.Tensor, layer: Any = layer, linear: Linear = linear, index: int = index
                         ) -> torch.Tensor:
                    return layer.slice_layout(linear, index, t)
                targets[name] = Target(linear, index, rows)
    if not targets:
        raise ValueError(f"LoRA is not supported for {type(model).__name__}")
    return targets


class LoRALayers:
    """The adapters' weights in a model's projections, by id: each projection's method wrapped in
    `LoRALinearMethod`, and `install`/`evict` of one adapter's deltas. With tensor parallelism each
    rank holds its share, as its layers hold theirs: a column-parallel projection its rows of B, a
    row-parallel one its columns of A (its partial product, all-reduced with the layer's own)."""

    def __init__(self, model: Any, max_rank: int, batch: LoRABatch) -> None:
        self.max_rank = max_rank
        self.targets = lora_targets(model)
        self.methods: dict[int, LoRALinearMethod] = {}  # id(linear) -> its wrapped method
        for t in self.targets.values():
            if id(t.linear) not in self.methods:
                method = LoRALinearMethod(t.linear.method, batch)
                t.linear.method = method
                self.methods[id(t.linear)] = method

    def read(self, path: Path) -> dict[str, ModuleDelta]:
        return read_adapter(path, self.max_rank, self.targets)

    def install(self, lid: int, deltas: dict[str, ModuleDelta]) -> None:
        """Fold each projection's slices into one A [in, R] and one block-diagonal, scaled B [R, out]."""
        by_linear: dict[int, list[tuple[Target, ModuleDelta]]] = {}
        for module, delta in deltas.items():
            t = self.targets[module]
            by_linear.setdefault(id(t.linear), []).append((t, delta))
        for key, items in by_linear.items():
            linear = items[0][0].linear
            sp = linear.split
            rank = sum(d[0].shape[0] for _, d in items)
            a_cat = torch.zeros(linear.input_size, rank, dtype=linear.dtype)
            b_cat = torch.zeros(rank, linear.output_size, dtype=linear.dtype)
            at = 0
            for t, (a, b, scale) in sorted(items, key=lambda it: it[0].index):
                r = a.shape[0]
                start = sum(linear.output_sizes[: t.index])
                rows = t.rows(b.to(torch.float32) * scale)  # the layer's layout of the whole slice
                if sp is not None and not sp.row:
                    rows = rows.narrow(0, *sp.parts[t.index])  # this rank's outputs
                elif sp is not None:
                    a = a.narrow(1, *sp.parts[0])  # this rank's inputs
                a_cat[:, at : at + r] = a.t().to(linear.dtype)
                b_cat[at : at + r, start : start + linear.output_sizes[t.index]] = rows.t().to(linear.dtype)
                at += r
            self.methods[key].weights[lid] = (a_cat.to(linear.device).contiguous(),
                                              b_cat.to(linear.device).contiguous())

    def evict(self, lid: int) -> None:
        for method in self.methods.values():
            method.weights.pop(lid, None)


# What a tensor-parallel worker is told to do with its LoRALayers, in order: (id, path) installs
# the adapter read from path, (id, "") evicts it (parallel/messages.py's StepDelta.lora).
LoRAOp = tuple[int, str]


class LoRAManager:
    """The adapters served (by name), and the weights of those in the layers (LRU by id). With
    `record` (tensor parallelism: the other ranks' layers follow these), every install and eviction
    is also kept as a LoRAOp until `take_ops`."""

    def __init__(self, model: Any, config: LoRAConfig, batch: LoRABatch, record: bool = False) -> None:
        self.config = config
        self.layers = LoRALayers(model, config.max_lora_rank, batch)
        self.adapters: dict[str, Adapter] = {}
        self._next_id = 1
        self._names: dict[int, str] = {}  # every id given out -> its adapter's name
        self._resident: OrderedDict[int, Path] = OrderedDict()  # ids whose weights are in the layers
        self._ops: list[LoRAOp] | None = [] if record else None

    def take_ops(self) -> list[LoRAOp]:
        """The installs and evictions since the last call (tensor parallelism ships them each step)."""
        if self._ops is None:
            return []
        ops, self._ops = self._ops, []
        return ops

    def add(self, name: str, path: Path, base_model_name: str | None = None, inplace: bool = False) -> Adapter:
        """Serve the adapter at `path` as `name` (read and checked now). Raises LoRAError /
        LoRANotFound; a name already served is refused unless `inplace`, which replaces its weights
        (under a new id)."""
        if name in self.adapters and not inplace:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                            "in place, set 'load_inplace' to True.")
        try:
            deltas = self.layers.read(path)
        except LoRANotFound as exc:
            raise LoRANotFound(f"Loading lora {name} failed: {exc}") from None
        adapter = Adapter(name, self._next_id, path, base_model_name)
        self._next_id += 1
        self._names[adapter.id] = name
        self._install(adapter.id, path, deltas)
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        """Stop serving `name` (KeyError if not served); requests already running it finish with it."""
        self.adapters.pop(name)

    def resolve(self, name: str | None) -> int:
        """The id of adapter `name` (0 for None: the base model). ValueError when not served, in
        Triton's vLLM backend's words (the OpenAI API answers its own 404 before this)."""
        if name is None:
            return 0
        if not self.adapters.get(name):
            raise ValueError(f"LoRA {name} is not supported, we currently support "
                             f"{sorted(n for n in self.adapters if not n.startswith(INTERNAL_PREFIX))}")
        return self.adapters[name].id

    def name_of(self, lora_id: int) -> str:
        """The name adapter id `lora_id` was loaded under."""
        return self._names.get(lora_id, "")

    def activate(self, step_ids: Iterable[int], in_use: set[int]) -> None:
        """Have the weights of every adapter of the step in the layers (read again from its folder if
        it was evicted), then evict the least recently used beyond max_cpu_loras, never one that
        `in_use` (the ids unfinished requests run) names."""
        for lid in step_ids:
            if lid in self._resident:
                self._resident.move_to_end(lid)
                continue
            adapter = next((a for a in self.adapters.values() if a.id == lid), None)
            if adapter is None:  # dropped while unused: cannot happen for a running request's id
                raise RuntimeError(f"LoRA adapter id {lid} is gone")
            self._install(lid, adapter.path, self.layers.read(adapter.path))
        served = {a.id for a in self.adapters.values()}
        for lid in list(self._resident):
            over = len(self._resident) > self.config.cpu_loras
            if lid not in in_use and (over or lid not in served):
                self._evict(lid)

    def _install(self, lid: int, path: Path, deltas: dict[str, ModuleDelta]) -> None:
        self.layers.install(lid, deltas)
        self._resident[lid] = path
        if self._ops is not None:
            self._ops.append((lid, str(path)))

    def _evict(self, lid: int) -> None:
        self._resident.pop(lid, None)
        self.layers.evict(lid)
        if self._ops is not None:
            self._ops.append((lid, ""))


MULTI_LORA_FILE = "multi_lora.json"  # Triton's vLLM backend: {"name": "path"} in the version folder


def resolve_lora_modules(params: dict[str, str], version_dir: Path) -> dict[str, str]:
    """The `parameters` with `lora_modules` as a JSON list of absolute paths: a relative path in
    `lora_modules` is relative to the model's folder (the version folder's parent), one in the
    version folder's multi_lora.json (Triton's vLLM backend's form, read here when LoRA is on) to
    the version folder. ValueError naming the file or entry that is wrong."""
    modules = [m if Path(m.path).is_absolute() else replace(m, path=str(version_dir.parent / m.path))
               for m in parse_lora_modules(params.get("lora_modules", ""))]
    triton = version_dir / MULTI_LORA_FILE
    if triton.is_file() and str(params.get("enable_lora", "")).lower() in ("true", "1", "yes"):
        try:
            doc = json.loads(triton.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{triton}: {exc}") from None
        if not isinstance(doc, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
            raise ValueError(f"{triton}: must map each adapter's name to its path")
        known = {m.name for m in modules}
        modules += [LoRAModulePath(name, str(version_dir / path)) for name, path in doc.items() if name not in known]
    if not modules:
        return params
    return {**params, "lora_modules": json.dumps([{"name": m.name, "path": m.path, "base_model_name":
                                                   m.base_model_name} for m in modules])}
