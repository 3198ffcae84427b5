"""Scheduling policies, derived once from the completed ModelConfig into the ModelSpec
(pier.repository.spec) and read by the schedulers and backends: frozen and typed, so nothing
past the load reads the protobuf again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class QueuePolicy:
    """One priority level's queue policy (Triton's ModelQueuePolicy)."""

    timeout_action_delay: bool = False  # False: REJECT (default), True: DELAY
    default_timeout_us: int = 0  # 0: no timeout
    allow_timeout_override: bool = False
    max_queue_size: int = 0  # 0: unbounded


@dataclass(frozen=True)
class BatchingPolicy:
    """The dynamic batcher's settings (also the sequence batcher's, across sequences)."""

    max_batch_size: int
    preferred_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_policy: QueuePolicy = QueuePolicy()
    level_policies: dict[int, QueuePolicy] = field(default_factory=dict)

    def policy(self, level: int) -> QueuePolicy:
        return self.level_policies.get(level, self.default_policy)


@dataclass(frozen=True, slots=True)
class Control:
    """One control input: its tensor name, kind (START, END, READY, CORRID) and datatype;
    `values` are the (false, true) pair for the flags."""

    name: str
    kind: str
    datatype: str
    values: tuple[Any, Any] = (0, 1)


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One implicit state: the input and output it flows through, and its initial value."""

    input_name: str
    output_name: str
    datatype: str
    initial: np.ndarray  # the state a sequence starts from, without the batch dim


@dataclass(frozen=True, slots=True)
class SequencePolicy:
    """The sequence batcher's settings: idle timeout, control inputs, implicit states, and how
    many sequences each instance holds at once (`slots`, Triton's sequence slots per instance: the
    max batch size, at least 1, or `oldest.max_candidate_sequences` when set)."""

    idle_ns: int
    batched: bool
    slots: int = 1
    controls: tuple[Control, ...] = ()
    states: tuple[StateSpec, ...] = ()
    returned_states: frozenset[str] = frozenset()  # state outputs the config lists as outputs
    iterative: bool = False  # `iterative_sequence`: each request is a sequence the model may reschedule
