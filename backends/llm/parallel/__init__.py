"""Tensor parallelism: the model on N ranks (processes), Megatron's split, torch.distributed's collectives.

- group.py: one rank's `ParallelGroup` (torch.distributed: gloo on CPU with a shared-memory all-reduce
  beside it, NCCL on CUDA) and the all-reduce / all-gather the sharded layers call;
- shard.py: which part of each layer a rank holds (checked before anything starts);
- executor.py: rank 0, in the engine-core process with the scheduler, starts the other ranks as
  children under pier.ipc.Supervisor and ships each step's delta to them;
- worker.py: ranks 1..N-1, each a process that builds its shard and runs the steps it is sent;
- messages.py: what rank 0 and the workers say to each other.
"""
