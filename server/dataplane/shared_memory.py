"""Triton's system shared memory extension. A client puts tensors in POSIX shared memory
(`shm_open` keys, files under /dev/shm on Linux; tritonclient.utils.shared_memory makes them),
registers a region (name -> key, offset, byte_size), and names the region in an input's or an
output's parameters (`shared_memory_region`, `shared_memory_byte_size`, optional
`shared_memory_offset`) instead of sending the bytes. Inputs are copied out of the region when
the request is decoded; outputs are written into theirs when the response is encoded, and the
response then carries the output's name, datatype and shape but no data.

Everything here runs on the event loop (register, unregister, decode, encode), so regions need no
lock. Error texts are Triton 2.51's (checked against it); where Triton answers a client's mistake
with 500 (a key that does not exist, an output region too small), Pier answers 400.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pier.contract.errors import ErrorCode, PierError, invalid_arg, not_found, unsupported
from pier.contract.types import Tensor
from pier.tensors.classification import class_count
from pier.tensors.datatypes import from_raw, to_raw

SHM_DIR = "/dev/shm"
PARAMS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


@dataclass(slots=True)
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    mm: mmap.mmap

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a tensor lives: `byte_size` bytes at `offset` in region `region`."""

    region: str
    byte_size: int
    offset: int


