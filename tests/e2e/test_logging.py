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

pytestmark = pytest.mark.frontends  # log settings are sent to the frontends, which log themselves

ISO_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ I \d+ [\w.]+:\d+\] ", re.M)


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
    assert "unloading 'identity_fp32'" not in quiet and "HTTP request:" not in quiet, quiet
    r = _post(server, {"log_info": True, "log_format": "default", "log_verbose_level": 1})
    assert r.json() == {"log_file": str(server.log_file), "log_info": True, "log_warning": True,
                        "log_error": True, "log_verbose_level": 1, "log_format": "default"}
    mark = len(server.log_file.read_text())
    assert requests.post(f"{base}/v2/repository/models/identity_fp32/unload", timeout=30).status_code == 200
    text = _log_after(server, mark, "unloading 'identity_fp32'")
    # tritonserver's default format (glog), the message escaped as a JSON string
    assert re.search(r"^I\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ manager\.py:\d+\] \"unloading 'identity_fp32'\"$", text,
                     re.M), text
    assert '] "HTTP request: POST /v2/repository/models/identity_fp32/unload"' in text, text  # verbose lines
    _malformed_request(server)  # aiohttp's report of it is a verbose line (see app._ClientMistakes)
    text = _log_after(server, mark, "web_protocol.py")
    assert re.search(r"^I\S+ \S+ \d+ web_protocol\.py:\d+\] \"", text, re.M), text
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


# tritonserver's record shapes (qa L0_logging log_format_test parses log files with these).
RECORD = {
    "default": re.compile(r"^[EWI]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ [\w.]+:\d+\] (?P<message>.*)$"),
    "ISO8601": re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ [EWI] \d+ [\w.]+:\d+\] (?P<message>.*)$"),
}
FORGED = {"default": "I0205 18:34:18.707423 1 file.cc:123] THIS ENTRY WAS INJECTED",
          "ISO8601": "2024-05-18T01:46:51Z I 1 file.cc:123] THIS ENTRY WAS INJECTED"}


def _records(path, record: re.Pattern) -> list[list[str]]:
    """The log's records: a line in the record shape starts one, other lines continue it."""
    records: list[list[str]] = []
    for line in path.read_text().splitlines():
        if record.match(line) or not records:
            records.append([line])
        else:
            records[-1].append(line)
    return records


@pytest.mark.parametrize("fmt", ["default", "ISO8601"])
@pytest.mark.parametrize("escaped", [True, False], ids=["escaped", "unescaped"])
def test_log_records_have_tritons_shape_and_cannot_be_forged(tmp_path, fmt: str, escaped: bool) -> None:
    """Every record is one line in Triton's shape, its message a JSON string (escaping on, the
    default), or a heading-less table; an input name with newlines cannot forge a record, unless
    TRITON_SERVER_ESCAPE_LOG_MESSAGES=0 turns escaping off, as in tritonserver."""
    import json

    import numpy as np
    import tritonclient.http as httpclient

    shutil.copytree(EXAMPLE_REPO / "simple", tmp_path / "repo" / "simple")
    log_file = tmp_path / "server.log"
    server = start_pier([tmp_path / "repo"], "--log-verbose=2147483647", "--log-info=1", "--log-error=1",
                        "--log-warning=1", f"--log-format={fmt}", f"--log-file={log_file}",
                        log_path=tmp_path / "stdout.log", env={"TRITON_SERVER_ESCAPE_LOG_MESSAGES": str(int(escaped))})
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        forged = httpclient.InferInput(f"\n{FORGED[fmt]}\n{FORGED[fmt]}", [1, 16], "INT32")
        forged.set_data_from_numpy(np.zeros((1, 16), np.int32))
        with pytest.raises(InferenceServerException):
            client.infer("simple", [forged])
    finally:
        assert server.stop() == 0
    records = _records(log_file, RECORD[fmt])
    assert len(records) > 5
    tables = 0
    for lines in records:
        head = RECORD[fmt].match(lines[0])
        assert head, lines
        message = head.group("message")
        if escaped and message:
            assert isinstance(json.loads(message), str), lines  # one JSON string: nothing forged
            assert len(lines) == 1, lines
        if not message and len(lines) > 1:  # a table: +---+ borders around | rows |
            tables += 1
            assert all(re.fullmatch(r"\+[-+]+\+|\| .* \|", row) for row in lines[1:]), lines
    assert tables >= 1
    injected = [lines for lines in records if lines == [FORGED[fmt]]]
    assert bool(injected) is not escaped, injected
