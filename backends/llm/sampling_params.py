"""Per-request sampling settings: frozen, validated once, named as vLLM names them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .structured import StructuredOutputs

_INT_FIELDS = {"max_tokens", "top_k", "seed", "n", "logprobs", "min_tokens", "prompt_logprobs", "priority"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "embed"}


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `temperature == 0` is greedy. `top_k` of -1 or 0 means no top-k. `logprobs` is None (none),
    0 (the chosen token's logprob only) or k (the chosen token plus the k most likely).
    `stop` strings are cut from the output text; `stop_token_ids` end the sequence like EOS
    (their text is kept). `seed` makes a sampled request reproducible regardless of what else
    is in the batch.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # logprob of each prompt token (+ this many alternatives)
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), clamped to [-100, 100]
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must follow (structured.py)
    priority: int = 0  # scheduling_policy "priority": lower runs first (vLLM's request priority)
    embed: bool = False  # nothing is generated: the answer is the prompt's embedding (last token, L2-normalised)
    # the LoRA adapter to run (lora.py; Triton's vLLM backend takes it in sampling_parameters), None: the base
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), min(100.0, max(-100.0, float(b)))) for t, b in bias))
        self._validate()

    def _validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:  # NaN and inf too: they would poison the sampling step
            raise ValueError(f"temperature must be a finite non-negative number, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number greater than zero, got "
                             f"{self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.n > 1 and self.greedy:
            raise ValueError("n must be 1 when using greedy sampling")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got "
                             f"{self.min_tokens}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**64 - self.n:  # torch's generator seeds
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if any(t < 0 for t, _ in self.logit_bias):
            raise ValueError("logit_bias keys must be non-negative token ids")

    @property
    def greedy(self) -> bool:
        """Whether decoding is argmax (temperature 0)."""
        return self.temperature < 1e-5

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SamplingParams:
        """Build from a JSON object (Triton vLLM `sampling_parameters`, an OpenAI body's fields).

        Numbers may arrive as strings (Triton clients often send them so). A key this engine does
        not implement is refused, not ignored (as Triton's vLLM backend's SamplingParams(**params)
        refuses it): a request must not be answered as if it had been honoured.
        Raises ValueError naming the bad field.
        """
        if not isinstance(obj, Mapping):
            raise ValueError("sampling parameters must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k, v in obj.items() if k not in known and v is not None)
        if unknown:
            raise ValueError(f"unsupported sampling parameter(s): {', '.join(unknown)}")
        kwargs: dict[str, Any] = {}
        for key, value in obj.items():
            if key not in known:
                continue
            elif value is None:
                if key in ("max_tokens", "seed", "logprobs"):
                    kwargs[key] = None
            elif key == "lora_name":
                if not isinstance(value, str) or not value:
                    raise ValueError(f"invalid value for lora_name: {value!r}")
                kwargs[key] = value
            elif key == "structured_outputs":
                kwargs[key] = value if isinstance(value, StructuredOutputs) else StructuredOutputs.from_json(value)
            else:
                kwargs[key] = _coerce(key, value)
        return cls(**kwargs)


def _coerce(key: str, value: Any) -> Any:
    try:
        if key in _BOOL_FIELDS:
            if isinstance(value, str):
                low = value.strip().lower()
                if low not in ("true", "false", "1", "0"):
                    raise ValueError
                return low in ("true", "1")
            if not isinstance(value, (bool, int)):
                raise ValueError
            return bool(value)
        if key in _INT_FIELDS:
            if isinstance(value, bool):
                if key == "logprobs":  # chat-style `logprobs: true`
                    return 0 if value else None
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if key in _FLOAT_FIELDS:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if key == "stop":
            if isinstance(value, str):
                return (value,)
            if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
                return tuple(value)
            raise ValueError
        if key == "logit_bias":  # OpenAI's shape: {"token id": bias}, ids as strings in JSON
            if not isinstance(value, Mapping):
                raise ValueError
            out = []
            for t, b in value.items():
                if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
                    raise ValueError
                out.append((int(t), float(b)))
            return tuple(out)
        if key == "stop_token_ids":
            if isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                return tuple(value)
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"invalid value for {key}: {value!r}") from None
    raise ValueError(f"invalid value for {key}: {value!r}")
