"""Typed server settings, built once by the CLI and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SERVER_NAME = "triton"  # --id's default, Triton's: its own client examples check the name


@dataclass(frozen=True)
class Settings:
    model_repositories: tuple[Path, ...]
    serve_path: Path | None = None  # `pier serve PATH`: one model (server/repository/single_model.py)
    served_model_name: str = ""  # --served-model-name: PATH's model's name (default: its folder's or file's)
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    http_address: str = "0.0.0.0"
    grpc_address: str = "0.0.0.0"
    metrics_address: str = "0.0.0.0"
    allow_http: bool = True
    allow_grpc: bool = True
    allow_metrics: bool = True
    model_control_mode: str = "none"  # none | explicit | poll
    load_models: tuple[str, ...] = field(default_factory=tuple)
    auto_complete_config: bool = True
    exit_on_error: bool = True
    strict_readiness: bool = True
    exit_timeout_secs: float = 30.0
    log_verbose: int = 0
    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_format: str = "default"  # default | ISO8601
    log_file: str = ""  # empty: stderr
    http_max_input_size: int = 1 << 26
    grpc_max_message_size: int = (1 << 31) - 1
    model_load_thread_count: int = 4
    repository_poll_secs: float = 15.0
    metrics_config: tuple[str, ...] = ()  # "key=value" items, as tritonserver's --metrics-config
    trace_config: tuple[str, ...] = ()  # "[triton,]key=value" items, as tritonserver's --trace-config
    allow_cpu_metrics: bool = True
    server_id: str = SERVER_NAME  # --id: the name server metadata reports
    model_config_name: str = ""  # --model-config-name: use configs/<name>.pbtxt where a model has it
    model_namespacing: bool = False  # --model-namespacing: each repository is a namespace
    api_keys: frozenset[str] = frozenset()  # --api-key / --api-key-file: the data plane needs one of these
    rate_limit_model: tuple[str, ...] = ()  # --rate-limit-model: [MODEL=]RATE[:BURST]
    rate_limit_key: str = ""  # --rate-limit-key: RATE[:BURST] per API key
    reuse_http_port: bool = False
    reuse_grpc_port: bool = False
    frontend_processes: int = 0  # --frontend-processes: 0 = HTTP/gRPC served in the server process
    grpc_ssl: GrpcSsl | None = None
    grpc_options: tuple[tuple[str, int], ...] = ()  # keepalive and HTTP/2 settings, as grpc channel args
    response_cache_bytes: int = 0  # --cache-config local,size=: 0 = no response cache
    http_restricted_api: tuple[str, ...] = ()  # "CATEGORIES:KEY=VALUE" items (server/frontends/restrictions.py)
    grpc_restricted_protocol: tuple[str, ...] = ()
    http_header_forward_pattern: str = ""  # headers whose names match become request parameters
    grpc_header_forward_pattern: str = ""  # the same for gRPC metadata
    ignored_flags: tuple[str, ...] = ()  # tritonserver flags accepted with no effect (logged at startup)
    # --backend-config settings given to backends at parse time; these had no effect (logged at startup)
    backend_config_ignored: tuple[str, ...] = ()


@dataclass(frozen=True)
class GrpcSsl:
    """--grpc-use-ssl[-mutual]: PEM files for the server's key and certificate, and (mutual TLS)
    the root certificate client certificates must chain to."""

    server_cert: Path
    server_key: Path
    root_cert: Path | None = None
    mutual: bool = False
