"""Multi-LoRA in the engine: greedy outputs equal PEFT's PeftModel + transformers, token for token,
for adapters with non-zero B (rsLoRA too), base and adapters mixed in one step; max_loras bounds the
adapters of a step (the others wait, and finish); the prefix cache never shares blocks between
adapters or loads of one; bad adapters are refused with vLLM's words (or, past vLLM, the tensor or
file named)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pier.backends.llm.config import EngineConfig, LoRAModulePath, parse_lora_modules
from pier.backends.llm.engine import LLMEngine
from pier.backends.llm.lora import LoRAError, LoRANotFound
from pier.backends.llm.sampling_params import SamplingParams

from .tiny_model import build_adapter, peft_greedy

N = 12


@pytest.fixture(scope="module")
def adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a1": build_adapter(llama_dir, root / "a1", 1, r=8, alpha=16),
            "a2": build_adapter(llama_dir, root / "a2", 2, r=4, alpha=8, use_rslora=True,
                                targets=("q_proj", "v_proj", "down_proj"))}


@pytest.fixture(scope="module")
def lora_prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (3, 19, 37)]


@pytest.fixture(scope="module")
def refs(llama_dir: Path, adapters: dict[str, Path], lora_prompts: list[list[int]]
         ) -> dict[str | None, list[list[int]]]:
    out = {name: peft_greedy(llama_dir, path, lora_prompts, N) for name, path in adapters.items()}
    out[None] = peft_greedy(llama_dir, None, lora_prompts, N)
    assert out["a1"] != out[None] and out["a2"] != out[None]  # the adapters change the answers
    return out


def engine(folder: Path, adapters: dict[str, Path], **kw: object) -> LLMEngine:
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    eng = LLMEngine(folder, EngineConfig(enable_lora=True, **kw))  # type: ignore[arg-type]
    for name, path in adapters.items():
        eng.load_lora(name, path)
    return eng


def greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, lora_name=lora)


@pytest.mark.parametrize("attention", ["auto", "torch"])
def test_mixed_step_equals_peft(llama_dir, adapters, lora_prompts, refs, attention):
    """Base, a1 and a2 requests in the same steps: each equals PEFT's greedy run of it alone."""
    eng = engine(llama_dir, adapters, max_loras=2, attention=attention)
    names = [None, "a1", "a2"]
    jobs = [(p, n) for i, p in enumerate(lora_prompts) for n in names[i:] + names[:i]]
    out = eng.generate([p for p, _ in jobs], [greedy(n) for _, n in jobs])
    assert [o[0] for o in out] == [refs[n][lora_prompts.index(p)] for p, n in jobs]
    eng.kv.check()
    assert not eng.kv.seqs


def test_more_adapters_than_max_loras_all_finish(llama_dir, adapters, lora_prompts, refs):
    """max_loras 1 (and as many kept loaded): a step never runs two adapters; the others wait, are
    read again from their folder when their turn comes, and all finish with the right tokens."""
    eng = engine(llama_dir, {**adapters, "a3": adapters["a1"]}, max_loras=1)
    seen: list[set[int]] = []
    schedule = eng.scheduler.schedule

    def watched():  # type: ignore[no-untyped-def]
        so = schedule()
        seen.append({s.lora_id for s in so.scheduled if s.lora_id})
        return so

    eng.scheduler.schedule = watched  # type: ignore[method-assign]
    names = ["a1", "a2", "a3", None, "a2"]
    out = eng.generate([lora_prompts[1]] * len(names), [greedy(n) for n in names])
    ref = {"a3": refs["a1"][1], **{n: refs[n][1] for n in (None, "a1", "a2")}}
    assert [o[0] for o in out] == [ref[n] for n in names]
    assert max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 3


