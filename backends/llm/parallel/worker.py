"""A tensor-parallel rank other than 0: `python -m pier.backends.llm.parallel.worker STEPS EVENTS`.

Started by rank 0 (executor.py, in the engine-core process) through pier.ipc's Supervisor, it
connects a PULL socket to STEPS and a PUSH socket to EVENTS (ZeroMQ ipc:// addresses rank 0 bound),
builds its shard of the model from WorkerInit (engine.build_runner, as rank 0 builds its own), says
WorkerReady, joins the process group, then runs each StepDelta it is sent (the same step rank 0 runs:
their collectives meet) until Shutdown. What it samples is dropped: rank 0's sampler answers. An
error is said (WorkerFailed) before it exits, so that rank 0 fails the group naming it. It dies
with rank 0 (pier.ipc.processes.die_with_parent).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path

import zmq

from pier.ipc.messages import encode
from pier.ipc.processes import die_with_parent

from .messages import TO_WORKER, Shutdown, StepDelta, WorkerFailed, WorkerInit, WorkerReady


def serve(init: WorkerInit, inbox: zmq.Socket, outbox: zmq.Socket,
          recv: Callable[[], bytes] | None = None) -> int:
    """Build the shard `init` says, join the group, run the steps until Shutdown (0) or an error (said
    to rank 0 first; then 1, or, for a remote worker, the error raised for it to say). `recv` (default:
    inbox.recv) is how a remote worker awaits the next message: it raises when its leader goes away.
    Port 0 in `init`: join through env://."""

    def fail(e: Exception) -> int:
        try:
            outbox.send(encode(WorkerFailed(init.rank, type(e).__name__, str(e))))
        except zmq.ZMQError:  # a remote leader gone: nobody to tell
            pass
        if recv is not None:
            raise e
        return 1

    import torch
    import torch.distributed as dist

    from ..config import EngineConfig
    from ..engine import _device, build_runner
    from ..layers.lora import LoRABatch
    from ..lora import LoRALayers
    from ..models import registry
    from ..spec_decode import SpeculativeConfig
    from .delta import Receiver
    from .group import ParallelGroup
    from .shm_allreduce import ShmAllReduce

    try:
        if init.threads is not None:
            torch.set_num_threads(init.threads)
        settings = dict(init.settings)
        folder = Path(init.model_dir)
        settings["model_path"] = folder
        if settings.get("speculative_config") is not None:
            settings["speculative_config"] = SpeculativeConfig(**settings["speculative_config"])
        cfg = EngineConfig(**settings)
        model_cls, mc = registry.resolve(folder)
        device = _device(cfg.parallel, init.rank)
        group = ParallelGroup(init.rank, init.size, device)
        runner = build_runner(folder, cfg, model_cls, mc, device, init.max_model_len, tuple(init.eos_ids), None,
                              group)
        lora = None
        if cfg.lora.enable_lora:  # this rank's share of the adapters rank 0 installs (StepDelta.lora)
            runner.lora = LoRABatch()
            lora = LoRALayers(runner.model, cfg.lora.max_lora_rank, runner.lora)
    except Exception as e:  # noqa: BLE001 - rank 0 fails the load with it
        return fail(e)
    outbox.send(encode(WorkerReady(init.rank, runner.num_blocks)))
    try:
        if init.port:
            group.join(dist.TCPStore(init.host, init.port, init.size, is_master=False),
                       loopback=cfg.parallel.nnodes == 1)  # else its collectives reach other machines too
        else:  # another machine's rank: MASTER_ADDR etc. (tp_worker.py), as long as rank 0 waits for ranks
            group.join(None, loopback=False, timeout_s=cfg.parallel.join_timeout_s)
        if init.shm:
            group.shm = ShmAllReduce(init.shm, init.rank, init.size, dead=lambda: False)  # rank 0's death kills it
        dist.barrier()  # every rank has mapped the segment: rank 0 removes its name
        receiver = Receiver()
        receive = recv or inbox.recv
        while True:
            msg = TO_WORKER.decode(receive())
            if isinstance(msg, StepDelta):
                for lid, path in msg.lora:
                    assert lora is not None, "LoRA adapters shipped to a rank without enable_lora"
                    if path:
                        lora.install(lid, lora.read(Path(path)))
                    else:
                        lora.evict(lid)
                runner.execute(receiver.output(msg))
            elif isinstance(msg, Shutdown):
                return 0
    except Exception as e:  # noqa: BLE001 - said to rank 0, which fails the group
        return fail(e)
    finally:
        group.leave()


def main(argv: list[str]) -> int:
    die_with_parent(ignore=(signal.SIGINT,))
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(argv[0])
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(argv[1])
    try:
        if not inbox.poll(60_000):
            return 1
        init = TO_WORKER.decode(inbox.recv())
        if not isinstance(init, WorkerInit):
            return 1
        return serve(init, inbox, outbox)
    finally:
        outbox.close(linger=1000)
        inbox.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
