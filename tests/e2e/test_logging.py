"""tritonserver's log flags and the logging extension (GET/POST /v2/logging, gRPC LogSettings)
on a real `pier serve`: the settings switch severities and the line format of the running
server's log, and bad updates are refused with Triton's words (4xx where Triton says 500)."""

from __future__ import annotations

import re
import shutil
import socket
import time

import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import EXAMPLE_REPO, start_pier

ISO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ I pier", re.M)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("logging")
    shutil.copytree(EXAMPLE_REPO / "identity_fp32", root / "repo" / "identity_fp32")
    log_file = root / "pier-own.log"
    proc = start_pier([root / "repo"], "--model-control-mode=explicit", "--load-model=identity_fp32",
                      "--log-format=ISO8601", f"--log-file={log_file}", log_path=root / "stdout.log")
    proc.log_file = log_file  # type: ignore[attr-defined]
    yield proc
    assert proc.stop() == 0


def _log_after(server, mark: int, needle: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = server.log_file.read_text()[mark:]
        if needle in text or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def _malformed_request(server) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
        sock.recv(4096)


def _post(server, body) -> requests.Response:
    return requests.post(f"{server.base()}/v2/logging", json=body, timeout=10)


def test_flags_set_the_starting_settings_and_the_log_goes_to_the_file(server):
    assert requests.get(f"{server.base()}/v2/logging", timeout=10).json() == {
        "log_file": str(server.log_file), "log_info": True, "log_warning": True, "log_error": True,
        "log_verbose_level": 0, "log_format": "ISO8601"}
    text = server.log_file.read_text()
    assert ISO_LINE.search(text) and "Pier is ready" in text, text
    assert "Pier is ready" not in server.log()  # not on stderr


def test_updates_switch_severities_and_format_at_run_time(server):
    base = server.base()
    r = _post(server, {"log_info": False})
    assert r.status_code == 200 and r.json()["log_info"] is False
    mark = len(server.log_file.read_text())
    assert requests.post(f"{base}/v2/repository/models/identity_fp32/unload", timeout=30).status_code == 200
    assert requests.post(f"{base}/v2/repository/models/identity_fp32/load", timeout=60).status_code == 200
    _malformed_request(server)
    time.sleep(0.5)
    quiet = server.log_file.read_text()[mark:]
    assert "unloading 'identity_fp32'" not in quiet and " D " not in quiet, quiet
    r = _post(server, {"log_info": True, "log_format": "default", "log_verbose_level": 1})
    assert r.json() == {"log_file": str(server.log_file), "log_info": True, "log_warning": True,
                        "log_error": True, "log_verbose_level": 1, "log_format": "default"}
    mark = len(server.log_file.read_text())
    assert requests.post(f"{base}/v2/repository/models/identity_fp32/unload", timeout=30).status_code == 200
    text = _log_after(server, mark, "unloading 'identity_fp32'")
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ I pier\.repository\] unloading 'identity_fp32'", text,
                     re.M), text
    assert "D pier.http] HTTP request: POST /v2/repository/models/identity_fp32/unload" in text, text
    _malformed_request(server)  # aiohttp's report of it is a DEBUG line (see app._ClientMistakes)
    text = _log_after(server, mark, " D aiohttp")
    assert re.search(r"^\S+ \S+ D aiohttp", text, re.M), text  # verbose: DEBUG lines too
    assert requests.post(f"{base}/v2/repository/models/identity_fp32/load", timeout=60).status_code == 200
    _post(server, {"log_verbose_level": 0, "log_format": "ISO8601"})


def test_bad_updates_are_refused_and_change_nothing(server):
    before = requests.get(f"{server.base()}/v2/logging", timeout=10).json()
    for body, status, text in (
        ({"log_file": "/tmp/elsewhere.log"}, 501, "log file location can not be updated through network protocol"),
        ({"log_format": "xml"}, 400, "invalid argument for log_format, got: xml"),
        ({"log_verbose_level": -1}, 400, "log_verbose_level"),
        ({"log_verbose_level": 4294967296}, 400, "log_verbose_level"),  # gRPC carries it as uint32
        ({"log_info": "yes"}, 400, "log_info"),
        ({"log_error": False, "log_warning": 3}, 400, "log_warning"),  # nothing applies, not even log_error
        ([], 400, "must be a JSON object"),
    ):
        r = _post(server, body)
        assert r.status_code == status and text in r.json()["error"], (body, r.text)
    assert requests.get(f"{server.base()}/v2/logging", timeout=10).json() == before
    assert _post(server, {"unknown_key": 1}).json() == before  # ignored, as Triton does
    nulls = {"log_info": None, "log_verbose_level": None, "log_format": None, "log_file": None}
    assert _post(server, nulls).json() == before  # null values are ignored too, as Triton 2.51 does


def test_grpc_log_settings(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    got = client.get_log_settings(as_json=True)["settings"]
    assert got["log_format"] == {"string_param": "ISO8601"} and got["log_info"] == {"bool_param": True}
    updated = client.update_log_settings({"log_warning": False, "log_verbose_level": 0}, as_json=True)["settings"]
    assert updated["log_warning"] == {"bool_param": False}
    assert requests.get(f"{server.base()}/v2/logging", timeout=10).json()["log_warning"] is False
    with pytest.raises(InferenceServerException) as err:
        client.update_log_settings({"log_format": "xml"})
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as err:
        client.update_log_settings({"log_file": "x"})
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    client.update_log_settings({"log_warning": True})
