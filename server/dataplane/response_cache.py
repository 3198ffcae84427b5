"""Triton's response cache: `--cache-config local,size=BYTES` turns it on for the server, and a
model's `response_cache { enable: true }` for that model. A request whose inputs (names,
datatypes, shapes, bytes) and requested outputs equal an earlier successful one's gets that
earlier answer without running the model.

As the reference Triton 2.51 behaves (probed): a hit counts as a successful request (success and
queue statistics, and `cache_hit` with the lookup time) but not as an inference or execution; a
miss counts `cache_miss` with the insertion time; the answer carries the new request's id.
Unlike Triton 2.51, the requested outputs are part of the key (Triton answered a request for one
output with every output of an earlier request), and so is the model's load: a reloaded model
never answers from what the previous load computed (Triton 2.51 does). Least recently used entries are evicted past the
size; an entry larger than the whole cache is not kept. A decoupled model with the cache on is a
load error (Triton's); sequence models are never cached.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pier.contract.types import InferenceRequest, Tensor
from pier.tensors.datatypes import to_raw

_Entry = tuple[list[Tensor], int]


def parse_cache_config(items: Sequence[str]) -> int:
    """The local cache's size in bytes from tritonserver's `--cache-config` items (0: no cache).
    Items are `local,size=N` (or `local,KEY=VALUE` for other keys); other caches are refused."""
    size = 0
    for item in items:
        name, sep, setting = item.partition(",")
        key, eq, value = setting.partition("=")
        if not sep or not eq:
            raise ValueError(f"--cache-config={item}: expected <cache name>,<key>=<value>")
        if name != "local":
            raise ValueError(f"--cache-config={item}: only the 'local' cache is available")
        if key == "size":
            try:
                size = int(value)
            except ValueError:
                raise ValueError(f"--cache-config={item}: size must be a number of bytes") from None
            if size < 0:
                raise ValueError(f"--cache-config={item}: size must be >= 0")
    return size


def _tensor_bytes(t: Tensor) -> int:
    return sum(len(x) + 4 for x in t.data.reshape(-1)) if t.datatype == "BYTES" else int(t.data.nbytes)


class ResponseCache:
    """LRU over whole responses, bounded in bytes; used on the event loop only."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.used = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # Cache-wide totals (nv_cache_num_* and nv_cache_*_duration, in microseconds)
        self.hits = self.misses = self.evictions = 0
        self.lookup_us = self.insertion_us = 0.0

    @staticmethod
    def key(model: str, load_id: int, request: InferenceRequest) -> bytes:
        """`load_id`: one load of the model version, so a reload never answers from the old one."""
        h = hashlib.blake2b(digest_size=20)
        h.update(f"{model}\0{load_id}\0".encode())
        for t in sorted(request.inputs, key=lambda t: t.name):
            h.update(f"{t.name}\0{t.datatype}\0{t.data.shape}\0".encode())
            h.update(to_raw(t.data, t.datatype))
        outputs = sorted((o.name, sorted((k, repr(v)) for k, v in o.parameters.items() if k != "binary_data"))
                         for o in request.outputs)  # classification changes the answer; binary_data does not
        h.update(repr(outputs).encode())
        return h.digest()

    def lookup(self, model: str, load_id: int, request: InferenceRequest) -> tuple[bytes, list[Tensor] | None, int]:
        """(the request's key, the cached outputs or None, nanoseconds the lookup took)."""
        start = time.perf_counter_ns()
        key = self.key(model, load_id, request)
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            outputs = None
        else:
            self.hits += 1
            self._entries.move_to_end(key)
            outputs = [Tensor(t.name, t.datatype, list(t.shape), t.data) for t in entry[0]]
        elapsed = time.perf_counter_ns() - start
        self.lookup_us += elapsed / 1000
        return key, outputs, elapsed

    def insert(self, key: bytes, outputs: list[Tensor]) -> int:
        """Keep a successful answer; the nanoseconds that took."""
        start = time.perf_counter_ns()
        self._put(key, outputs)
        elapsed = time.perf_counter_ns() - start
        self.insertion_us += elapsed / 1000
        return elapsed

    def _put(self, key: bytes, outputs: list[Tensor]) -> None:
        size = sum(_tensor_bytes(t) for t in outputs)
        if size > self.capacity or key in self._entries:
            return
        kept = []
        for t in outputs:
            data = np.array(t.data, copy=True)
            data.flags.writeable = False  # shared by every later hit
            kept.append(Tensor(t.name, t.datatype, list(t.shape), data))
        self._entries[key] = (kept, size)
        self.used += size
        while self.used > self.capacity:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.used -= evicted
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)
