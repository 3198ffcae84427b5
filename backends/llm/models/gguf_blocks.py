"""GGUF's quantized blocks brought to `layers/quantized.PackedWeight` at load, keeping their integer
codes and per-block scales (and mins): the projections multiply the blocks' own numbers
(csrc/quant_linear.cpp), nothing is de-quantized to float.

Each type's layout and arithmetic are gguf-py's (`gguf.quants`, which transformers de-quantizes
with, and llama.cpp's ggml-quants.c): a weight row [K] is K / block_size blocks of bytes, and

| type | block | per block                            | weight                   | here                         |
|------|-------|--------------------------------------|--------------------------|------------------------------|
| Q8_0 | 32    | d f16, 32 int8                       | d * q                    | 8-bit q + 128, zero 128      |
| Q4_0 | 32    | d f16, 16 bytes of nibbles           | d * (q - 8)              | 4-bit, zero 8                |
| Q4_1 | 32    | d, m f16, 16 bytes of nibbles        | d * q + m                | 4-bit, offset m              |
| Q5_0 | 32    | d f16, 32 high bits, nibbles         | d * (q - 16)             | 8-bit container, zero 16     |
| Q5_1 | 32    | d, m f16, 32 high bits, nibbles      | d * q + m                | 8-bit container, offset m    |
| Q4_K | 256   | d, dmin f16, 8 x 6-bit (sc, m)       | (d * sc) * q - dmin * m  | 4-bit, group 32, offset -dm  |
| Q5_K | 256   | as Q4_K, 256 high bits               | (d * sc) * q - dmin * m  | 8-bit container, group 32    |
| Q6_K | 256   | 4+2-bit codes, 16 x int8 sc, d f16   | (d * sc) * (q - 32)      | 8-bit container, group 16    |

The scales (d * sc) and mins (dmin * m) are computed in float32 as gguf-py computes them, the codes'
subtractions are exact integers, and q * s - dm equals q * s + (-dm) bit for bit: the kernel's weight
is gguf-py's de-quantized float.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..layers.quantized import PackedWeight

_QK_K = 256


def _f32(half: np.ndarray) -> np.ndarray:
    """Two bytes per row -> their float16 as float32 [rows]."""
    return np.ascontiguousarray(half).view(np.float16).astype(np.float32).reshape(-1)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[B, n * width / 2] bytes -> [B, n, width] codes: each run of width / 2 bytes gives its low
    nibbles, then its high nibbles (the order of every GGUF 4-bit layout)."""
    b = qs.reshape(qs.shape[0], -1, 1, width // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (b & np.uint8(0x0F)).reshape(qs.shape[0], -1, width)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes (a little-endian uint32) -> bit i of it for code i, [B, 32] uint8."""
    words = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1)
    return ((words >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & np.uint32(1)).astype(np.uint8)


# Each returns (codes [B, block] uint8, scales [B, groups] float32, zeros or mins [B, groups] float32)
# for B blocks [B, bytes]; the table below says the bits, group and form.
def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f32(b[:, :2])
    codes = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d[:, None], np.full_like(d[:, None], 128.0)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f32(b[:, :2])
    return _nibbles(b[:, 2:], 32).reshape(-1, 32), d[:, None], np.full_like(d[:, None], 8.0)


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:], 32).reshape(-1, 32), _f32(b[:, :2])[:, None], _f32(b[:, 2:4])[:, None]


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f32(b[:, :2])
    codes = _nibbles(b[:, 6:], 32).reshape(-1, 32) | (_high_bits32(b[:, 2:6]) << np.uint8(4))
    return codes, d[:, None], np.full_like(d[:, None], 16.0)


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    codes = _nibbles(b[:, 8:], 32).reshape(-1, 32) | (_high_bits32(b[:, 4:8]) << np.uint8(4))
    return codes, _f32(b[:, :2])[:, None], _f32(b[:, 2:4])[:, None]


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per 32-value group, the scale d * sc and the min -(dmin * m), float32 [B, 8]."""
    from gguf.quants import Q4_K

    d, dmin = _f32(b[:, :2]), _f32(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * m.astype(np.float32))


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, mins = _k_scales(b)
    return _nibbles(b[:, 16:144], 64).reshape(-1, _QK_K), scales, mins


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scales, mins = _k_scales(b)
    low = _nibbles(b[:, 48:176], 64).reshape(-1, 8, 32)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return (low | ((qh & np.uint8(1)) << np.uint8(4))).reshape(-1, _QK_K), scales, mins


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    low = _nibbles(b[:, :128], 128).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (low | ((qh & np.uint8(3)).reshape(-1, 8, 32) << np.uint8(4))).reshape(-1, _QK_K)
    d = _f32(b[:, 208:210])
    scales = d[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    return codes, scales, np.full_like(scales, 32.0)


Unpack = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
# type name -> (unpack, bits of the kernel's container, group, offset form)
BLOCK_TYPES: dict[str, tuple[Unpack, int, int, bool]] = {
    "Q8_0": (_q8_0, 8, 32, False),
    "Q4_0": (_q4_0, 4, 32, False),
    "Q4_1": (_q4_1, 4, 32, True),
    "Q5_0": (_q5_0, 8, 32, False),
    "Q5_1": (_q5_1, 8, 32, True),
    "Q4_K": (_q4_k, 4, 32, True),
    "Q5_K": (_q5_k, 8, 32, True),
    "Q6_K": (_q6_k, 8, 16, False),
}
FLOAT_TYPES = ("F32", "F16", "BF16")


def pack(type_name: str, data: np.ndarray, rows: int, cols: int) -> PackedWeight:
    """A [rows, cols] weight stored as `type_name` blocks (`data`: its bytes, [rows, row bytes]) as a
    PackedWeight. ValueError when the bytes do not fill the blocks the shape needs."""
    import gguf

    unpack, bits, group, offset = BLOCK_TYPES[type_name]
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    if cols % block:
        raise ValueError(f"input width {cols} is not a multiple of the {type_name} block ({block})")
    expected = rows * (cols // block) * nbytes
    if data.size != expected:
        raise ValueError(f"{data.size} bytes for {type_name} [{rows}, {cols}], expected {expected}")
    codes, scales, zeros = unpack(np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, nbytes))
    groups = cols // group
    return PackedWeight.from_values(torch.from_numpy(codes.reshape(rows, cols)),
                                    torch.from_numpy(np.ascontiguousarray(scales).reshape(rows, groups)),
                                    torch.from_numpy(np.ascontiguousarray(zeros).reshape(rows, groups)),
                                    bits, group, offset=offset)
