"""tritonserver command lines run unchanged: --id, gRPC TLS (one-way and mutual, with the real
tritonclient), keepalive settings, and the flags Pier has nothing to act on (accepted, and named
in a startup warning)."""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import EXAMPLE_REPO, ROOT, start_pier


@pytest.mark.frontends  # gRPC keepalive options go to the frontends' servers
def test_tritonserver_command_line_runs_unchanged(tmp_path: Path) -> None:
    server = start_pier(
        [EXAMPLE_REPO], "--model-control-mode=explicit", "--load-model=simple", "--id=edge-7",
        "--backend-directory=/opt/tritonserver/backends", "--backend-config=python,shm-default-byte-size=1048576",
        "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0", "--model-namespacing",
        "--grpc-keepalive-time=10000", "--grpc-keepalive-timeout=5000", "--grpc-keepalive-permit-without-calls=1",
        "--grpc-http2-max-pings-without-data=0", "--reuse-http-port=true",
        log_path=tmp_path / "log")
    try:
        assert requests.get(f"{server.base()}/v2", timeout=5).json()["name"] == "edge-7"
        g = grpcclient.InferenceServerClient(server.grpc_url)
        assert g.get_server_metadata().name == "edge-7" and g.is_model_ready("simple")
        log = server.log()
        assert ("accepted for tritonserver compatibility, with no effect in Pier: --backend-directory, "
                "--backend-config, --pinned-memory-pool-byte-size, --cuda-memory-pool-byte-size") in log, log
        assert "--model-namespacing" not in log, log  # implemented: tests/e2e/test_model_namespacing.py
    finally:
        assert server.stop() == 0


def test_bad_values_and_missing_certificates_are_errors(tmp_path: Path) -> None:
    for flags, text in ((["--grpc-keepalive-time=soon"], "--grpc-keepalive-time"),
                        (["--cache-config=redis,host=cache.local"], "only the 'local' cache is available"),
                        (["--cache-config=local,size=lots"], "size must be a number of bytes"),
                        (["--grpc-use-ssl"], "--grpc-server-cert is required with --grpc-use-ssl"),
                        (["--grpc-use-ssl", f"--grpc-server-cert={tmp_path / 'nope.pem'}"], "no such file")):
        proc = subprocess.run([sys.executable, "-m", "pier", "serve", f"--model-repository={EXAMPLE_REPO}", *flags],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 2 and text in proc.stderr, (flags, proc.stderr)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, both signed by it."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=pier-test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, cn in (("server", "localhost"), ("client", "pier-test-client")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", str(d / f"{name}.key"),
                 "-out", str(d / f"{name}.csr"))
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                 "-CAcreateserial", "-days", "2", "-out", str(d / f"{name}.pem"), "-extfile", str(d / "san.cnf"))
    return d


def _infer(url: str, **tls: object) -> list[int]:
    client = grpcclient.InferenceServerClient(url, **tls)
    a = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    b = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
    a.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    b.set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
    return client.infer("simple", [a, b], client_timeout=10).as_numpy("OUTPUT0")[0, :3].tolist()


@pytest.mark.frontends  # the frontends terminate TLS
def test_grpc_tls_and_mutual_tls(pki: Path, tmp_path: Path) -> None:
    base = ["--model-control-mode=explicit", "--load-model=simple", f"--grpc-server-cert={pki / 'server.pem'}",
            f"--grpc-server-key={pki / 'server.key'}"]
    server = start_pier([EXAMPLE_REPO], "--grpc-use-ssl=true", *base, log_path=tmp_path / "tls.log")
    try:
        url = f"localhost:{server.grpc_port}"
        assert _infer(url, ssl=True, root_certificates=str(pki / "ca.pem")) == [1, 2, 3]
        with pytest.raises(InferenceServerException):  # plaintext against a TLS port
            _infer(url)
        assert "(TLS)" in server.log()
    finally:
        assert server.stop() == 0
    server = start_pier([EXAMPLE_REPO], "--grpc-use-ssl-mutual=true", f"--grpc-root-cert={pki / 'ca.pem'}", *base,
                        log_path=tmp_path / "mtls.log")
    try:
        url = f"localhost:{server.grpc_port}"
        with pytest.raises(InferenceServerException):  # no client certificate
            _infer(url, ssl=True, root_certificates=str(pki / "ca.pem"))
        assert _infer(url, ssl=True, root_certificates=str(pki / "ca.pem"), private_key=str(pki / "client.key"),
                      certificate_chain=str(pki / "client.pem")) == [1, 2, 3]
    finally:
        assert server.stop() == 0


