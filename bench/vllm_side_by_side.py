"""Pier's LLM engine side by side with the reference vLLM (CPU build, 0.32) on the same random weights.

Three things, one random-weight ~27 M-parameter Llama with a byte-level BPE tokenizer (every JSON
character is a token path; bench/structured_output.py builds it), float32, this CPU:

1. structured output, greedy: a few prompts, a small JSON schema with bounded fields; Pier's output
   vs vLLM's (backend "guidance", i.e. llguidance, the library Pier uses), with vLLM's default
   whitespace (free) and with `disable_any_whitespace` (compact, as Pier). Unconstrained greedy runs
   of the same prompts are the control (how often the two engines' float32 numerics pick different
   argmaxes without any grammar), and each vLLM output is also checked against Pier's own grammar;
2. the per-token cost of masking: generated tokens/s with and without a schema on both engines
   (16 requests x 96 tokens, sampled with seeds, ignore_eos), interleaved rounds, the with/without
   ratio per engine (median and spread). The schema here (ROWS_SCHEMA) cannot be completed in 96
   tokens, so both engines mask every step (vLLM stops masking once a grammar has ended);
3. embeddings: Pier's embed request (what /v1/embeddings serves for an LLM) vs vLLM's pooling
   runner (`LLM(..., runner="pooling")`, `llm.embed`), cosine per sentence; plus transformers'
   last hidden state (last token, and mean) as a third opinion on what each engine pools.

    .venv/bin/python -m bench.vllm_side_by_side [--rounds 5] [--requests 16] [--tokens 96]

vLLM: needs PIER_REFERENCE_TOOLS (its vllm-reference/ folder) and the venv that
`$PIER_REFERENCE_TOOLS/vllm-reference/install.sh ~/vllm-ref` installs (or --vllm-dir); without them
the vLLM columns are skipped with a note. vLLM runs in a child process (its own venv) that this
script starts with `--vllm-worker` and drives over a pipe, so its rounds interleave with Pier's.
Writes bench/results/vllm_side_by_side.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_REF = "vllm-reference"
BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
MAX_MODEL_LEN = 512

# Part 1: small and bounded, so greedy documents end (then EOS) well inside max_tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                   "color": {"enum": ["red", "green", "blue"]},
                   "count": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "ok", "color", "count", "tags"], "additionalProperties": False,
}
# Part 2: exactly 16 such (smaller) objects: at least 16 x 46 characters, far more than 96 tokens, so
# neither engine's grammar ends inside the budget and both mask every one of the 96 steps.
ITEM = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"},
                       "color": {"enum": ["red", "green", "blue"]},
                       "count": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "ok", "color", "count"], "additionalProperties": False}
ROWS_SCHEMA: dict[str, Any] = {"type": "object",
                               "properties": {"rows": {"type": "array", "items": ITEM, "minItems": 16,
                                                       "maxItems": 16}},
                               "required": ["rows"], "additionalProperties": False}
PROMPTS = ["Describe a colour as JSON:", "The quick brown fox jumps over the lazy dog.",
           '{"name": "x", "ok": true, "count": 3}', "Paged attention keeps keys and values in blocks.",
           "Héllo wörld ☃", "Return one record.", "user: give me data\nassistant:", "0123456789"]
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Paged attention keeps keys and values in blocks.",
             "A model server answers many requests at once.", "Héllo wörld ☃ 日本語 🙂",
             '{"name": "x", "ok": true, "count": 3}', "Embeddings are the last token's hidden state.",
             "x", "Continuous batching fills every step with work; prefix caching skips shared prompts."]
CONTROL_TOKENS = 48


def log(msg: str) -> None:
    print(f"[vllm-sbs {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the vLLM side: a worker in vLLM's own venv, driven over a pipe ---------------------------------

def vllm_worker(result_fd: int) -> None:
    """Runs under vLLM's Python: one JSON command per stdin line, one JSON answer per line on result_fd.

    Commands: {"op": "init", "kind": "generate"|"pooling", "model": dir, "so_config": {...}},
    {"op": "generate", "requests": [{"ids": [...], "params": {...}, "schema": {...}|null}]},
    {"op": "embed", "texts": [...]}, {"op": "quit"}.
    """
    out = os.fdopen(result_fd, "w", buffering=1)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "quit":
                break
            if op == "init":
                t0 = time.perf_counter()
                kw: dict[str, Any] = dict(model=cmd["model"], dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN,
                                          block_size=BLOCK_SIZE)
                if cmd["kind"] == "pooling":
                    kw["runner"] = "pooling"
                else:
                    kw["structured_outputs_config"] = cmd["so_config"]
                llm = LLM(**kw)
                mc = llm.llm_engine.model_config
                from importlib.metadata import version

                info = {"version": vllm.__version__, "init_s": time.perf_counter() - t0,
                        "llguidance": version("llguidance"), "torch": version("torch"),
                        "settings": {k: str(v) for k, v in kw.items() if k != "model"},
                        "env": {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")},
                        "pooler_config": repr(getattr(mc, "pooler_config", None)),
                        "runner_type": str(getattr(mc, "runner_type", "?")),
                        "architecture": str(getattr(mc, "architecture", "?"))}
                out.write(json.dumps({"ok": True, **info}) + "\n")
            elif op == "generate":
                assert llm is not None
                prompts = [TokensPrompt(prompt_token_ids=r["ids"]) for r in cmd["requests"]]
                params = []
                for r in cmd["requests"]:
                    so = StructuredOutputsParams(json=r["schema"]) if r.get("schema") is not None else None
                    params.append(SamplingParams(**r["params"], structured_outputs=so))
                t0 = time.perf_counter()
                res = llm.generate(prompts, params, use_tqdm=False)
                wall = time.perf_counter() - t0
                outs = [{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                         "finish": o.outputs[0].finish_reason} for o in res]
                out.write(json.dumps({"ok": True, "wall_s": wall, "outputs": outs}) + "\n")
            elif op == "embed":
                assert llm is not None
                res = llm.embed(cmd["texts"], use_tqdm=False)
                out.write(json.dumps({"ok": True, "embeddings": [list(r.outputs.embedding) for r in res],
                                      "prompt_ids": [list(r.prompt_token_ids) for r in res]}) + "\n")
        except Exception as exc:  # report it to the driver, keep serving
            out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")


class VllmWorker:
    """The driver's handle on one worker process (one vLLM engine)."""

    def __init__(self, python: Path, log_path: Path) -> None:
        r, w = os.pipe()
        self.log_file = open(log_path, "a")  # noqa: SIM115 (lives as long as the worker)
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
        # stdout too goes to the log (vLLM and its engine-core child print there); answers come on fd w
        self.proc = subprocess.Popen([str(python), str(Path(__file__).resolve()), "--vllm-worker", str(w)],
                                     stdin=subprocess.PIPE, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     pass_fds=(w,), env=env, text=True, cwd="/")
        os.close(w)
        self.answers = os.fdopen(r)

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.answers.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()}); see {self.log_file.name}")
        ans = json.loads(line)
        if not ans.pop("ok"):
            raise RuntimeError(f"vLLM: {ans['error']}")
        return ans

    def close(self) -> None:
        try:
            self.call(op="quit")
        except (RuntimeError, BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log_file.close()


def vllm_python(vllm_dir: Path) -> tuple[Path | None, str | None]:
    """vLLM's Python, or the note that says why the vLLM columns are skipped."""
    from bench.tools import reference_missing, reference_tool

    if reference_tool(VLLM_REF) is None:
        return None, reference_missing(VLLM_REF, "vLLM")
    py = vllm_dir / "venv" / "bin" / "python"
    if not py.is_file():
        return None, (f"skipped: no vLLM reference venv at {vllm_dir} (install with "
                      f"{reference_tool(VLLM_REF)}/install.sh {vllm_dir})")
    return py, None


# -- the Pier side ----------------------------------------------------------------------------------

def pier_generate(engine: Any, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Same request shape as the worker's generate: all at once, to completion; wall time and outputs."""
    from pier.backends.llm.sampling_params import SamplingParams

    base = f"r{time.monotonic_ns()}-"
    ids: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    finish: dict[str, str | None] = {}
    t0 = time.perf_counter()
    for i, r in enumerate(requests):
        doc = dict(r["params"])
        if r.get("schema") is not None:
            doc["structured_outputs"] = {"json": r["schema"]}
        engine.add_request(f"{base}{i}", r["ids"], SamplingParams.from_json(doc))
        ids[f"{base}{i}"], text[f"{base}{i}"] = [], ""
    while engine.has_unfinished():
        for o in engine.step():
            ids[o.request_id] += o.token_ids
            text[o.request_id] += o.text
            if o.finished:
                finish[o.request_id] = o.finish_reason
    wall = time.perf_counter() - t0
    keys = [f"{base}{i}" for i in range(len(requests))]
    return {"wall_s": wall, "outputs": [{"ids": ids[k], "text": text[k], "finish": finish.get(k)} for k in keys]}


def pier_embed(engine: Any, texts: list[str]) -> tuple[list[list[float]], list[list[int]]]:
    from pier.backends.llm.sampling_params import SamplingParams

    prompt_ids = [engine.encode_prompt(t) for t in texts]
    vecs: dict[str, list[float]] = {}
    for i, p in enumerate(prompt_ids):
        engine.add_request(f"e{time.monotonic_ns()}-{i}", p, SamplingParams.from_json({"embed": True, "max_tokens": 1}))
    order = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.embedding is not None:
                vecs[o.request_id] = o.embedding
                order.append(o.request_id)
    keys = sorted(vecs, key=lambda k: int(k.rsplit("-", 1)[1]))
    return [vecs[k] for k in keys], prompt_ids


def hf_reference(folder: Path, prompt_ids: list[list[int]]) -> dict[str, list[list[float]]]:
    """transformers' final hidden state (after the model's last RMSNorm): last token and mean, L2-normalised."""
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    last, mean = [], []
    with torch.inference_mode():
        for ids in prompt_ids:
            h = model(torch.tensor([ids])).last_hidden_state[0]
            last.append(torch.nn.functional.normalize(h[-1], dim=-1).tolist())
            mean.append(torch.nn.functional.normalize(h.mean(0), dim=-1).tolist())
    return {"last": last, "mean": mean}


# -- comparisons ------------------------------------------------------------------------------------

def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(pier: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for i, (p, v) in enumerate(zip(pier, other)):
        div = first_divergence(p["ids"], v["ids"])
        rows.append({"prompt": i, "identical_text": p["text"] == v["text"], "identical_ids": div is None,
                     "first_divergent_token": div, "pier_text": p["text"], "vllm_text": v["text"],
                     "pier_finish": p["finish"], "vllm_finish": v["finish"],
                     "pier_len": len(p["ids"]), "vllm_len": len(v["ids"])})
    same = sum(r["identical_text"] for r in rows)
    return {"identical": same, "differing": len(rows) - same, "rows": rows}


def grammar_accepts(engine: Any, schema: dict[str, Any], ids: list[int]) -> dict[str, Any]:
    """Does Pier's grammar (compact JSON) accept this token sequence (EOS at its end included)?"""
    from pier.backends.llm.structured import StructuredOutputs

    m = engine.grammars.matcher(StructuredOutputs.from_json({"json": schema}))
    ok = m.validate_tokens(ids)
    return {"accepted_tokens": ok, "of": len(ids), "all": ok == len(ids)}


def valid_json(text: str, schema: dict[str, Any]) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    props = schema["properties"]
    return isinstance(doc, dict) and set(doc) == set(props)


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# -- report -----------------------------------------------------------------------------------------

VLLM_FACTS = [
    "vLLM 0.32's API, offline: `LLM(model, structured_outputs_config={\"backend\": \"guidance\", "
    "\"disable_any_whitespace\": True})` and `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))` "
    "(vllm.sampling_params); its OpenAI server: `--structured-outputs-config '{\"backend\": \"guidance\", "
    "\"disable_any_whitespace\": true}'` and the request's `structured_outputs: {\"json\": schema}` (extra_body).",
    "vLLM's guidance backend reads `disable_any_whitespace` only from the engine's StructuredOutputsConfig "
    "(vllm/v1/structured_output/backend_guidance.py, `__post_init__`); the per-request field of the same name in "
    "StructuredOutputsParams is ignored by that backend. It passes `defaults={\"whitespace_flexible\": not "
    "disable_any_whitespace}` to `llguidance.LLMatcher.grammar_from_json_schema`; an `x-guidance` object inside the "
    "schema overrides those defaults (checked with vLLM's llguidance), so a client can also ask for compact JSON per "
    "request by sending `\"x-guidance\": {\"whitespace_flexible\": false}` in the schema, which is exactly what Pier "
    "adds (backends/llm/structured.py).",
    "vLLM stops masking a request once its grammar has accepted EOS (`GuidanceGrammar.terminated`, then "
    "`grammar_bitmask` skips it), so with `ignore_eos` the tokens after a finished document are unconstrained "
    "there while Pier keeps masking to EOS only; the throughput part therefore uses a schema (16 fixed rows) that no "
    "request can finish within the token budget, and counts any request that did.",
    "vLLM's pooling runner on a LlamaForCausalLM checkpoint converts it (`runner=\"pooling\"`, convert \"embed\"): "
    "the pooler config it reports is quoted in section 3; LAST pooling over the final (normed) hidden state, and the "
    "embed activation is L2 normalisation (vllm/model_executor/layers/pooler/activations.py) – the norms below "
    "are 1.",
]


def _f(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}"


def _md(text: str, n: int = 110) -> str:
    t = "".join(json.dumps(ch)[1:-1] if ord(ch) < 32 else ch for ch in text)
    t = t if len(t) <= n else t[:n] + "…"
    return "`" + t.replace("`", "'").replace("|", "\\|") + "`"


def report(res: dict[str, Any], argv: str) -> str:  # noqa: C901, PLR0912, PLR0915
    v = res.get("vllm")
    lines = ["# Pier's LLM engine vs vLLM 0.32 (CPU), same random weights: structured output, masking cost, "
             "embeddings", "",
             f"Machine: {res['machine']}; shared with other work (load average {res['load_at_start']} at the start, "
             f"{res['load_at_end']} at the end). Revision {res['revision']}.", "",
             f"Model: {res['model']}.", "",
             f"Pier: its LLMEngine in-process ({', '.join(f'{k}={x}' for k, x in res['pier_engine_config'].items())}, "
             f"block size 16, prefix caching on, torch {res['pier_torch']}, llguidance {res['pier_llguidance']}).",
             "", "Command: `PIER_REFERENCE_TOOLS=/work/shared/tools .venv/bin/python -m bench.vllm_side_by_side"
             + (f" {argv}" if argv else "") + "`", ""]
    if v:
        env = ", ".join(f"{k}={x}" for k, x in v["env"].items())
        lines += [f"vLLM: vllm-cpu {v['version']} (torch {v['torch']}, llguidance {v['llguidance']}), offline "
                  f"`LLM(...)` in its own venv, driven over a pipe by this script (`--vllm-worker`) so that its "
                  f"rounds interleave with Pier's; settings "
                  + ", ".join(f"{k}={x}" for k, x in v["generate_settings"].items() if k != "structured_outputs_config")
                  + f", prefix caching on (its default); {env}. Engine starts took "
                  f"{', '.join(_f(x, 0) for x in v['init_s'])} s.", ""]
    else:
        lines += ["vLLM: not run (" + "; ".join(res["notes"]) + ").", ""]
    st = res["structured"]
    lines += ["## 1. Structured output, greedy (temperature 0)", "",
              f"{len(st['prompts'])} prompts (token ids from Pier's tokenizer, the same ids to both engines), "
              f"max_tokens {st['max_tokens']}, schema: `{json.dumps(st['schema'], separators=(',', ':'))}`. "
              f"Pier: {st['pier_valid_json']}/{len(st['prompts'])} outputs are complete JSON documents with all "
              "five fields.", ""]
    if "vllm_compact" in st:
        lines += ["| vLLM structured_outputs_config | identical text | differing | vLLM outputs that are complete "
                  "documents | vLLM's token ids accepted by Pier's grammar |", "|---|---|---|---|---|"]
        for key in ("vllm_default_whitespace", "vllm_compact"):
            d = st[key]
            n = d["identical"] + d["differing"]
            lines.append(f"| `{json.dumps(d['structured_outputs_config'])}` | {d['identical']}/{n} | "
                         f"{d['differing']}/{n} | {d['vllm_valid_json']}/{n} | {d['accepted_by_pier_grammar']}/{n} |")
        xg = st.get("vllm_default_whitespace_xguidance")
        if xg:
            lines += ["", "vLLM's default engine again, each request's schema carrying `\"x-guidance\": "
                      "{\"whitespace_flexible\": false}`: " + (f"{xg['identical']}/{xg['identical'] + xg['differing']} "
                                                                "identical to Pier" if "error" not in xg
                                                                else f"refused: {xg['error']}") + "."]
        c = st["control_unconstrained"]
        lines += ["", f"Control, no grammar (greedy, {c['max_tokens']} tokens, ignore_eos): {c['identical_ids']}/"
                  f"{c['of']} prompts give identical token ids on both engines"
                  + (f" (first divergent token per prompt: {c['first_divergent_token']})"
                     if c["identical_ids"] < c["of"] else "") + ".", ""]
        for key, what in (("vllm_default_whitespace", "vLLM's default whitespace"), ("vllm_compact",
                                                                                    "disable_any_whitespace")):
            diff = [r for r in st[key]["rows"] if not r["identical_text"]]
            if diff:
                r = diff[0]
                lines += [f"Example difference ({what}), prompt {r['prompt']} ({_md(st['prompts'][r['prompt']], 60)}), "
                          f"first divergent token {r['first_divergent_token']}:", "",
                          f"- Pier ({r['pier_len']} tokens, finish {r['pier_finish']}): {_md(r['pier_text'])}",
                          f"- vLLM ({r['vllm_len']} tokens, finish {r['vllm_finish']}): {_md(r['vllm_text'])}", ""]
            else:
                lines += [f"With {what}: no difference, every output text and token id identical.", ""]
        lines += ["Outputs (compact; identical on both engines where marked):", "", "| prompt | Pier's output | same "
                  "as vLLM |", "|---|---|---|"]
        for r in st["vllm_compact"]["rows"]:
            lines.append(f"| {_md(st['prompts'][r['prompt']], 40)} | {_md(r['pier_text'], 140)} | "
                         f"{'yes' if r['identical_text'] else 'no'} |")
        lines.append("")
    mc = res["masking_cost"]
    lines += ["## 2. The per-token cost of masking", "",
              f"{mc['requests']} requests x {mc['tokens']} tokens, all at once, temperature 1 with a seed per request, "
              "`ignore_eos`, prompts of 16–64 random token ids; with and without the schema "
              "`{\"rows\": 16 x {name ≤ 12 chars, ok, color enum, count 0–999}}` (16 rows exactly, so no document "
              "can end inside the budget and both engines mask every step). Rounds interleave: each round runs both "
              "engines, each engine both kinds back to back, the order alternating from round to round. tok/s = "
              "generated tokens ÷ wall time of the whole batch (prefill included; prompts repeat across runs, so "
              "after the first they are prefix-cache hits on both engines).", ""]
    has_v = bool(mc["rounds"]) and "vllm_ratio" in mc["rounds"][0]
    head = "| round | Pier plain tok/s | Pier schema tok/s | Pier ratio |"
    sep = "|---|---|---|---|"
    if has_v:
        head += " vLLM plain tok/s | vLLM schema tok/s | vLLM ratio |"
        sep += "---|---|---|"
    lines += [head + " load |", sep + "---|"]
    for x in mc["rounds"]:
        row = (f"| {x['round']} | {_f(x['pier_plain_tok_s'], 0)} | {_f(x['pier_schema_tok_s'], 0)} | "
               f"{_f(x['pier_ratio'])} |")
        if has_v:
            row += f" {_f(x['vllm_plain_tok_s'], 0)} | {_f(x['vllm_schema_tok_s'], 0)} | {_f(x['vllm_ratio'])} |"
        lines.append(row + f" {x['load']} |")
    lines += ["", "| engine | with ÷ without schema, median (min – max) | plain tok/s median (min – max) | "
              "schema tok/s median (min – max) |", "|---|---|---|---|"]
    for key, label in (("pier", "Pier"), ("vllm", "vLLM")):
        if key in mc:
            m = mc[key]
            r = m["ratio"]
            lines.append(f"| {label} | {_f(r['median'])} ({_f(r['min'])} – {_f(r['max'])}) | "
                         f"{_f(m['plain_tok_s']['median'], 0)} ({_f(m['plain_tok_s']['min'], 0)} – "
                         f"{_f(m['plain_tok_s']['max'], 0)}) | {_f(m['schema_tok_s']['median'], 0)} "
                         f"({_f(m['schema_tok_s']['min'], 0)} – {_f(m['schema_tok_s']['max'], 0)}) |")
    if has_v:
        a, b = mc["pier_over_vllm_plain"], mc["pier_over_vllm_schema"]
        early = sum(x.get("pier_schema_stopped_early", 0) + x.get("vllm_schema_stopped_early", 0) for x in mc["rounds"])
        lines += ["", f"Pier ÷ vLLM within a round: plain {_f(a['median'], 2)}x ({_f(a['min'], 2)} – "
                  f"{_f(a['max'], 2)}), with the schema {_f(b['median'], 2)}x ({_f(b['min'], 2)} – {_f(b['max'], 2)}). "
                  f"Schema requests that ended before {mc['tokens']} tokens, all rounds, both engines: {early}."]
    lines.append("")
    e = res["embeddings"]
    lines += ["## 3. Embeddings", "",
              f"{len(e['sentences'])} sentences; Pier: the engine's embed request (`SamplingParams.from_json("
              "{\"embed\": true, \"max_tokens\": 1})`, what `/v1/embeddings` sends an LLM), on Pier's token ids; "
              "vLLM: `LLM(model, runner=\"pooling\").embed(texts)` (vLLM tokenizes the text itself"
              + (f"; its prompt token ids {'are identical to' if e['same_prompt_ids'] else 'DIFFER from'} Pier's"
                 if "same_prompt_ids" in e else "") + "); transformers: `AutoModel` (LlamaModel) last_hidden_state, "
              "the last token's or the mean, L2-normalised.", ""]
    if "cos_pier_vllm" in e:
        lines += ["| sentence | cos Pier/vLLM | cos Pier/HF last token | cos vLLM/HF last token | cos Pier/HF mean |",
                  "|---|---|---|---|---|"]
        for i, sent in enumerate(e["sentences"]):
            lines.append(f"| {_md(sent, 50)} | {e['cos_pier_vllm'][i]:.9f} | {e['cos_pier_hf_last'][i]:.9f} | "
                         f"{e['cos_vllm_hf_last'][i]:.9f} | {e['cos_pier_hf_mean'][i]:.4f} |")
        lines += ["", f"Min cosine Pier/vLLM: **{e['min_cos_pier_vllm']:.9f}** (target ≥ 0.999: "
                  f"{'MET' if e['min_cos_pier_vllm'] >= 0.999 else 'MISSED'}); largest element difference "
                  f"{e['max_abs_diff_pier_vllm']:.2e}; dimensions {e['dims'][0]} / {e['dims'][1]}; norms: Pier "
                  f"{min(e['pier_norms']):.6f}–{max(e['pier_norms']):.6f}, vLLM {min(e['vllm_norms']):.6f}–"
                  f"{max(e['vllm_norms']):.6f}. vLLM's pooling runner: runner_type {e['vllm_runner_type']}, "
                  f"architecture {e['vllm_architecture']}, `{e['vllm_pooler_config']}`.", ""]
    else:
        lines += [f"vLLM not run; Pier vs transformers' last token: min cosine {min(e['cos_pier_hf_last']):.9f}.", ""]
    lines += ["## What vLLM does here (read in its 0.32 source, checked in this run)", "",
              *[f"- {x}" for x in VLLM_FACTS],
              "", "## Not done", "",
              "- Both engines ran in-process/offline, not behind their HTTP servers: the comparison is of the engines "
              "(Pier's `/v1/embeddings` and `/v1/completions` forward to the same engine requests; vLLM's server "
              "settings are given above).",
              "- One model, float32, CPU only; the grammar comparison is greedy only (sampled outputs differ between "
              "engines by design: different random generators).", ""]
    if res["notes"]:
        lines += ["## Notes", "", *[f"- {n}" for n in res["notes"]], ""]
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------------

def main() -> None:  # noqa: C901, PLR0912, PLR0915 (one straight run, step by step)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--vllm-dir", type=Path, default=Path(os.path.expanduser("~/vllm-ref")))
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-worker", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.vllm_worker is not None:
        vllm_worker(a.vllm_worker)
        return

    from bench.common import CACHE, RESULTS, git_describe, loadavg, machine
    from bench.structured_output import build_model
    from pier.backends.llm.config import EngineConfig
    from pier.backends.llm.engine import LLMEngine

    folder = CACHE / "vllm_side_by_side" / "model"
    if not (folder / "config.json").is_file():
        build_model(folder)
    log_path = CACHE / "vllm_side_by_side" / "vllm.log"
    notes: list[str] = []
    py, why = (None, "skipped (--no-vllm)") if a.no_vllm else vllm_python(a.vllm_dir)
    if why:
        notes.append(f"vLLM: {why}")
        log(why)
    pier_cfg = dict(kv_cache_memory_bytes=256 << 20, max_model_len=MAX_MODEL_LEN)
    engine = LLMEngine(folder, EngineConfig(**pier_cfg))
    from importlib.metadata import version

    res: dict[str, Any] = {"machine": machine(), "pier_llguidance": version("llguidance"),
                           "pier_torch": version("torch"), "revision": git_describe(), "load_at_start": loadavg(),
                           "model": "random-weight Llama (bench/structured_output.py build_model): hidden 512, "
                                    "8 layers, 8 heads, 4 KV heads, intermediate 1376, byte-level BPE vocab "
                                    f"{engine.model_config.vocab_size}, float32",
                           "pier_engine_config": {k: str(v) for k, v in pier_cfg.items()}, "notes": notes}

    prompt_ids = [engine.encode_prompt(p) for p in PROMPTS]
    greedy = {"temperature": 0.0, "max_tokens": 160}
    so_reqs = [{"ids": p, "params": greedy, "schema": SCHEMA} for p in prompt_ids]
    ctl_reqs = [{"ids": p, "params": {"temperature": 0.0, "max_tokens": CONTROL_TOKENS, "ignore_eos": True},
                 "schema": None} for p in prompt_ids]
    rng = random.Random(0)
    thr_prompts = [[rng.randrange(2, 300) for _ in range(rng.randint(16, 64))] for _ in range(a.requests)]

    def thr_reqs(schema: dict[str, Any] | None) -> list[dict[str, Any]]:
        return [{"ids": p, "params": {"temperature": 1.0, "max_tokens": a.tokens, "ignore_eos": True, "seed": i},
                 "schema": schema} for i, p in enumerate(thr_prompts)]

    log("Pier: warm-up, greedy structured + control")
    pier_generate(engine, [{"ids": prompt_ids[0], "params": {"max_tokens": 4}, "schema": SCHEMA}])
    pier_so = pier_generate(engine, so_reqs)["outputs"]
    pier_ctl = pier_generate(engine, ctl_reqs)["outputs"]
    res["structured"] = {"schema": SCHEMA, "prompts": PROMPTS, "max_tokens": greedy["max_tokens"],
                         "pier_valid_json": sum(valid_json(o["text"], SCHEMA) for o in pier_so)}
    res["structured"]["pier_outputs"] = [o["text"] for o in pier_so]

    so_default = {"backend": "guidance"}
    so_compact = {"backend": "guidance", "disable_any_whitespace": True}
    rounds: list[dict[str, Any]] = []
    if py is not None:
        # (a) vLLM's default whitespace: one engine for the greedy comparison only
        w = VllmWorker(py, log_path)
        try:
            info = w.call(op="init", kind="generate", model=str(folder), so_config=so_default)
            log(f"vLLM {info['version']} up in {info['init_s']:.0f} s (structured_outputs_config {so_default})")
            res["vllm"] = {"version": info["version"], "llguidance": info["llguidance"], "torch": info["torch"],
                           "generate_settings": info["settings"], "env": info["env"], "init_s": [info["init_s"]]}
            v_so = w.call(op="generate", requests=so_reqs)["outputs"]
            res["structured"]["vllm_default_whitespace"] = {
                "structured_outputs_config": so_default, **compare_outputs(pier_so, v_so),
                "vllm_valid_json": sum(valid_json(o["text"], SCHEMA) for o in v_so),
                "accepted_by_pier_grammar": sum(grammar_accepts(engine, SCHEMA, o["ids"])["all"] for o in v_so)}
            # the same engine, compact JSON asked for per request, inside the schema (what Pier adds)
            xg = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
            try:
                v_xg = w.call(op="generate", requests=[{**r, "schema": xg} for r in so_reqs])["outputs"]
                cmp = compare_outputs(pier_so, v_xg)
                res["structured"]["vllm_default_whitespace_xguidance"] = {
                    "identical": cmp["identical"], "differing": cmp["differing"]}
            except RuntimeError as exc:
                res["structured"]["vllm_default_whitespace_xguidance"] = {"error": str(exc)}
        finally:
            w.close()
        # (b) compact JSON as Pier's: greedy comparison, the control, then the throughput rounds
        w = VllmWorker(py, log_path)
        try:
            info = w.call(op="init", kind="generate", model=str(folder), so_config=so_compact)
            log(f"vLLM up in {info['init_s']:.0f} s (structured_outputs_config {so_compact})")
            res["vllm"]["init_s"].append(info["init_s"])
            v_so = w.call(op="generate", requests=so_reqs)["outputs"]
            cmp = compare_outputs(pier_so, v_so)
            for row, o in zip(cmp["rows"], v_so):
                row["vllm_ids_accepted_by_pier_grammar"] = grammar_accepts(engine, SCHEMA, o["ids"])
            res["structured"]["vllm_compact"] = {
                "structured_outputs_config": so_compact, **cmp,
                "vllm_valid_json": sum(valid_json(o["text"], SCHEMA) for o in v_so),
                "accepted_by_pier_grammar": sum(r["vllm_ids_accepted_by_pier_grammar"]["all"] for r in cmp["rows"])}
            v_ctl = w.call(op="generate", requests=ctl_reqs)["outputs"]
            ctl = compare_outputs(pier_ctl, v_ctl)
            res["structured"]["control_unconstrained"] = {
                "max_tokens": CONTROL_TOKENS, "identical_ids": sum(r["identical_ids"] for r in ctl["rows"]),
                "of": len(ctl["rows"]), "first_divergent_token": [r["first_divergent_token"] for r in ctl["rows"]]}
            log(f"structured greedy: {cmp['identical']}/{len(cmp['rows'])} identical (compact); "
                f"control {res['structured']['control_unconstrained']['identical_ids']}/{len(ctl['rows'])}")
            w.call(op="generate", requests=thr_reqs(ROWS_SCHEMA)[:2])  # warm-up
            pier_generate(engine, thr_reqs(ROWS_SCHEMA)[:2])
            for r in range(a.rounds):
                row: dict[str, Any] = {"round": r + 1, "load": loadavg()}
                order = ("plain", "schema") if r % 2 == 0 else ("schema", "plain")
                for eng_name in ("pier", "vllm") if r % 2 == 0 else ("vllm", "pier"):
                    for kind in order:
                        reqs = thr_reqs(ROWS_SCHEMA if kind == "schema" else None)
                        got = pier_generate(engine, reqs) if eng_name == "pier" else w.call(op="generate",
                                                                                             requests=reqs)
                        n = sum(len(o["ids"]) for o in got["outputs"])
                        row[f"{eng_name}_{kind}_tok_s"] = n / got["wall_s"]
                        row[f"{eng_name}_{kind}_tokens"] = n
                        if kind == "schema":
                            row[f"{eng_name}_schema_stopped_early"] = sum(
                                o["finish"] == "stop" or len(o["ids"]) < a.tokens for o in got["outputs"])
                    row[f"{eng_name}_ratio"] = row[f"{eng_name}_schema_tok_s"] / row[f"{eng_name}_plain_tok_s"]
                rounds.append(row)
                log(f"round {r + 1}: Pier {row['pier_plain_tok_s']:.0f} / {row['pier_schema_tok_s']:.0f} tok/s "
                    f"(x{row['pier_ratio']:.3f}); vLLM {row['vllm_plain_tok_s']:.0f} / "
                    f"{row['vllm_schema_tok_s']:.0f} tok/s (x{row['vllm_ratio']:.3f})")
        finally:
            w.close()
    else:
        pier_generate(engine, thr_reqs(ROWS_SCHEMA)[:2])
        for r in range(a.rounds):
            row = {"round": r + 1, "load": loadavg()}
            for kind in ("plain", "schema") if r % 2 == 0 else ("schema", "plain"):
                got = pier_generate(engine, thr_reqs(ROWS_SCHEMA if kind == "schema" else None))
                row[f"pier_{kind}_tok_s"] = sum(len(o["ids"]) for o in got["outputs"]) / got["wall_s"]
            row["pier_ratio"] = row["pier_schema_tok_s"] / row["pier_plain_tok_s"]
            rounds.append(row)
            log(f"round {r + 1}: Pier x{row['pier_ratio']:.3f}")
    thr: dict[str, Any] = {"schema": ROWS_SCHEMA, "requests": a.requests, "tokens": a.tokens, "rounds": rounds}
    for eng_name in ("pier", "vllm"):
        if rounds and f"{eng_name}_ratio" in rounds[0]:
            thr[eng_name] = {"ratio": spread([x[f"{eng_name}_ratio"] for x in rounds]),
                             "plain_tok_s": spread([x[f"{eng_name}_plain_tok_s"] for x in rounds]),
                             "schema_tok_s": spread([x[f"{eng_name}_schema_tok_s"] for x in rounds])}
    if rounds and "vllm_ratio" in rounds[0]:
        thr["pier_over_vllm_plain"] = spread([x["pier_plain_tok_s"] / x["vllm_plain_tok_s"] for x in rounds])
        thr["pier_over_vllm_schema"] = spread([x["pier_schema_tok_s"] / x["vllm_schema_tok_s"] for x in rounds])
    res["masking_cost"] = thr

    # 3. embeddings
    log("embeddings: Pier, transformers")
    p_vecs, p_ids = pier_embed(engine, SENTENCES)
    del engine
    hf = hf_reference(folder, p_ids)
    emb: dict[str, Any] = {"sentences": SENTENCES,
                           "pier_norms": [math.sqrt(sum(x * x for x in v)) for v in p_vecs],
                           "cos_pier_hf_last": [cosine(p, h) for p, h in zip(p_vecs, hf["last"])],
                           "cos_pier_hf_mean": [cosine(p, h) for p, h in zip(p_vecs, hf["mean"])]}
    if py is not None:
        w = VllmWorker(py, log_path)
        try:
            info = w.call(op="init", kind="pooling", model=str(folder))
            res["vllm"]["init_s"].append(info["init_s"])
            log(f"vLLM pooling runner up in {info['init_s']:.0f} s; pooler {info['pooler_config']}")
            got = w.call(op="embed", texts=SENTENCES)
            v_vecs = got["embeddings"]
            emb.update({"vllm_settings": info["settings"], "vllm_pooler_config": info["pooler_config"],
                        "vllm_runner_type": info["runner_type"], "vllm_architecture": info["architecture"],
                        "same_prompt_ids": got["prompt_ids"] == p_ids,
                        "vllm_norms": [math.sqrt(sum(x * x for x in v)) for v in v_vecs],
                        "dims": [len(p_vecs[0]), len(v_vecs[0])],
                        "cos_pier_vllm": [cosine(p, v) for p, v in zip(p_vecs, v_vecs)],
                        "cos_vllm_hf_last": [cosine(v, h) for v, h in zip(v_vecs, hf["last"])],
                        "cos_vllm_hf_mean": [cosine(v, h) for v, h in zip(v_vecs, hf["mean"])],
                        "max_abs_diff_pier_vllm": max(max(abs(x - y) for x, y in zip(p, v))
                                                      for p, v in zip(p_vecs, v_vecs))})
            emb["min_cos_pier_vllm"] = min(emb["cos_pier_vllm"])
            log(f"embeddings: min cosine Pier/vLLM {emb['min_cos_pier_vllm']:.6f}")
        finally:
            w.close()
    res["embeddings"] = emb
    res["load_at_end"] = loadavg()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "vllm_side_by_side.json").write_text(json.dumps(res, indent=2, ensure_ascii=False) + "\n")
    (RESULTS / "vllm_side_by_side.md").write_text(report(res, " ".join(sys.argv[1:])))
    log(f"wrote {RESULTS / 'vllm_side_by_side.json'} and .md")


if __name__ == "__main__":
    main()
