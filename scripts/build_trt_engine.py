"""Build a TensorRT engine (model.plan) from an ONNX model with TensorRT's builder API.

    python scripts/build_trt_engine.py model_repository/mlp_onnx/1/model.onnx out/mlp_trt/1/model.plan \
        [--max-batch 8] [--opt-batch 4] [--dim 16]

Dynamic dims: the first one of each input is the batch (1..--max-batch, tuned for --opt-batch);
any other dynamic dim gets the fixed size --dim. One optimization profile. Needs an NVIDIA GPU
and the tensorrt package; an engine only runs on the GPU model and TensorRT version that built it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def build_engine(onnx_bytes: bytes, max_batch: int = 8, opt_batch: int | None = None, dim: int = 16) -> bytes:
    """Serialized engine for `onnx_bytes`, FP32 as the ONNX graph says (strongly typed)."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_bytes):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser failed: {errors}")
    config = builder.create_builder_config()
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    if tf32 is not None:
        config.clear_flag(tf32)  # plain FP32 GEMMs, so results match onnxruntime's closely
    profile = builder.create_optimization_profile()
    opt = opt_batch or max(1, max_batch // 2)
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = list(tensor.shape)

        def at(batch: int, shape: list[int] = shape) -> tuple[int, ...]:
            return tuple((batch if j == 0 else dim) if d < 0 else d for j, d in enumerate(shape))

        profile.set_shape(tensor.name, at(1), at(opt), at(max_batch))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT failed to build the engine (see its log above)")
    return bytes(serialized)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("onnx", type=Path)
    parser.add_argument("plan", type=Path)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--opt-batch", type=int, default=None)
    parser.add_argument("--dim", type=int, default=16, help="size of the other dynamic dims")
    args = parser.parse_args()
    plan = build_engine(args.onnx.read_bytes(), args.max_batch, args.opt_batch, args.dim)
    args.plan.parent.mkdir(parents=True, exist_ok=True)
    args.plan.write_bytes(plan)
    print(f"wrote {args.plan} ({len(plan)} bytes)")


if __name__ == "__main__":
    main()
