"""A model version that is loaded: its spec, its instances behind one scheduler, its stats."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pier.contract.backend import Backend, InstanceContext, LoadProgress, ModelContext, ModelInstance, ServerServices
from pier.contract.errors import unavailable
from pier.contract.types import ModelSpec
from pier.observability.statistics import ModelStatistics
from pier.protocol import model_config_pb2 as mc
from pier.repository.spec import config_to_json
from pier.scheduling.base import Scheduler
from pier.scheduling.direct import DirectScheduler
from pier.scheduling.dynamic_batcher import DynamicBatcher
from pier.scheduling.ragged import BatchLayout
from pier.scheduling.sequence_batcher import SequenceBatcher

_load_ids = itertools.count(1)


class LoadedModel:
    """Owns one scheduler. Built by `load` (blocking: run it off the event loop's hot path)."""

    def __init__(self, spec: ModelSpec, config: Any, version: int, scheduler: Scheduler,
                 stats: ModelStatistics) -> None:
        self.spec = spec
        self.config = config  # the completed ModelConfig message (gRPC ModelConfig answers it)
        self.version = version
        self.version_str = str(version)
        self.scheduler = scheduler
        self.stats = stats
        self.load_duration_s = 0.0  # nv_model_load_duration_secs
        self.load_id = next(_load_ids)  # tells this load apart from a reload of the same version
        self.instances: list[ModelInstance] = []  # backend instances (none for ensembles)
        self.instance_names: list[str] = []  # theirs, in the same order (as their health reports name them)
        self.key = spec.name  # its routing key: the name, or with --model-namespacing "<repository>/<name>"

    @property
    def namespace(self) -> str:
        """--model-namespacing: the repository it came from ("" without namespacing)."""
        return self.key.rpartition("/")[0]

    def instance_lost(self, name: str) -> None:
        """Instance `name` reported that it cannot serve (its process died): what it held is gone."""
        if name in self.instance_names:
            self.scheduler.instance_lost(self.instance_names.index(name))

    async def stop(self) -> None:
        await self.scheduler.stop()


def instance_contexts(spec: ModelSpec, gpu_count: int) -> list[InstanceContext]:
    """One per configured instance (KIND_GPU: per listed GPU), named as Triton names them."""
    where: list[InstanceContext] = []
    for group in spec.instance_groups:
        if group.kind == "KIND_GPU":
            gpus = list(group.gpus) or list(range(gpu_count))
            missing = [g for g in gpus if g >= gpu_count]
            if not gpus or missing:
                raise unavailable(
                    f"instance group '{group.name}' of model '{spec.name}' asks for GPU "
                    f"{missing or 'devices'} but this machine has {gpu_count} GPU(s)"
                )
            where += [InstanceContext(f"{group.name}_{i}_gpu{gpu}", "KIND_GPU", gpu)
                      for gpu in gpus for i in range(group.count)]
        else:
            where += [InstanceContext(f"{group.name}_{i}", "KIND_CPU", None) for i in range(group.count)]
    return where


def create_instances(backend: Backend, spec: ModelSpec, config: mc.ModelConfig, version: int, model_dir: Path,
                     gpu_count: int, services: ServerServices | None = None,
                     report_health: Callable[[str, str | None], None] | None = None,
                     report_progress: Callable[[str, LoadProgress], None] | None = None) -> list[ModelInstance]:
    """Blocking: a backend instance per `instance_contexts`. The backend sees the completed config
    as Triton's JSON, as Triton's backend API gives it."""
    ctx = ModelContext(spec=spec, version=version, model_dir=model_dir, version_dir=model_dir / str(version),
                       config_json=json.dumps(config_to_json(config)), services=services)
    if report_health is not None:
        ctx = dataclasses.replace(ctx, report_health=report_health)
    if report_progress is not None:
        ctx = dataclasses.replace(ctx, report_progress=report_progress)
    instances: list[ModelInstance] = []
    try:
        for where in instance_contexts(spec, gpu_count):
            instances.append(backend.create_instance(ctx, where))
    except BaseException:
        for inst in instances:
            inst.close()
        raise
    return instances


def build_loaded_model(spec: ModelSpec, config: mc.ModelConfig, version: int, instances: list[ModelInstance],
                       keep_recent: bool = False, names: list[str] | None = None) -> LoadedModel:
    """On the event loop: wrap instances in the scheduler the config asks for (`keep_recent`:
    statistics keep a window of recent requests, for the summary metrics; `names`: the instances'
    names, for their health reports). A sequence model gets a scheduler per instance under its
    sequence batcher, which keeps each sequence on one instance."""
    stats = ModelStatistics.create(keep_recent)
    name = f"{spec.name}-{version}"
    layout = BatchLayout.from_spec(spec)

    def batcher(group: list[ModelInstance], label: str) -> Scheduler:
        if spec.batching is None:
            return DirectScheduler(group, stats, label, layout)
        return DynamicBatcher(group, stats, label, spec.batching, layout)

    scheduler: Scheduler
    if spec.sequence is not None:
        groups = [[inst] for inst in instances] or [[]]
        scheduler = SequenceBatcher([batcher(g, f"{name}-{i}") for i, g in enumerate(groups)], spec.sequence,
                                    spec.name)
    else:
        scheduler = batcher(instances, name)
    model = LoadedModel(spec, config, version, scheduler, stats)
    model.instances = list(instances)
    model.instance_names = list(names or [])
    return model
