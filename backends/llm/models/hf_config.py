"""config.json, normalised: the architecture facts a model file builds itself from.

Reads the config.json of transformers 4.x (`rope_theta` and `rope_scaling`) and of 5.x (`rope_parameters`,
which holds the theta too, or one such mapping per layer type), `head_dim` where the config gives one
(heads × head_dim need not equal the hidden size), and the EOS ids of generation_config.json. What
differs by architecture (Qwen2's q/k/v biases, when a sliding window is on) is the model file's
`arch_config` (models/registry.py); `raw` keeps the whole file for such fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ArchConfig:
    """One model's shape and numerics (vLLM's `hf_config`, normalised)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]  # rope_type, rope_theta and the scaling kind's own keys (layers/rotary.py)
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)
    # per layer, "sliding_attention" or "full_attention" (transformers 5.x's `layer_types`); empty:
    # every layer slides when there is a `sliding_window`
    layer_types: tuple[str, ...] = ()

    @property
    def rope_theta(self) -> float:
        return float(self.rope["rope_theta"])

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (it attends to that many last positions), 0 for full attention."""
        if not self.sliding_window or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return 0
        return self.sliding_window


def read_config(folder: Path) -> dict[str, Any]:
    """config.json as a dict, with generation_config.json's EOS ids added to `eos_token_id`."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in {folder}")
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    eos = _ids(raw.get("eos_token_id"))
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        eos = eos + tuple(i for i in _ids(gen.get("eos_token_id")) if i not in eos)
    return {**raw, "eos_token_id": list(eos)}


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings of either transformers generation, as one mapping with `rope_type` and `rope_theta`.

    5.x nests one mapping per layer type where layers differ (Gemma 3); the full-attention layers'
    is taken here (a model whose layers differ reads `raw["rope_parameters"]` itself)."""
    params = raw.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        params = params.get("full_attention") or next(v for v in params.values() if v)
    out: dict[str, Any] = {**(raw.get("rope_scaling") or {}), **params}
    kind = out.get("rope_type", out.get("type", "default"))
    kind = {"su": "longrope"}.get(kind, kind)  # early Phi-3 configs' name for it
    out.pop("type", None)  # 4.x's name for rope_type
    out["rope_type"] = kind
    out.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in raw:
        out.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if kind in ("llama3", "yarn", "longrope"):
        out.setdefault("original_max_position_embeddings",
                       raw.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 2048))
    return out


def arch_config(raw: dict[str, Any], architecture: str) -> ArchConfig:
    """The facts every decoder here shares, read as Llama reads them. Raises ValueError naming a
    missing or malformed field."""
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        attention_bias = bool(raw.get("attention_bias", False))
        sliding = raw.get("sliding_window")
        return ArchConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope_parameters(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=str(raw.get("hidden_act", "silu")),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_ids=_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            sliding_window=int(sliding) if sliding else None,
            raw=raw,
            layer_types=tuple(str(t) for t in raw.get("layer_types") or ()),
        )
    except KeyError as exc:
        raise ValueError(f"config.json has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config.json: {exc}") from None


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