def _path(key: str) -> str | None:
    """The file behind a shm_open key: "/name" with no other slash (shm_open's own rule, which
    also keeps keys from naming files outside /dev/shm) and no NUL (no file has one)."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        return None
    return os.path.join(SHM_DIR, name)


def _uint(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise invalid_arg(f"Unable to parse '{what}': expected a non-negative integer, got {value!r}")
    return value


def placement(params: dict[str, Any]) -> Placement | None:
    """The shared-memory placement an input's or output's parameters ask for (None: none)."""
    if "shared_memory_region" not in params:
        return None
    region = params["shared_memory_region"]
    if not isinstance(region, str):
        raise invalid_arg(f"Unable to parse 'shared_memory_region': expected a string, got {region!r}")
    return Placement(region, _uint(params.get("shared_memory_byte_size", 0), "shared_memory_byte_size"),
                     _uint(params.get("shared_memory_offset", 0), "shared_memory_offset"))


def without_placement(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k not in PARAMS}


class UnopenableRegion(PierError):
    """The key names no shared memory object the server can open: a client's mistake (400 over
    HTTP); the gRPC frontend answers INTERNAL there, as tritonserver does and its clients'
    tests expect."""

    def __init__(self, key: str) -> None:
        super().__init__(ErrorCode.INVALID_ARG, f"Unable to open shared memory region: '{key}'")


class SystemSharedMemory:
    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}
        self._users: dict[str, int] = {}  # region -> requests in flight that name it (see `use`)

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if name in self._regions:
            raise PierError(ErrorCode.ALREADY_EXISTS, f"shared memory region '{name}' already in manager")
        if any(r.key == key for r in self._regions.values()):  # as Triton 2.51: one region per key
            raise invalid_arg(f"Invalid shared memory region: '{key}'")
        path = _path(key)
        fd = -1
        try:
            if path is None:
                raise OSError
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OSError
        except OSError:
            if fd >= 0:
                os.close(fd)
            raise UnopenableRegion(key) from None
        if byte_size <= 0 or offset + byte_size > info.st_size:
            os.close(fd)
            raise invalid_arg(f"failed to register shared memory region '{name}': invalid args")
        try:
            mm = mmap.mmap(fd, info.st_size)
        except (OSError, ValueError) as exc:
            os.close(fd)
            raise invalid_arg(f"failed to register shared memory region '{name}': {exc}") from None
        self._regions[name] = _Region(name, key, offset, byte_size, fd, mm)

    def unregister(self, name: str = "") -> None:
        """One region, or all when `name` is empty; an unknown name is not an error (as Triton).
        A region that a request in flight names cannot go: unregistering it alone fails, and
        unregistering all removes the others and names those that stay."""
        if name and self._users.get(name):
            raise invalid_arg(f"Cannot unregister shared memory region '{name}', it is currently in use.")
        busy = sorted(n for n in self._regions if self._users.get(n)) if not name else []
        for n in [name] if name else list(self._regions):
            if n not in busy and (region := self._regions.pop(n, None)) is not None:
                region.close()
        if busy:  # as Triton: the free ones go, and the answer lists the others in its words
            raise invalid_arg("Failed to unregister the following system shared memory regions: "
                              + "".join(f"{n} ," for n in busy) + " (in use by requests in flight)")

    def status(self, name: str = "") -> list[dict[str, Any]]:
        if name and name not in self._regions:
            raise not_found(f"Unable to find system shared memory region: '{name}'")
        regions = [self._regions[name]] if name else list(self._regions.values())
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]

    def _span(self, where: Placement) -> tuple[_Region, int]:
        """The region and the absolute file offset of `where`, checked against the region and
        against the file as it is now (a client may have shrunk it: touching a mapping past the
        end of its file kills the process with SIGBUS)."""
        region = self._regions.get(where.region)
        if region is None:
            raise not_found(f"Unable to find shared memory region: '{where.region}'")
        if where.offset >= region.byte_size:
            raise invalid_arg(f"Invalid offset for shared memory region: '{where.region}' (offset {where.offset}, "
                              f"the region holds {region.byte_size} bytes)")
        if where.byte_size == 0 or where.offset + where.byte_size > region.byte_size:
            raise invalid_arg(f"Invalid offset + byte size for shared memory region: '{where.region}'")
        start = region.offset + where.offset
        if start + where.byte_size > min(os.fstat(region.fd).st_size, len(region.mm)):
            raise invalid_arg(f"shared memory region '{where.region}' is smaller than when it was registered")
        return region, start

    def check(self, where: Placement) -> None:
        """Fail now (at decode) for an output placement that can never be written."""
        self._span(where)

    def read(self, where: Placement) -> bytes:
        """A copy of the bytes (the client may rewrite or unregister the region while the request runs)."""
        region, start = self._span(where)
        return region.mm[start:start + where.byte_size]

    def write(self, where: Placement, blob: bytes, output: str) -> None:
        region, start = self._span(where)
        if len(blob) > where.byte_size:
            raise invalid_arg(
                f"shared memory size specified with the request for output '{output}' ({where.byte_size} bytes) "
                f"should be at least {len(blob)} bytes to hold the results"
            )
        region.mm[start:start + len(blob)] = blob

    def close(self) -> None:
        self._users.clear()
        self.unregister()

    @contextlib.contextmanager
    def holding(self, names: Sequence[str]) -> Iterator[None]:
        """A request in flight holds the regions it names, from decode to its answer."""
        self.use(names)
        try:
            yield
        finally:
            self.done(names)

    def use(self, names: Sequence[str]) -> None:
        for n in names:
            self._users[n] = self._users.get(n, 0) + 1

    def done(self, names: Sequence[str]) -> None:
        for n in names:
            left = self._users.get(n, 0) - 1
            if left > 0:
                self._users[n] = left
            else:
                self._users.pop(n, None)


# ---- what the frontends' codecs call --------------------------------------------------------

def read_input(shm: SystemSharedMemory | None, params: dict[str, Any], datatype: str, shape: list[int],
               name: str, model: str, request_id: str) -> np.ndarray:
    """The input tensor the parameters place in shared memory, checked against datatype and shape."""
    where = placement(params)
    assert where is not None
    if shm is None:
        raise unsupported("shared-memory inputs are not supported by this endpoint")
    return from_raw(memoryview(shm.read(where)), datatype, shape, name, model, request_id)


def check_output(params: dict[str, Any], shm: SystemSharedMemory | None) -> None:
    """A requested output's parameters, checked before the request runs: the classification
    count and the shared-memory placement."""
    class_count(params)
    if "classification" in params and "shared_memory_region" in params:
        raise invalid_arg("Output can't set both 'shared_memory_region' and 'classification'")
    where = placement(params)
    if where is None:
        return
    if params.get("binary_data") is True:  # tritonclient sends binary_data: false with a region
        raise invalid_arg("Output can't set both 'shared_memory_region' and 'binary_data'")
    if shm is None:
        raise unsupported("shared-memory outputs are not supported by this endpoint")
    shm.check(where)


def write_output(shm: SystemSharedMemory, t: Tensor, params: dict[str, Any]) -> bool:
    """Write output `t` where its request parameters place it; False when they place it nowhere."""
    where = placement(params)
    if where is None:
        return False
    shm.write(where, to_raw(t.data, t.datatype), t.name)
    return True


def regions_named(inputs: list[Any], outputs: list[Any]) -> tuple[str, ...]:
    """The regions a decoded request names: `inputs` as JSON objects (HTTP) or protobuf tensors
    (gRPC) whose parameters name them, `outputs` as RequestedOutputs."""
    names = []
    for t in inputs:
        params = t.get("parameters") if isinstance(t, dict) else t.parameters
        if params and "shared_memory_region" in params:
            region = params["shared_memory_region"]
            names.append(region if isinstance(region, str) else region.string_param)
    for o in outputs:
        if "shared_memory_region" in o.parameters:
            names.append(o.parameters["shared_memory_region"])
    return tuple(names)


def cuda_register(name: str) -> None:
    """CUDA shared memory: Pier maps no CUDA IPC handles, so every handle is refused, in the
    words tritonserver uses for a handle it cannot open (its clients match them)."""
    raise invalid_arg(f"failed to register shared memory region '{name}': invalid args (CUDA shared memory "
                      "is not supported by this server: use system shared memory)")


def cuda_status(name: str = "") -> list[dict[str, Any]]:
    """CUDA shared memory: no region can be registered, so the status is empty and a named
    region is unknown."""
    if name:
        raise not_found(f"Unable to find cuda shared memory region: '{name}'")
    return []
