"""The API document (issue 32, part 3): /openapi.json is a valid OpenAPI 3.0 document of every route
the HTTP app serves; /docs renders it in Chromium with no network; and schemathesis, driven by the
document against a live server for a bounded time, finds no 5xx, no hang and no response that
breaks the document."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.conftest import ROOT, PierProcess, start_pier
from tests.e2e import chromium

EXAMPLES = ROOT / "model_repository"
FUZZ_SECONDS = 90


def test_the_document_validates_and_covers_every_route(examples: PierProcess) -> None:
    from openapi_spec_validator import validate

    from pier.frontends.apidoc.document import OPERATIONS

    doc = requests.get(f"{examples.base()}/openapi.json", timeout=10).json()
    validate(doc)  # raises with the first problem
    assert doc["openapi"].startswith("3.0")
    ops = {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    undocumented = sorted(op for op in ops if op not in OPERATIONS)
    assert undocumented == [], f"routes the document does not describe: {undocumented}"
    for must in [("POST", "/v2/models/{model}/infer"), ("GET", "/v2/health/ready"), ("POST", "/v1/chat/completions"),
                 ("POST", "/v2/repository/index"), ("GET", "/api/status"), ("GET", "/v2/models/{model}/config")]:
        assert must in ops, must
    # Errors: one shape, documented on every operation.
    assert all("default" in op["responses"] for item in doc["paths"].values() for op in item.values())


@pytest.mark.skipif(chromium.executable() is None, reason="no chromium (apt-get install chromium)")
@pytest.mark.slow
def test_docs_render_with_no_network(examples: PierProcess, tmp_path: Path) -> None:
    async def drive() -> None:
        async with chromium.Chromium(tmp_path / "profile") as browser:
            assert await browser.open(examples.base() + "/docs") == 200
            title = await browser.wait_for("document.querySelector('.information-container .title')?.textContent",
                                           timeout=20)
            assert "Pier" in title
            ops = await browser.wait_for("document.querySelectorAll('.opblock').length", timeout=20)
            doc = requests.get(f"{examples.base()}/openapi.json", timeout=10).json()
            assert ops == sum(len(item) for item in doc["paths"].values())
            # Everything it fetched came from this server (the machine has no route out anyway: no CDN).
            loaded = await browser.evaluate("performance.getEntriesByType('resource').map(e => e.name)")
            assert loaded and all(url.startswith(examples.base()) for url in loaded), loaded

    asyncio.run(drive())


# 503 is Triton's answer for a model that is not ready (the fuzzer unloads models): not a server error
_NOT_A_SERVER_ERROR = """
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "503"]
"""


def _fuzz(base: str, tmp_path: Path, config: str, seconds: int, *args: str) -> int:
    """schemathesis against the live server at `base` for at most `seconds`, driven by its document:
    no 5xx, no request over 20 s, every status, content type and body as documented. The cases run."""
    report = tmp_path / "report.ndjson"
    (tmp_path / "schemathesis.toml").write_text(config + _NOT_A_SERVER_ERROR)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(tmp_path / "schemathesis.toml"), "run",
           f"{base}/openapi.json",
           "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                       "response_schema_conformance",
           "--max-time", str(seconds), "--request-timeout", "20", "--workers", "1",
           "--max-examples", "25", "--generation-deterministic", "--no-color", "--phases", "examples,coverage,fuzzing",
           "--report", "ndjson", "--report-ndjson-path", str(report), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120, cwd=tmp_path)
    out = run.stdout + run.stderr
    cases = _cases(report)
    print(f"schemathesis: {cases} cases\n{out[-3000:]}")
    assert run.returncode == 0, out[-12000:]
    assert requests.get(f"{base}/v2/health/live", timeout=10).status_code == 200
    return cases


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(examples: PierProcess, tmp_path: Path) -> None:
    # Half the model names and versions it tries are the served ones (the rest random): requests then
    # reach the models, the repository API and the statistics, not only the unknown-model errors.
    names = ", ".join(f'"{n}"' for n in sorted(p.name for p in EXAMPLES.iterdir()))
    config = f"""
[dictionaries.models]
values = [{names}]
[dictionaries.versions]
values = ["1"]
[parameters]
"path.model" = {{ dictionary = "models", probability = 0.5 }}
"path.version" = {{ dictionary = "versions", probability = 0.5 }}
"""
    assert _fuzz(examples.base(), tmp_path, config, FUZZ_SECONDS) >= 200


@pytest.mark.llm
@pytest.mark.slow
def test_schemathesis_on_the_openai_routes_of_a_served_llm(tmp_path: Path) -> None:
    """The OpenAI and vLLM routes with a real (tiny, random-weight) LLM behind them: every body
    names the served model, so the fuzzer's sampling settings, prompts and messages reach it."""
    from tests.backends.llm.tiny_model import build_model

    folder = build_model(tmp_path / "tiny-chat", "llama")
    server = start_pier([], str(folder), log_path=tmp_path / "pier.log", timeout=120)
    try:
        cases = _fuzz(server.base(), tmp_path, '[parameters]\n"body.model" = "tiny-chat"\n', 60,
                      "--include-path-regex", "^/(v1/|tokenize|detokenize)")
        assert cases >= 100
    finally:
        assert server.stop() == 0, server.log()


def _cases(report: Path) -> int:
    """The test cases schemathesis ran, from its ndjson events."""
    n = 0
    for line in report.read_text().splitlines():
        event = json.loads(line)
        for key, value in event.items():
            if key == "ScenarioFinished" and isinstance(value, dict):
                n += len(value.get("recorder", {}).get("cases", {}))
    return n
