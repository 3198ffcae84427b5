"""Triton's python backend contract (`backend: "python"`, file `model.py`): a class
`TritonPythonModel` with `initialize(args)`, `execute(requests)` -> responses (or None for
decoupled models, which answer through response senders), `finalize()`; models import
`triton_python_backend_utils` (backends/python/triton_python_backend_utils.py).

Where models run (`execution_mode`, a model config parameter, `process` or `in_process`; the
server-wide default is `--backend-config=python,execution-mode=...`, itself `process`):

- `process` (as Triton): each instance in its own stub process (backends/python/process.py,
  backends/python/stub.py), which loads model.py with the same `PythonInstance` as below, so
  pb_utils is the same. A model that exits, segfaults or is killed for its memory fails only its
  own requests; its process restarts (bounded) and nothing else notices. Each request pays a
  round trip to the child (tens of microseconds; bench/python_backend_process.py), and Triton's
  `EXECUTION_ENV_PATH` (backends/python/env.py) can give a model its own packed environment.
- `in_process`: each instance on its own worker thread in the server. No IPC, BLS is a direct call
  into the data plane; the price is isolation: a model that crashes the interpreter takes the
  server with it, and models share the GIL with the server.

Either way a model that raises, returns errors or wrong counts fails only its own requests, and
`execute` may be `async def` (each instance keeps its own event loop for it).
`auto_complete_config` runs in the server process (it must before any instance exists), and only
for a model.py that may define one (it names it, or takes its class from another module): other
models are not imported by the server at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import os
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pier.backends.python import triton_python_backend_utils as pb_utils
from pier.backends.python.bls import BlsClient, error_of, to_pb_request, to_pier_tensor
from pier.contract.backend import Backend, InstanceContext, ModelContext, ModelInstance
from pier.contract.errors import internal, invalid_arg, unavailable
from pier.contract.types import ExecuteResult, InferenceRequest, ModelSignature, Outputs

sys.modules.setdefault("triton_python_backend_utils", pb_utils)
_import_lock = threading.RLock()  # models load on several threads; sys.path and sys.modules are shared
_counter = 0


def _load_module(path: Path, model: str) -> Any:
    global _counter
    with _import_lock:
        _counter += 1
        name = f"pier_python_model_{_counter}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise unavailable(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        folder = str(path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # as Triton: model.py may import its siblings
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise unavailable(f"failed to import {path} for model '{model}': {type(exc).__name__}: {exc}") from None
    return module


class PythonInstance(ModelInstance):
    may_run_on_event_loop = False  # execute may block on BLS calls into the server
    unbatched = True  # Triton hands execute() the list of requests, never a merged batch

    def __init__(self, ctx: ModelContext, where: InstanceContext) -> None:
        self._ctx = ctx
        self._spec = ctx.spec
        self._decoupled = ctx.spec.decoupled
        self._iterative = ctx.spec.sequence is not None and ctx.spec.sequence.iterative  # RESCHEDULE runs it again
        self._out_types = {t.name: t.datatype for t in ctx.spec.outputs}
        self._out_names = list(self._out_types)
        self._loop: asyncio.AbstractEventLoop | None = None
        path = ctx.model_path
        if not path.is_file():
            raise unavailable(f"python model '{ctx.spec.name}' has no {path.name} in {path.parent}")
        module = _load_module(path, ctx.spec.name)
        cls = getattr(module, "TritonPythonModel", None)
        if cls is None:
            raise unavailable(f"{path} defines no class TritonPythonModel")
        self._model = cls()
        args = {
            "model_config": ctx.config_json,
            "model_instance_kind": "GPU" if where.kind == "KIND_GPU" else "CPU",
            "model_instance_name": where.name,
            "model_instance_device_id": str(where.device_id or 0),
            "model_repository": str(ctx.model_dir),
            "model_version": str(ctx.version),
            "model_name": ctx.spec.name,
        }
        if hasattr(self._model, "initialize"):
            try:
                self._call(self._model.initialize, args)
            except Exception as exc:
                pb_utils.release_metric_families(self)  # what it made before failing goes with it
                raise unavailable(f"initialize() of python model '{ctx.spec.name}' failed: "
                                  f"{type(exc).__name__}: {exc}") from None

    def _call(self, fn: Any, *args: Any) -> Any:
        pb_utils._owner.current = self  # custom metric families made now belong to this instance
        try:
            result = fn(*args)
            if inspect.iscoroutine(result):
                if self._loop is None:
                    self._loop = asyncio.new_event_loop()
                result = self._loop.run_until_complete(result)
            return result
        finally:
            pb_utils._owner.current = None

    def prometheus(self, model: str, version: str) -> str:
        return pb_utils.render_metric_families(self)

    def _to_result(self, response: Any) -> ExecuteResult:
        if not isinstance(response, pb_utils.InferenceResponse):
            return internal(f"python model '{self._spec.name}' returned {type(response).__name__}, "
                            "expected pb_utils.InferenceResponse")
        error = response.error()
        if error is not None:
            return error_of(error)
        try:
            # as Triton: a tensor the config does not declare is not part of the response
            tensors = [to_pier_tensor(t, self._out_types[t.name()]) for t in response.output_tensors()
                       if t.name() in self._out_types]
        except Exception as exc:
            return internal(f"python model '{self._spec.name}' returned an unusable tensor: {exc}")
        raw = response.parameters()
        if raw in ("", "{}"):
            return Outputs(tensors)
        try:
            parameters = json.loads(raw)
        except ValueError:
            parameters = None
        if not isinstance(parameters, dict) or not all(
                isinstance(v, (bool, int, str)) and not (isinstance(v, int) and not -2**63 <= v < 2**63)
                for v in parameters.values()):
            return internal(f"python model '{self._spec.name}' returned response parameters that are not a "
                            f"JSON object of bool, int or str values: {raw[:200]}")
        return Outputs(tensors, parameters)

    def execute(self, requests: Sequence[InferenceRequest]) -> list[ExecuteResult]:
        pb_requests = [to_pb_request(r, self._out_names) for r in requests]
        for r in pb_requests:
            r._to_result = self._to_result
        try:
            responses = self._call(self._model.execute, pb_requests)
        except Exception as exc:
            message = (f"Failed to process the request(s) for model '{self._spec.name}', message: "
                       f"{type(exc).__name__}: {exc}")
            if isinstance(exc, pb_utils.TritonModelException):
                message = f"Failed to process the request(s) for model '{self._spec.name}', message: {exc}"
            return [internal(message)] * len(requests)
        rescheduled = [bool(r._release_flags & pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE) for r in pb_requests]
        if self._decoupled:
            if responses is not None:
                return [invalid_arg(f"decoupled python model '{self._spec.name}' must return None from "
                                    "execute() and answer through response senders")] * len(requests)
            results: list[ExecuteResult] = [Outputs([]) for _ in requests]
        elif responses is None and all(r._sender is not None for r in pb_requests):
            results = [self._answer(r) for r in pb_requests]  # answered through response senders
        elif responses is None or len(responses) != len(requests):
            got = "None" if responses is None else str(len(responses))
            return [internal(f"python model '{self._spec.name}' returned {got} responses for "
                             f"{len(requests)} requests")] * len(requests)
        else:  # a rescheduled request's entry (None, as Triton asks) is not a response
            results = [Outputs([]) if again else self._to_result(resp) for again, resp in zip(rescheduled, responses)]
        for i, again in enumerate(rescheduled):
            if again:
                results[i] = Outputs([], reschedule=True) if self._iterative else internal(
                    f"Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, but model "
                    f"'{self._spec.name}' does not use iterative sequence batching (sequence_batching "
                    "{ iterative_sequence: true })")
        return results

    def _answer(self, request: pb_utils.InferenceRequest) -> ExecuteResult:
        """The one response a model that is not decoupled sent through `request`'s sender (it may
        send after execute() returned: wait for its FINAL flag)."""
        assert request._answered is not None  # made with its sender
        request._answered.wait()
        if not request._answer:
            return internal(f"python model '{self._spec.name}' closed a response sender without a response")
        return self._to_result(request._answer[0])

    def close(self) -> None:
        if hasattr(self._model, "finalize"):
            try:
                self._call(self._model.finalize)
            except Exception:  # finalize failing must not stop the unload
                pass
        pb_utils.release_metric_families(self)
        if self._loop is not None:
            self._loop.close()


MODE_PARAMETER = "execution_mode"
MODES = ("process", "in_process")
# Triton's python-backend settings: accepted so its command lines run, no effect here (Pier keeps
# no shared-memory pool per stub: tensors over 64 KiB go through a memfd per message).
TRITON_SETTINGS = ("shm-default-byte-size", "shm-growth-byte-size", "shm-message-queue-size",
                   "shm_message_queue_size", "stub-timeout-seconds", "shm-region-prefix-name", "thread-pool-size")


@dataclass(frozen=True)
class PythonSettings:
    """`--backend-config=python,KEY=VALUE`: the server-wide defaults of this backend."""

    execution_mode: str = "process"
    restart_limit: int = 5  # stub restarts allowed per instance within restart_window_s
    restart_window_s: float = 600.0
    ignored: tuple[str, ...] = ()  # Triton's settings given, with no effect here

    @staticmethod
    def parse(settings: dict[str, str]) -> PythonSettings:
        """Raises ValueError naming the key for an unknown key or a bad value."""
        mode, limit, window, ignored = "process", 5, 600.0, []
        for key, value in settings.items():
            if key == "execution-mode":
                if value not in MODES:
                    raise ValueError(f"--backend-config python,execution-mode={value}: expected one of "
                                     f"{', '.join(MODES)}")
                mode = value
            elif key == "stub-restart-limit":
                if not value.isdigit():
                    raise ValueError(f"--backend-config python,stub-restart-limit={value}: expected a count >= 0")
                limit = int(value)
            elif key == "stub-restart-window-seconds":
                try:
                    window = float(value)
                except ValueError:
                    window = -1.0
                if not window > 0:
                    raise ValueError(f"--backend-config python,stub-restart-window-seconds={value}: expected "
                                     "seconds > 0")
            elif key in TRITON_SETTINGS:
                ignored.append(key)
            else:
                raise ValueError(f"--backend-config python,{key}={value}: unknown setting '{key}' of the python "
                                 "backend (known: execution-mode, stub-restart-limit, stub-restart-window-seconds, "
                                 f"and Triton's {', '.join(TRITON_SETTINGS)}, accepted without effect)")
        return PythonSettings(mode, limit, window, tuple(ignored))


# `class TritonPythonModel:` with no base class (or `(object)`): every method it has is in this file
_OWN_CLASS = re.compile(r"^class\s+TritonPythonModel\s*(\(\s*(object)?\s*\))?\s*:", re.MULTILINE)


def _may_auto_complete(model_path: Path) -> bool:
    """Whether importing model.py may find an `auto_complete_config`: it names one, or it does not
    define TritonPythonModel itself with no base class (it takes the class, or a base class, from
    another module, as Triton's QA models do with `from python_addsub import *`), so only the
    import can tell."""
    try:
        text = model_path.read_text(errors="replace")
    except OSError:
        return True  # let the import report it
    return "auto_complete_config" in text or _OWN_CLASS.search(text) is None


@contextlib.contextmanager
def _imports_forgotten(model_dir: Path) -> Iterator[None]:
    """The server imports a model.py only to auto-complete its config: afterwards its folder
    leaves sys.path again and the modules loaded from the model's own folder leave sys.modules,
    so that another model's sibling of the same name (`impl.py`), or this one's edited for a
    reload, is imported afresh. Libraries it imported (numpy, torch) stay: they cannot be
    imported twice."""
    with _import_lock:  # held throughout: another model's import must not see this one's folder
        path = list(sys.path)
        known = set(sys.modules)
        root = str(model_dir.resolve())
        try:
            yield
        finally:
            sys.path[:] = path
            for name in set(sys.modules) - known:
                where = getattr(sys.modules.get(name), "__file__", None) or ""
                if where and os.path.realpath(where).startswith(root + os.sep):
                    del sys.modules[name]


class PythonBackend(Backend):
    name = "python"
    default_model_filename = "model.py"

    def __init__(self) -> None:
        self.settings = PythonSettings()

    def configure(self, settings: dict[str, str]) -> tuple[str, ...]:
        """`--backend-config=python,...` (server/repository/backend_registry.py): raises ValueError for an
        unknown key or a bad value; returns the keys given that have no effect here."""
        self.settings = PythonSettings.parse(settings)
        return self.settings.ignored

    def describe(self, model_path: Path) -> ModelSignature | None:
        """Triton's auto-complete: a model's `auto_complete_config(auto_complete_model_config)`
        static method declares its inputs, outputs, max_batch_size and transaction policy. A
        model.py that defines its own TritonPythonModel without naming it is not imported (nor
        run) by the server (_may_auto_complete)."""
        if not _may_auto_complete(model_path):
            return None
        with _imports_forgotten(model_path.parent.parent):
            module = _load_module(model_path, model_path.parent.parent.name)
            cls = getattr(module, "TritonPythonModel", None)
            hook = getattr(cls, "auto_complete_config", None)
            if hook is None:
                return None
            config = pb_utils.ModelConfig({"name": model_path.parent.parent.name})
            try:
                hook(config)
            except Exception as exc:
                raise unavailable(f"auto_complete_config() of {model_path} failed: {type(exc).__name__}: "
                                  f"{exc}") from None
        doc = config.as_dict()

        def tensors(kind: str) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
            out = []
            for t in doc.get(kind, []):
                datatype = str(t["data_type"])
                datatype = datatype[len("TYPE_"):] if datatype.startswith("TYPE_") else datatype
                out.append((t["name"], "BYTES" if datatype == "STRING" else datatype,
                            tuple(int(d) for d in t["dims"])))
            return tuple(out)

        return ModelSignature(
            tensors("input"), tensors("output"),
            optional_inputs=tuple(t["name"] for t in doc.get("input", []) if t.get("optional")),
            decoupled=bool(doc.get("model_transaction_policy", {}).get("decoupled", False)),
            max_batch_size=int(doc["max_batch_size"]) if "max_batch_size" in doc else None,
            dynamic_batching="dynamic_batching" in doc, shapes_include_batch=False)

    def create_instance(self, model: ModelContext, instance: InstanceContext) -> ModelInstance:
        from pier.backends.python import env, process

        packed = model.spec.parameters.get(env.ENV_PARAMETER, "")
        # a packed environment needs a process: it is the mode, unless the model says otherwise
        mode = model.spec.parameters.get(MODE_PARAMETER, "") or ("process" if packed else self.settings.execution_mode)
        if mode not in MODES:
            raise invalid_arg(f"model '{model.spec.name}': parameter '{MODE_PARAMETER}' is '{mode}', expected one of "
                              f"{', '.join(MODES)}")
        if mode == "in_process":
            if packed:
                raise invalid_arg(f"model '{model.spec.name}': {env.ENV_PARAMETER} needs the process execution mode "
                                  f"(parameter '{MODE_PARAMETER}' is in_process)")
            if model.services is not None:
                pb_utils._bls = BlsClient(model.services)
            return PythonInstance(model, instance)
        launch = env.launch_for(packed, model.spec.name, model.model_dir) if packed else process.default_launch()
        return process.ProcessInstance(model, instance, launch, self.settings.restart_limit,
                                       self.settings.restart_window_s)


BACKEND = PythonBackend()