def test_model_config_name_picks_a_custom_config(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    shutil.copytree(EXAMPLE_REPO / "identity_fp32", repo / "identity_fp32")
    (repo / "simple" / "configs").mkdir()
    custom = (repo / "simple" / "config.pbtxt").read_text().replace("max_batch_size: 8", "max_batch_size: 2")
    assert "max_batch_size: 2" in custom
    (repo / "simple" / "configs" / "small.pbtxt").write_text(custom)
    server = start_pier([repo], "--model-config-name=small", log_path=tmp_path / "log")
    try:
        def config(model: str) -> dict:
            return requests.get(f"{server.base()}/v2/models/{model}/config", timeout=5).json()

        assert config("simple")["max_batch_size"] == 2  # configs/small.pbtxt
        assert config("identity_fp32")["max_batch_size"] == 64  # no configs/small.pbtxt: config.pbtxt
    finally:
        assert server.stop() == 0


@pytest.mark.frontends  # restrictions on infer are checked in the frontend
def test_restricted_apis_need_their_header(tmp_path: Path) -> None:
    """Triton 2.51's answers, probed with the same flags: 403 on HTTP, UNAVAILABLE on gRPC (whose
    clients send the key as triton-grpc-protocol-<key>); unrestricted categories stay open."""
    server = start_pier([EXAMPLE_REPO], "--model-control-mode=explicit", "--load-model=simple",
                        "--http-restricted-api=model-repository,statistics:admin-key=secret",
                        "--grpc-restricted-protocol=model-repository,inference:admin-key=secret",
                        log_path=tmp_path / "log")
    base = server.base()
    try:
        for method, path in (("GET", "/v2/models/stats"), ("POST", "/v2/repository/index"),
                             ("GET", "/v2/models/simple/stats"), ("POST", "/v2/repository/models/simple/load")):
            r = requests.request(method, base + path, timeout=30)
            assert r.status_code == 403, (path, r.text)
            assert r.json() == {"error": "This API is restricted, expecting header 'admin-key'"}
            assert requests.request(method, base + path, headers={"admin-key": "nope"}, timeout=30).status_code == 403
            assert requests.request(method, base + path, headers={"admin-key": "secret"}, timeout=30).status_code == 200
        assert requests.get(base + "/v2/models/simple", timeout=5).status_code == 200  # metadata: open
        assert requests.post(base + "/v2/repository/nonexistent", timeout=5).status_code == 404  # no route: 404
        assert requests.get(base + "/v2/models/simple/ready", timeout=5).status_code == 200
        g = grpcclient.InferenceServerClient(server.grpc_url)
        with pytest.raises(InferenceServerException) as refused:
            _infer(server.grpc_url)
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        assert "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'" in str(refused.value)
        with pytest.raises(InferenceServerException):
            g.get_model_repository_index()
        assert g.get_model_repository_index(headers={"triton-grpc-protocol-admin-key": "secret"}).models
        assert g.get_inference_statistics("simple").model_stats  # statistics are restricted on HTTP only
        client = grpcclient.InferenceServerClient(server.grpc_url)
        a = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
        b = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
        a.set_data_from_numpy(np.zeros((1, 16), np.int32))
        b.set_data_from_numpy(np.ones((1, 16), np.int32))
        r = client.infer("simple", [a, b], headers={"triton-grpc-protocol-admin-key": "secret"})
        assert r.as_numpy("OUTPUT0")[0, 0] == 1
        answers: queue.Queue = queue.Queue()  # a stream without the header is refused at once (as Triton)
        client.start_stream(callback=lambda result, error: answers.put(error))
        try:
            client.async_stream_infer("simple", [a, b])
        except InferenceServerException:  # the stream was already closed by the refusal
            pass
        error = answers.get(timeout=10)
        client.stop_stream()
        assert error is not None and "This protocol is restricted" in str(error)
    finally:
        assert server.stop() == 0


def test_restriction_flags_are_checked() -> None:
    """A bad rule stops `pier serve` with tritonserver 2.51's words (probed), for --http-restricted-api
    and --grpc-restricted-protocol; every wording: tests/server/test_guards_and_restrictions.py."""
    for flag, kind in (("--http-restricted-api", "api"), ("--grpc-restricted-protocol", "protocol")):
        proc = subprocess.run([sys.executable, "-m", "pier", "serve", f"--model-repository={EXAMPLE_REPO}",
                               f"{flag}=health:k=v", f"{flag}=health,metadata:k2=v2"], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert f"restricted {kind} 'health' can not be specified in multiple config groups" in proc.stderr


def _forwarded(server: object, headers: dict[str, str], parameters: dict[str, object]) -> dict[str, object]:
    """The parameters request_args_py saw, per client (HTTP, gRPC)."""
    seen = {}
    for mod, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):  # type: ignore[attr-defined]
        client = mod.InferenceServerClient(url)
        inp = mod.InferInput("MODEL", [1], "BYTES")
        inp.set_data_from_numpy(np.array([b"simple"], dtype=np.object_))
        sent = dict(headers) if mod is httpclient else {k.lower(): v for k, v in headers.items()}  # gRPC: lower
        result = client.infer("request_args_py", [inp], headers=sent, parameters=dict(parameters))
        seen[mod.__name__.split(".")[-1]] = json.loads(result.as_numpy("ARGS")[0])["parameters"]
    return seen


@pytest.mark.frontends  # headers become parameters in the frontend
def test_header_forward_patterns_make_headers_parameters(tmp_path: Path) -> None:
    """--http/grpc-header-forward-pattern (Triton's qa L0_parameters with TEST_HEADER): RE2
    expressions matched case-insensitively anywhere in a header's name, as tritonserver; headers
    whose names match reach the model as request parameters, values intact (quotes, backslash; a
    trailing space survives gRPC, while HTTP drops it as RFC 9110 says and aiohttp's parser does:
    docs/triton-extensions.md); others do not; a parameter the request sends itself wins; "(?-i)" makes the
    match case-sensitive again (gRPC metadata names are lower case, so MY_HEADER matches none)."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tests" / "python_models" / "request_args_py", repo / "request_args_py")
    shutil.copytree(EXAMPLE_REPO / "simple", repo / "simple")
    quoted = 'This is a "quoted" string with a backslash\\ '
    headers = {"header_1": "value_1", "my_header_1": "my_value_1", "my_header_2": "overridden",
               "my_header_3": quoted, "priority": "1", "sequence_end": "true"}
    pattern = "MY_HEADER.*|priority|sequence_end"  # names the server interprets are never forwarded
    server = start_pier([repo], f"--http-header-forward-pattern={pattern}",
                        f"--grpc-header-forward-pattern={pattern}", log_path=tmp_path / "log")
    try:
        want = {"p": 1, "my_header_1": "my_value_1", "my_header_2": "sent", "my_header_3": quoted}
        assert _forwarded(server, headers, {"p": 1, "my_header_2": "sent"}) == {
            "http": {**want, "my_header_3": quoted.rstrip()}, "grpc": want}
    finally:
        assert server.stop() == 0
    pattern = "(?-i)MY_HEADER.*"
    server = start_pier([repo], f"--http-header-forward-pattern={pattern}",
                        f"--grpc-header-forward-pattern={pattern}", log_path=tmp_path / "log2")
    try:
        seen = _forwarded(server, {**headers, "MY_HEADER_9": "upper"}, {})
        assert seen == {"http": {"MY_HEADER_9": "upper"}, "grpc": {}}, seen
    finally:
        assert server.stop() == 0
    bad = subprocess.run([sys.executable, "-m", "pier", "serve", f"--model-repository={repo}",
                          "--http-header-forward-pattern=("], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "not a valid RE2 regular expression" in bad.stderr, bad.stderr
