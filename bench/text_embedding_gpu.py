"""text_embedding on a GPU (issue 3: "on a GPU the gain from batching is far larger; the same table
must show it there"): Pier with dynamic batching vs Pier without vs the model called directly on
the GPU at batch 1, 8, 32 (the limit), in sequences/s at concurrency 1, 8, 32.

The GPU machines this project borrows have PyTorch but neither onnxruntime-gpu nor perf_analyzer,
and no model hub. So this variant serves an encoder of all-MiniLM-L6-v2's architecture (BERT: 6
layers, hidden 384, 12 heads, intermediate 1536, vocabulary 30522; mean pooling and L2 norm in the
module) with seeded random weights, as TorchScript through Pier's pytorch backend on KIND_GPU, and
drives it over gRPC with bench/loadgen.py's closed loop. Throughput does not depend on the weights'
values; the answers are checked against the direct module.

    python -m bench.text_embedding_gpu              # CUDA: bench/results/text_embedding-gpu[-quick].*
    python -m bench.text_embedding_gpu --device cpu # the same harness on the CPU (text_embedding-torch-cpu.*)
    python -m bench.text_embedding_gpu --quick      # short windows, one round
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench import report
from bench.common import Settings, log, temp_dir
from bench.loadgen import run_grpc
from bench.measure import timed_loop
from bench.servers import Servers, start_pier
from bench.text_embedding import (
    BATCHED,
    LEVELS,
    MODEL,
    NOBATCH,
    SEQ_LEN,
    UNBATCHED,
    batching_targets,
    measure_both,
)

HIDDEN = 384
QUEUE_DELAY_US = 2000  # as model_repository/text_embedding/config.pbtxt
DIRECT = "torch direct"


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm1 = nn.LayerNorm(hidden, eps=1e-12)
        self.up = nn.Linear(hidden, inter)
        self.down = nn.Linear(inter, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=keep)
        x = self.norm1(x + self.out(a.transpose(1, 2).reshape(b, n, h)))
        return self.norm2(x + self.down(F.gelu(self.up(x))))


class MiniLMEncoder(nn.Module):
    """all-MiniLM-L6-v2's shape: BERT embeddings, 6 post-norm layers, mean pooling, L2 norm."""

    def __init__(self, vocab: int = 30522, hidden: int = HIDDEN, layers: int = 6, heads: int = 12,
                 inter: int = 1536, max_positions: int = 512) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList([_Layer(hidden, heads, inter) for _ in range(layers)])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.norm(self.word(input_ids) + self.position(positions) + self.token_type.weight[0])
        keep = (attention_mask != 0)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keep)
        m = attention_mask.to(x.dtype).unsqueeze(-1)
        pooled = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2.0, dim=1)


def build_repo(repo: Path, kind: str) -> nn.Module:
    """TorchScript file + the two configs (with / without dynamic_batching); returns the module."""
    torch.manual_seed(0)
    module = MiniLMEncoder().eval()
    scripted = torch.jit.script(module)
    gpus = " gpus: [ 0 ]" if kind == "KIND_GPU" else ""
    for name, batching in ((MODEL, True), (NOBATCH, False)):
        (repo / name / "1").mkdir(parents=True)
        scripted.save(str(repo / name / "1" / "model.pt"))
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nplatform: "pytorch_libtorch"\nmax_batch_size: 64\n'
            'input [\n  { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },\n'
            '  { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] }\n]\n'
            f'output [ {{ name: "embedding" data_type: TYPE_FP32 dims: [ {HIDDEN} ] }} ]\n'
            + (f"dynamic_batching {{ max_queue_delay_microseconds: {QUEUE_DELAY_US} }}\n" if batching else "")
            + f"instance_group [ {{ count: 1 kind: {kind}{gpus} }} ]\n")
    return module


