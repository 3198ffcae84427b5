"""The status page (issue 32, part 2) in a real headless Chromium driven over the DevTools
protocol, and the JSON behind it: every model of the example repository with its state, a load or
unload through the API seen within seconds without a reload, throughput and latency once traffic
flows, the LLM engine's figures, and API keys and restricted APIs honoured."""

from __future__ import annotations

import asyncio
import base64
import os
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import ROOT, PierProcess, start_pier
from tests.e2e import chromium

EXAMPLES = ROOT / "model_repository"
NAMES = sorted(p.name for p in EXAMPLES.iterdir() if (p / "config.pbtxt").exists())
ROWS = "Object.fromEntries([...document.querySelectorAll('#models tbody tr[data-model]')]" \
       ".map(r => [r.dataset.model, r.dataset.state]))"
needs_chromium = pytest.mark.skipif(chromium.executable() is None, reason="no chromium (apt-get install chromium)")


def _infer_identity(server: PierProcess, n: int) -> None:
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1.0, 2.0, 3.0, 4.0]}]}
    for _ in range(n):
        r = requests.post(f"{server.base()}/v2/models/identity_fp32/infer", json=body, timeout=10)
        assert r.status_code == 200, r.text


def test_api_status_carries_every_model_and_its_figures(examples: PierProcess) -> None:
    _infer_identity(examples, 20)
    deadline = time.monotonic() + 30
    while True:  # the history samples every 2 s: wait for a point that saw the requests
        doc = requests.get(f"{examples.base()}/api/status", timeout=10).json()
        rows = {m["name"]: m for m in doc["models"]}
        series = rows["identity_fp32"]["stats"]["series"]
        if any(series.get("requests_per_s") or ()) and any(v is not None for v in series["p99_ms"]):
            break
        assert time.monotonic() < deadline, doc
        time.sleep(0.5)
    assert sorted(rows) == NAMES and all(m["state"] == "READY" for m in rows.values()), rows
    assert doc["withheld"] == [] and doc["server"]["name"] == "triton" and doc["server"]["uptime_s"] > 0
    assert doc["server"]["settings"]["model_control_mode"] == "explicit"
    identity = rows["identity_fp32"]
    assert identity["traffic_percent"] == 100.0
    assert identity["execution"]["instances"] and identity["execution"]["backend"] == "onnxruntime_onnx"
    assert identity["stats"]["success"] >= 20 and identity["stats"]["queue"] == 0
    assert identity["stats"]["in_flight"] == 0
    assert rows["accumulate"]["execution"]["scheduler"] == "sequence batching"
    assert rows["mlp_torchscript"]["execution"]["backend"] == "pytorch_libtorch"


