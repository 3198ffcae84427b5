"""Triton's classification extension: a requested output with parameter `classification: K`
comes back as its top K entries, BYTES strings "value:index" or "value:index:label".

Behaviour as the reference Triton 2.51 answered it (probed side by side):
- a batching model classifies each batch entry over its flattened elements: shape [batch, k];
  a model without batching classifies the whole output: shape [k]; k = min(K, elements);
- highest value first, ties in index order; values as C's "%f" for floats (0.500000), plain
  integers otherwise; integer and float outputs only;
- labels come from the output's `label_filename` in the model folder, one per line (a line's
  trailing "\\r" is kept); an index past the file, or an empty line, gets no label;
- K = 0 leaves the output as it is.
Triton 2.51 crashed on an output with no elements; here that is simply an empty answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pier.contract.errors import invalid_arg
from pier.contract.types import Tensor

_INTEGERS = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
_FLOATS = ("FP32", "FP64")


def class_count(params: dict[str, Any]) -> int:
    """The requested output's `classification` parameter (0 when absent), checked."""
    value = params.get("classification", 0)
    if type(value) is not int or value < 0 or value > 0xFFFFFFFF:
        raise invalid_arg(f"Unable to set 'classification': expected an unsigned integer, got {value!r}")
    return value


def read_labels(model_dir: Path, label_filename: str, output: str) -> tuple[str, ...]:
    """The labels of `output`, one per line of its label file (which must lie in the model folder)."""
    folder = model_dir.resolve()
    path = (folder / label_filename).resolve()
    if not path.is_relative_to(folder):
        raise invalid_arg(f"label_filename '{label_filename}' of output '{output}' must name a file inside "
                          f"the model folder {model_dir}")
    try:
        text = path.read_bytes().decode("utf-8", "replace")
    except OSError as exc:
        raise invalid_arg(f"failed to open text file for read {path}: {exc.strerror}") from None
    return tuple(text.split("\n"))  # a final newline adds an empty label, which shows as none


def classify(t: Tensor, count: int, batched: bool, labels: Sequence[str]) -> Tensor:
    """Output `t` as its top-`count` classes (see the module doc)."""
    if t.datatype in _FLOATS:
        fmt = "{:f}"
    elif t.datatype in _INTEGERS:
        fmt = "{:d}"
    else:
        raise invalid_arg(f"class result not available for output due to unsupported type '{t.datatype}'")
    data = np.asarray(t.data)
    rows = data.reshape(data.shape[0] if batched and data.ndim else 1, -1)
    k = min(count, rows.shape[1])
    # Stable sort on a key that reverses the order (~x for integers cannot overflow, unlike -x):
    # highest value first, equal values in index order.
    key = -rows if t.datatype in _FLOATS else ~rows
    top = np.argsort(key, axis=1, kind="stable")[:, :k]
    out: np.ndarray = np.empty(top.shape, dtype=object)
    for r, (row, idx) in enumerate(zip(rows, top)):
        for c, i in enumerate(idx.tolist()):
            text = f"{fmt.format(row[i].item())}:{i}"
            if i < len(labels) and labels[i]:
                text += ":" + labels[i]
            out[r, c] = text.encode()
    if not (batched and data.ndim):
        out = out.reshape(-1)
    return Tensor(t.name, "BYTES", list(out.shape), out)