def infer_request(model: str, ids: np.ndarray, mask: np.ndarray):  # noqa: ANN201 - a ModelInferRequest
    from pier.protocol import grpc_service_pb2 as pb

    req = pb.ModelInferRequest(model_name=model)
    for name, arr in (("input_ids", ids), ("attention_mask", mask)):
        t = req.inputs.add(name=name, datatype="INT64")
        t.shape.extend(arr.shape)
        req.raw_input_contents.append(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    return req


def run(settings: Settings, device: str) -> Path:
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here (use --device cpu for the harness)")
    kind = "KIND_GPU" if dev.type == "cuda" else "KIND_CPU"
    started = report.started_info()
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, (max(LEVELS), SEQ_LEN), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] ... [SEP], as a tokenizer would frame them
    mask = np.ones_like(ids)
    group = report.Group(f"text_embedding ({'GPU' if kind == 'KIND_GPU' else 'CPU'}, TorchScript), "
                         f"{SEQ_LEN}-token sentences: sequences/s", "concurrency / batch", "seq/s",
                         [BATCHED, UNBATCHED, DIRECT], LEVELS, refs=[DIRECT, UNBATCHED],
                         x_labels={BATCHED: "c", UNBATCHED: "c", DIRECT: "batch"})
    notes: list[str] = []
    with Servers() as servers, temp_dir("embedding-gpu-") as tmp:
        module = build_repo(tmp / "repo", kind).to(dev)
        t_ids, t_mask = torch.from_numpy(ids).to(dev), torch.from_numpy(mask).to(dev)
        with torch.inference_mode():
            expected = module(t_ids[:1], t_mask[:1]).float().cpu().numpy()[0]

        def direct(level: int) -> None:
            with torch.inference_mode():
                module(t_ids[:level], t_mask[:level])
            if dev.type == "cuda":
                torch.cuda.synchronize()

        pier = servers.add("Pier", lambda: start_pier("pier_text_embedding_gpu", tmp / "repo"), required=True)
        requests = {m: infer_request(m, ids[:1], mask[:1]) for m in (MODEL, NOBATCH)}

        def check(response) -> None:  # noqa: ANN001 - a ModelInferResponse
            got = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
            cos = float(got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected)))
            if cos < 0.999:
                raise RuntimeError(f"Pier's answer differs from the direct module (cosine {cos:.6f})")

        for rnd in range(settings.rounds):
            for level in LEVELS:
                pt = timed_loop(lambda lv=level: direct(lv), settings.loadgen_s, max(1.0, settings.warmup_s),
                                max_calls=100_000, items_per_call=level)
                log(f"round {rnd + 1} direct batch {level}: {pt.throughput:,.1f} seq/s p50 {pt.p50_us / 1000:.2f} ms")
                group.add(DIRECT, level, pt)
                measure_both(group, pier, rnd, level, notes, lambda m, c, lb: run_grpc(
                    pier.grpc, requests[m], c, settings.loadgen_s, settings.warmup_s, check=check))

    targets = batching_targets(group, DIRECT, "direct")
    gain_direct, gain_pier = group.ratio(DIRECT, 32, DIRECT, 1), group.ratio(BATCHED, 32, UNBATCHED)
    group.notes += [
        f"Batching gain: direct batch 32 ÷ batch 1 = {gain_direct or 0:.1f}×; Pier with batching ÷ without at "
        f"c=32 = {gain_pier or 0:.1f}×.",
        "Pier rows: bench/loadgen.py's gRPC closed loop (grpc.aio, one 32-token sentence per request, batch 1, "
        "raw INT64 contents); seq/s = requests/s; latency per request. The first answer of each point is "
        "checked against the direct module (cosine ≥ 0.999).",
        f"{DIRECT} rows: the same module in this process on the same device, back to back, one call = one batch "
        "(CUDA synchronised per call); latency per call.",
        f"{BATCHED}: dynamic_batching {{ max_queue_delay_microseconds: {QUEUE_DELAY_US} }} as in "
        f"model_repository/text_embedding; {UNBATCHED}: the same model without it; one {kind} instance each.",
    ]
    intro = [
        "An encoder of all-MiniLM-L6-v2's architecture with seeded random weights (no model hub on the GPU "
        "machines), TorchScript, served by Pier's pytorch backend; see the module docstring.",
    ]
    name = "text_embedding-gpu" if kind == "KIND_GPU" else "text_embedding-torch-cpu"
    title = f"text_embedding on {'a GPU' if kind == 'KIND_GPU' else 'the CPU'}: Pier (batching / no batching) vs direct"
    return report.write(name, title, settings, [group], targets, intro, notes, started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.text_embedding_gpu", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    args = p.parse_args(argv)
    settings = Settings.make(args.quick, args.rounds)
    log(settings.describe())
    print(run(settings, args.device).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