@needs_chromium
@pytest.mark.slow
def test_the_page_follows_loads_and_unloads_without_a_reload(examples: PierProcess, tmp_path: Path) -> None:
    async def drive() -> None:
        async with chromium.Chromium(tmp_path / "profile") as browser:
            assert await browser.open(examples.base() + "/") == 200
            states = await browser.wait_for(f"(() => {{ const r = {ROWS}; return Object.keys(r).length == "
                                            f"{len(NAMES)} && r }})()", timeout=15)
            assert sorted(states) == NAMES and set(states.values()) == {"READY"}, states
            assert "ready" in await browser.evaluate("document.querySelector('#server').textContent")

            requests.post(f"{examples.base()}/v2/repository/models/simple/unload", timeout=30).raise_for_status()
            started = time.monotonic()
            await browser.wait_for(f"{ROWS}.simple === 'UNAVAILABLE'", timeout=8)
            unloaded_after = time.monotonic() - started
            requests.post(f"{examples.base()}/v2/repository/models/simple/load", timeout=60).raise_for_status()
            await browser.wait_for(f"{ROWS}.simple === 'READY'", timeout=8)
            assert unloaded_after < 5, unloaded_after

            _infer_identity(examples, 10)  # throughput and latency appear, still without a reload
            await browser.wait_for("[...document.querySelectorAll('tr[data-model=identity_fp32] td.figure')]"
                                   ".some(td => / ms/.test(td.textContent) && !/^– \\/ –/.test(td.textContent))",
                                   timeout=10)
            await browser.screenshot(tmp_path / "status.png")
        shot = (tmp_path / "status.png").read_bytes()
        assert shot[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("PIER_STATUS_SCREENSHOT"):  # docs/status-page.png is made so
            Path(os.environ["PIER_STATUS_SCREENSHOT"]).write_bytes(shot)

    asyncio.run(drive())


@pytest.mark.slow
@pytest.mark.frontends  # the keys are checked where the request is served: relayed, in the server
def test_api_keys_and_restricted_apis_hold_for_the_page(tmp_path: Path) -> None:
    server = start_pier([EXAMPLES], "--api-key=sekret", "--http-restricted-api=statistics,model-config:admin=yes",
                        log_path=tmp_path / "pier.log", timeout=120)
    try:
        base = server.base()
        for path in ("/", "/api/status", "/static/status.js"):
            r = requests.get(base + path, timeout=10)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Basic"), (path, r.text)
        assert requests.get(f"{base}/api/status", headers={"Authorization": "Bearer wrong"}, timeout=10) \
            .status_code == 401
        basic = "Basic " + base64.b64encode(b"anyone:sekret").decode()
        doc = requests.get(f"{base}/api/status", headers={"Authorization": basic}, timeout=10).json()
        # The key opens the page; the restricted categories stay closed without their header.
        assert doc["withheld"] == ["model-config", "statistics"]
        assert sorted(m["name"] for m in doc["models"]) == NAMES
        assert not any("stats" in m or "execution" in m for m in doc["models"])
        doc = requests.get(f"{base}/api/status", headers={"Authorization": "Bearer sekret", "admin": "yes"},
                           timeout=10).json()
        assert doc["withheld"] == [] and all("stats" in m and "execution" in m for m in doc["models"])
        if chromium.executable() is not None:
            async def drive() -> None:
                async with chromium.Chromium(tmp_path / "profile") as browser:
                    # No key: the browser is asked for Basic credentials (headless, it cannot ask anyone)
                    with pytest.raises(RuntimeError, match="ERR_INVALID_AUTH_CREDENTIALS"):
                        await browser.open(base + "/")
                    assert await browser.open(base + "/", {"Authorization": "Bearer sekret"}) == 200
                    notice = await browser.wait_for("!document.querySelector('#notice').hidden && "
                                                    "document.querySelector('#notice').textContent")
                    assert "statistics" in notice
                    states = await browser.wait_for(f"Object.keys({ROWS}).length == {len(NAMES)} && {ROWS}")
                    assert set(states.values()) == {"READY"}

            asyncio.run(drive())
    finally:
        assert server.stop() == 0, server.log()


@pytest.mark.llm
@pytest.mark.slow
def test_an_llm_model_shows_its_engine(tmp_path: Path) -> None:
    from tests.backends.llm.tiny_model import build_model

    folder = build_model(tmp_path / "tiny-chat", "llama")
    server = start_pier([], str(folder), log_path=tmp_path / "pier.log", timeout=120)
    try:
        body = {"model": "tiny-chat", "prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        for _ in range(3):
            assert requests.post(f"{server.base()}/v1/completions", json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + 30
        while True:
            doc = requests.get(f"{server.base()}/api/status", timeout=10).json()
            (model,) = doc["models"]
            series = model["stats"]["series"]
            if any(series.get("tokens_per_s") or ()):
                break
            assert time.monotonic() < deadline, doc
            time.sleep(0.5)
        llm = model["stats"]["llm"]
        assert model["name"] == "tiny-chat" and model["execution"]["backend"] == "llm"
        # The engine's gauges as its last step reported them (vllm:num_requests_running and waiting)
        assert 0 <= llm["kv_cache_usage"] <= 1 and llm["running"] >= 0 and llm["waiting"] >= 0
        assert llm["adapters"] == []
        assert any(v is not None and v > 0 for v in series["ttft_p50_ms"]), series
    finally:
        assert server.stop() == 0, server.log()