def test_prefix_cache_keyed_by_adapter_and_load(llama_dir, adapters, refs):
    """The same prefix through two adapters shares no block; through the same adapter it does; a
    reload under the same name (load_inplace) serves the new weights and none of the old blocks."""
    eng = engine(llama_dir, adapters, max_loras=2, block_size=4)
    rng = random.Random(5)
    prompt = [rng.randrange(2, 320) for _ in range(30)]

    def run(name: str) -> tuple[list[int], int]:
        hits = eng.kv.prefix_hits
        return eng.generate([prompt], greedy(name))[0][0], eng.kv.prefix_hits - hits

    first, hits = run("a1")
    assert hits == 0
    assert run("a2")[1] == 0  # another adapter: no shared block
    assert run("a1") == (first, 28)  # the same adapter: 7 full blocks from the cache
    eng.load_lora("a1", adapters["a2"], inplace=True)  # a1's name, a2's weights
    again, hits = run("a1")
    assert hits == 0 and again == run("a2")[0]
    assert again == peft_greedy(llama_dir, adapters["a2"], [prompt], N)[0]


def edited(src: Path, dst: Path, **config: object) -> Path:
    shutil.copytree(src, dst)
    doc = json.loads((dst / "adapter_config.json").read_text())
    doc.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(doc))
    return dst


def test_refusals(llama_dir, adapters, tmp_path):
    """What vLLM refuses, refused with its words; past vLLM, a wrong shape and a corrupt file are
    refused naming the tensor or file; nothing changes for the adapters already served."""
    eng = engine(llama_dir, adapters, max_loras=2)
    a1 = adapters["a1"]
    cases = {
        "dora": (edited(a1, tmp_path / "dora", use_dora=True), "vLLM does not yet support DoRA."),
        "mts": (edited(a1, tmp_path / "mts", modules_to_save=["lm_head"]),
                "vLLM only supports modules_to_save being None."),
        "bias": (edited(a1, tmp_path / "bias", bias="lora_only"), "Adapter bias is not supported."),
        "rank": (edited(a1, tmp_path / "rank", r=32), "LoRA rank 32 is greater than max_lora_rank 16."),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(LoRAError) as err:
            eng.load_lora(name, path)
        assert str(err.value) == message and err.value.status == 400
    from safetensors.torch import load_file, save_file

    shape = tmp_path / "shape"
    shutil.copytree(a1, shape)
    tensors = load_file(str(shape / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    tensors[key] = torch.zeros(100, 8)
    save_file(tensors, str(shape / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match=rf"tensor {key} has shape \[100, 8\], expected \[128, 8\]"):
        eng.load_lora("shape", shape)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(a1, corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    with pytest.raises(LoRAError, match=f"{weights}: not a readable safetensors file"):
        eng.load_lora("corrupt", corrupt)
    with pytest.raises(LoRANotFound) as missing:
        eng.load_lora("nowhere", tmp_path / "nowhere")
    assert str(missing.value) == f"Loading lora nowhere failed: No adapter found for {tmp_path / 'nowhere'}"
    assert missing.value.status == 404
    with pytest.raises(LoRAError, match="has already been loaded. If you want to load the adapter in place"):
        eng.load_lora("a1", a1)
    assert eng.update_lora("nope", None) == (404, "The lora adapter 'nope' cannot be found.")
    assert eng.update_lora("a2", None) == (200, "Success: LoRA adapter 'a2' removed successfully.")
    assert sorted(eng.lora_adapters()) == ["a1"]
    with pytest.raises(ValueError, match=r"LoRA a2 is not supported, we currently support \['a1'\]"):
        eng.add_request("x", [5, 6, 7], greedy("a2"))


def test_settings():
    pairs = (LoRAModulePath("sql", "/a/sql"), LoRAModulePath("other", "rel/o"))
    assert parse_lora_modules("sql=/a/sql other=rel/o") == pairs
    one = '[{"name": "x", "path": "/p", "base_model_name": "b"}]'
    assert parse_lora_modules(one) == (LoRAModulePath("x", "/p", "b"),)
    cfg = EngineConfig.from_parameters({"enable_lora": "true", "max_loras": "4", "max_lora_rank": "64",
                                        "max_cpu_loras": "8", "lora_modules": "a=/x"})
    assert (cfg.lora.max_loras, cfg.lora.max_lora_rank, cfg.lora.cpu_loras) == (4, 64, 8)
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineConfig.from_parameters({"enable_lora": "true", "max_lora_rank": "12"})
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        EngineConfig.from_parameters({"enable_lora": "true", "max_loras": "2", "max_cpu_loras": "1"})
    with pytest.raises(ValueError, match="is not name=path"):
        EngineConfig.from_parameters({"enable_lora": "true", "lora_modules": "justaname"})
