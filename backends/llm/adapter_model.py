"""Adapters as versioned repository models: a model folder whose config.pbtxt says `backend: "llm"`
and `parameters { key: "base_model" ... }`, with a PEFT adapter (adapter_config.json +
adapter_model.safetensors) in each version folder, is an adapter of that base (an LLM model with
`enable_lora`). It loads, unloads and rolls out through the repository API like any model (the
manager loads its base first, as an ensemble's steps: pier.repository.disk.base_model), and shares
the base's engine and weights: each version's instance adds its adapter to the base's engine(s)
under an internal name of its own (`INTERNAL_PREFIX<model>/<version>#<n>`, hidden from the base's
adapter list) and runs its requests there with that adapter.

The base's instances say where they are (`BASES`: registered when an LLM instance is made, gone
when it closes, and its engine's health). An adapter version reports itself UNAVAILABLE, with a
reason naming the base, while no base instance serves (the base unloaded, or its engine down), and
READY again once one does: a base loaded again, or an engine core restarted, gets the adapter added
again (a restarted core serves only its startup set).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from pier.backends.llm.config import INTERNAL_PREFIX, engine_settings
from pier.contract import llm
from pier.contract.backend import InstanceContext, ModelContext, ModelInstance
from pier.contract.errors import invalid_arg, unavailable
from pier.contract.types import ExecuteResult, InferenceRequest

log = logging.getLogger("pier.llm")
ADD_TIMEOUT_S = 300.0
_seq = itertools.count(1)


class LLMInstance(Protocol):
    """What an adapter model uses of its base's instance (backend.LLMInstance)."""

    engine: Any

    def run(self, requests: Sequence[InferenceRequest], lora: str | None = None) -> list[ExecuteResult]: ...

    async def update_lora(self, name: str, path: str | None, inplace: bool) -> tuple[int, str]: ...

    def info(self) -> dict[str, Any]: ...


class _Bases:
    """The LLM instances of this process by model name, and the adapter instances that run on them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._instances: dict[str, list[LLMInstance]] = {}
        self._adapters: dict[str, set[AdapterInstance]] = {}

    def register(self, name: str, base: LLMInstance) -> None:
        with self._lock:
            self._instances.setdefault(name, []).append(base)
            adapters = list(self._adapters.get(name, ()))
        for a in adapters:
            a.base_came(base)

    def unregister(self, name: str, base: LLMInstance) -> None:
        with self._lock:
            left = [b for b in self._instances.get(name, []) if b is not base]
            self._instances[name] = left
            adapters = list(self._adapters.get(name, ()))
        for a in adapters:
            a.base_went(base, "unloaded")

    def health(self, name: str, base: LLMInstance, reason: str | None) -> None:
        with self._lock:
            adapters = list(self._adapters.get(name, ()))
        for a in adapters:
            if reason is None:
                a.base_came(base)
            else:
                a.base_went(base, reason)

    def attach(self, adapter: AdapterInstance) -> list[LLMInstance]:
        """Listen to `adapter.base`'s instances; the ones serving now."""
        with self._lock:
            self._adapters.setdefault(adapter.base, set()).add(adapter)
            return list(self._instances.get(adapter.base, []))

    def detach(self, adapter: AdapterInstance) -> None:
        with self._lock:
            self._adapters.get(adapter.base, set()).discard(adapter)


BASES = _Bases()


