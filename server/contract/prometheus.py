"""Prometheus text exposition format (version 0.0.4), the pieces Pier's exporters share: the
server's nv_* families (pier.frontends.metrics), the LLM backend's vllm:* families and the python
backend's custom metrics (pb_utils.MetricFamily).

Labels are given either as a mapping, rendered here with its values escaped, or as text
already rendered (`model="m",version="1"`, the caller's values known to need no escaping),
which is used as it is. A series with no labels is written without braces.

Each exporter keeps the number formatting and the histogram row order it has always had (the
text is compared byte for byte by tests and dashboards), so `histogram` takes them as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

Labels = str | Mapping[str, str]


def escape_label_value(value: str) -> str:
    """A label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """A HELP text: backslash and newline escaped (a double quote stays as it is)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def number(value: float) -> str:
    """A value as prometheus-cpp (Triton) writes it: integral values without a fraction (`4`,
    not `4.0`), others as Python's shortest round-trip repr (`0.1`, `1e-07`)."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


def label_text(labels: Labels) -> str:
    """The labels inside the braces: `k="v",...` in the mapping's order, values escaped."""
    if isinstance(labels, str):
        return labels
    return ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())


def series(name: str, labels: Labels = "") -> str:
    """`name{labels}`, or `name` alone when there are no labels."""
    inner = label_text(labels)
    return f"{name}{{{inner}}}" if inner else name


def family(name: str, kind: str, help_text: str, rows: Iterable[str]) -> str:
    """A metric family: its HELP and TYPE lines, then its rows (each ending in a newline)."""
    return f"# HELP {name} {escape_help(help_text)}\n# TYPE {name} {kind}\n" + "".join(rows)


def _with_le(labels: Labels, bound: str) -> str:
    if isinstance(labels, str):
        return f'{labels},le="{bound}"' if labels else f'le="{bound}"'
    return label_text({**labels, "le": bound})  # a mapping's own `le` is replaced where it stands


def histogram(name: str, labels: Labels, bounds: Sequence[float], counts: Sequence[int], total: float,
              count: int, *, cumulative: bool = False, bound_text: Callable[[float], str] = number,
              sum_text: Callable[[float], str] = number, count_first: bool = False) -> list[str]:
    """The rows of one histogram series: a `_bucket` row per bound with its cumulative count (`le`
    written by `bound_text`), the `+Inf` bucket, `_sum` (written by `sum_text`) and `_count`.

    `counts` are the observations per bucket, one more than `bounds` for those above the last
    bound (the +Inf row is their total); or, with `cumulative`, one per bound, each already
    counting everything at or below its bound (the +Inf row is `count`). `count_first` writes
    `_count` and `_sum` before the buckets, as prometheus-cpp (Triton) does; otherwise they
    follow them, `_sum` first."""
    rows, running = [], 0
    for bound, c in zip(bounds, counts):
        running = c if cumulative else running + c
        rows.append(f"{name}_bucket{{{_with_le(labels, bound_text(bound))}}} {running}\n")
    everything = count if cumulative else sum(counts)
    rows.append(f"{name}_bucket{{{_with_le(labels, '+Inf')}}} {everything}\n")
    tail = [f"{series(name + '_sum', labels)} {sum_text(total)}\n", f"{series(name + '_count', labels)} {count}\n"]
    return [tail[1], tail[0], *rows] if count_first else [*rows, *tail]