class AdapterInstance(ModelInstance):
    """One version of an adapter model: its adapter in its base's engines, its requests run there."""

    may_run_on_event_loop = True
    unbatched = True

    def __init__(self, ctx: ModelContext, where: InstanceContext) -> None:
        params = dict(ctx.spec.parameters)
        self.model, self.version, self.base = ctx.spec.name, ctx.version, params[llm.BASE_MODEL_PARAMETER].strip()
        what = f"adapter model '{self.model}' version {self.version}"
        if not self.base:
            raise invalid_arg(f"{what}: parameter {llm.BASE_MODEL_PARAMETER} must name the base model")
        settings = sorted(k for k in params if k in engine_settings())
        if settings:
            raise invalid_arg(f"{what}: parameter {settings[0]} is an engine setting: an adapter model runs on its "
                              f"base's engine ('{self.base}'), whose config sets it")
        from pier.backends.llm.lora import CONFIG_FILE, WEIGHTS_FILE

        self.path = ctx.version_dir
        missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (self.path / f).is_file()]
        if missing:
            raise invalid_arg(f"{what}: no PEFT adapter in {self.path} (missing {' and '.join(missing)})")
        if not ctx.spec.decoupled:
            raise invalid_arg(f"{what} must be decoupled (model_transaction_policy {{ decoupled: true }}; "
                              "auto-complete sets it)")
        if ctx.services is None:
            raise unavailable("the LLM backend runs inside the server (it streams from the server's event loop)")
        self.lora = f"{INTERNAL_PREFIX}{self.model}/{self.version}#{next(_seq)}"
        self._loop = ctx.services.event_loop
        self._report = lambda reason: ctx.report_health(where.name, reason)
        self._what = what
        self._lock = threading.Lock()
        self._serving: list[LLMInstance] = []  # base instances holding this adapter, newest last
        self._closed = False
        bases = BASES.attach(self)
        try:
            if not bases:
                raise invalid_arg(f"{what}: base model '{self.base}' is not a loaded LLM model (an adapter model's "
                                  f"{llm.BASE_MODEL_PARAMETER} names an LLM model with enable_lora)")
            for b in bases:
                if not b.engine.facts.max_loras:
                    raise invalid_arg(f"{what}: base model '{self.base}' does not serve LoRA adapters (set its "
                                      "parameter enable_lora to true)")
            for b in bases:
                status, text = self._on_loop(self._add(b)).result(ADD_TIMEOUT_S)
                if status != 200:
                    raise invalid_arg(f"{what}: {text}")
        except BaseException:
            self.close()
            raise

    # ---- the base's instances ------------------------------------------------------------

    def _on_loop(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _add(self, base: LLMInstance) -> tuple[int, str]:
        """Add the adapter to `base`'s engine (again, after its core restarted: inplace)."""
        status, text = await base.update_lora(self.lora, str(self.path), True)
        if status == 200:
            with self._lock:
                if self._closed:
                    return status, text
                self._serving = [b for b in self._serving if b is not base] + [base]
            self._report(None)
        return status, text

    def base_came(self, base: LLMInstance) -> None:
        """A base instance serves (new, or its engine restarted): add the adapter there."""
        def done(f: Future[tuple[int, str]]) -> None:
            exc = f.exception()
            if exc is not None or f.result()[0] != 200:
                log.error("%s: cannot add the adapter to base model '%s': %s", self._what, self.base,
                          exc if exc is not None else f.result()[1])
        self._on_loop(self._add(base)).add_done_callback(done)

    def base_went(self, base: LLMInstance, reason: str) -> None:
        """A base instance stopped serving (unloaded, or its engine died)."""
        with self._lock:
            self._serving = [b for b in self._serving if b is not base]
            left = bool(self._serving) or self._closed
        if not left:
            self._report(f"base model '{self.base}' is not available: {reason}")

    # ---- requests ------------------------------------------------------------------------

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        serving = self._serving
        if not serving:
            return [unavailable(f"{self._what}: base model '{self.base}' is not available") for _ in requests]
        return serving[-1].run(requests, self.lora)

    def info(self) -> dict[str, Any]:
        serving = self._serving
        facts = serving[-1].info() if serving else {}
        return {llm.INFO_MAX_MODEL_LEN: facts.get(llm.INFO_MAX_MODEL_LEN),
                llm.INFO_TOOL_CALL_PARSER: facts.get(llm.INFO_TOOL_CALL_PARSER),
                llm.INFO_LORA_PARENT: self.base, llm.INFO_LORA_ROOT: str(self.path)}

    def close(self) -> None:
        """Stop listening to the base and drop the adapter from its engines (requests still running
        it finish with it)."""
        BASES.detach(self)
        with self._lock:
            self._closed = True
            serving, self._serving = self._serving, []
        for b in serving:
            self._on_loop(_quietly(b.update_lora(self.lora, None, False)))


async def _quietly(coro: Any) -> None:
    try:
        await coro
    except Exception as exc:  # the base's engine is gone too: nothing to drop
        log.debug("dropping an adapter model's adapter: %s", exc)

