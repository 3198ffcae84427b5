"""`pier` command line: argv -> Settings -> app. Flags are named as tritonserver names them,
and accept tritonserver's `--flag=value` spelling (booleans: true/false/1/0)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from pier import __version__
from pier.settings import SERVER_NAME, GrpcSsl, Settings
from pier.tensors.validation import header_pattern


def _bool(value: str) -> bool:
    """A bool option's value as tritonserver 2.51 reads it (probed): true/on/1 or false/off/0 in
    any case; anything else (yes, "true" with its quotes) is refused with its message."""
    v = value.lower()
    if v in ("1", "true", "on"):
        return True
    if v in ("0", "false", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid value for bool option: {value} (expected true/false, on/off or 1/0)")


def _count(value: str) -> int:
    """A process count: 0 to 64."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= 64:
        raise argparse.ArgumentTypeError(f"invalid process count: '{value}' (an integer from 0 to 64)")
    return n


def _enum(flag: str, values: tuple[str, ...], case_sensitive: bool = False) -> Callable[[str], str]:
    """An enumerated option's value: tritonserver compares --model-control-mode in any case and
    --log-format exactly (probed); a bad value gets its message and the values allowed."""
    def parse(value: str) -> str:
        for v in values:
            if value == v or (not case_sensitive and value.lower() == v.lower()):
                return v
        raise argparse.ArgumentTypeError(f"invalid argument for {flag}: '{value}' (one of {', '.join(values)})")
    return parse


def _serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # As tritonserver's getopt: a unique prefix of a long option is that option (--log-warn), an
    # ambiguous one is refused naming the candidates.
    p = sub.add_parser("serve", help="serve a model, or model repositories, over HTTP and gRPC", allow_abbrev=True)
    flag = p.add_argument
    flag("path", nargs="?", default=None, metavar="PATH",
         help="one model to serve: a Hugging Face folder (config.json + safetensors: the LLM backend), a .gguf "
              "file (the LLM backend), an .onnx file, a model folder or a model repository (docs/models.md)")
    flag("--served-model-name", default="", metavar="NAME",
         help="the name PATH's model is served under (default: its folder's or file's name)")
    flag("--model-repository", "--model-store", action="append", default=[], metavar="PATH",
         help="model repository folder (repeatable)")
    flag("--http-port", type=int, default=8000)
    flag("--grpc-port", type=int, default=8001)
    flag("--metrics-port", type=int, default=8002)
    flag("--http-address", default="0.0.0.0")
    flag("--grpc-address", default="0.0.0.0")
    flag("--metrics-address", default="0.0.0.0")
    for name in ("allow-http", "allow-grpc", "allow-metrics", "exit-on-error", "strict-readiness"):
        flag(f"--{name}", type=_bool, nargs="?", const=True, default=True, metavar="BOOL")
    flag("--strict-model-config", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
         help="deprecated spelling of --disable-auto-complete-config")
    flag("--disable-auto-complete-config", action="store_true")
    flag("--model-control-mode", type=_enum("--model-control-mode", ("none", "explicit", "poll")), default="none",
         metavar="{none,explicit,poll}")
    flag("--load-model", action="append", default=[], metavar="NAME",
         help="model to load at startup in explicit mode ('*' = all)")
    flag("--exit-timeout-secs", type=float, default=30.0)
    flag("--log-verbose", type=int, default=0)
    for name in ("log-info", "log-warning", "log-error"):
        flag(f"--{name}", type=_bool, nargs="?", const=True, default=True, metavar="BOOL")
    flag("--log-format", type=_enum("--log-format", ("default", "ISO8601"), case_sensitive=True), default="default",
         metavar="{default,ISO8601}")
    flag("--log-file", default="", help="write the log to this file instead of stderr")
    flag("--trace-config", action="append", default=[], metavar="[MODE,]KEY=VALUE",
         help="request tracing (repeatable): rate=, count=, level=OFF|TIMESTAMPS|TENSORS, "
              "mode=triton|opentelemetry; triton,file= and triton,log-frequency=; opentelemetry,url= "
              "(default http://localhost:4318/v1/traces), opentelemetry,resource=KEY=VALUE, "
              "opentelemetry,bsp_max_queue_size= / bsp_schedule_delay= / bsp_max_export_batch_size=, "
              "opentelemetry,protocol=http/protobuf|grpc")
    flag("--http-max-input-size", type=int, default=1 << 26, help="largest HTTP request body, bytes")
    flag("--grpc-max-message-size", type=int, default=(1 << 31) - 1, help="largest gRPC message, bytes")
    flag("--model-load-thread-count", type=int, default=4)
    flag("--repository-poll-secs", type=float, default=15.0,
         help="poll mode: rescan period in seconds (file-system events apply changes sooner)")
    flag("--metrics-config", action="append", default=[], metavar="KEY=VALUE",
         help="counter_latencies, histogram_latencies, summary_latencies =true|false; "
              "summary_quantiles=0.5:0.05,0.9:0.01,... (repeatable)")
    flag("--allow-cpu-metrics", type=_bool, nargs="?", const=True, default=True, metavar="BOOL",
         help="export nv_cpu_utilization and nv_cpu_memory_* (default true)")
    # Accepted so tritonserver command lines run unchanged: Pier exports no GPU metrics, and it
    # samples CPU use at each scrape rather than on an interval.
    flag("--allow-gpu-metrics", type=_bool, nargs="?", const=True, default=True, metavar="BOOL",
         help="accepted for tritonserver compatibility (no GPU metrics are exported)")
    flag("--metrics-interval-ms", type=int, default=2000,
         help="accepted for tritonserver compatibility (CPU use is measured between scrapes)")
    flag("--id", default=SERVER_NAME, help="server name reported in server metadata (Triton's default: its client "
         "examples check it; --id pier names Pier)")
    flag("--api-key", action="append", default=[], metavar="KEY",
         help="require this API key (Authorization: Bearer KEY or api-key: KEY) on every request but health "
         "probes; repeatable (the keys on a command line show in `ps`: prefer --api-key-file)")
    flag("--api-key-file", action="append", default=[], metavar="PATH", help="API keys, one per line")
    flag("--rate-limit-model", action="append", default=[], metavar="[MODEL=]RATE[:BURST]",
         help="inference requests per second per model (without MODEL: every model's default); 429 when over")
    flag("--rate-limit-key", default="", metavar="RATE[:BURST]", help="inference requests per second per API key")
    flag("--model-namespacing", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
         help="each model repository is a namespace: the same model name may live in several, an ensemble "
         "calls the composing models of its own repository first, and a name in several answers as ambiguous")
    flag("--model-config-name", default="", metavar="NAME",
         help="use <model>/configs/NAME.pbtxt instead of config.pbtxt where a model has one")
    flag("--frontend-processes", type=_count, default=0, metavar="N",
         help="N processes accept the HTTP and gRPC connections (on the same ports) and decode and encode "
         "inference requests, in front of this one, where the models and their schedulers run; 0: this process "
         "serves them itself (docs/architecture.md: which is faster where)")
    for name in ("reuse-http-port", "reuse-grpc-port", "grpc-use-ssl", "grpc-use-ssl-mutual"):
        flag(f"--{name}", type=_bool, nargs="?", const=True, default=False, metavar="BOOL")
    flag("--grpc-server-cert", default="", metavar="PEM")
    flag("--grpc-server-key", default="", metavar="PEM")
    flag("--grpc-root-cert", default="", metavar="PEM")
    flag("--cache-config", action="append", default=[], metavar="local,size=BYTES",
         help="the response cache (models opt in with response_cache { enable: true })")
    flag("--response-cache-byte-size", type=int, default=None, help="deprecated spelling of --cache-config local,size=")
    flag("--http-restricted-api", action="append", default=[], metavar="CATEGORIES:KEY=VALUE",
         help="answer these API categories only to requests with header KEY: VALUE (repeatable)")
    flag("--grpc-restricted-protocol", action="append", default=[], metavar="CATEGORIES:KEY=VALUE",
         help="the same for gRPC (clients send the header as triton-grpc-protocol-KEY)")
    flag("--http-header-forward-pattern", default="", metavar="REGEX",
         help="HTTP headers whose names match become string parameters of each inference request")
    flag("--grpc-header-forward-pattern", default="", metavar="REGEX",
         help="the same for gRPC request metadata")
    for name in GRPC_OPTIONS:
        flag(f"--{name}", type=_bool if name.endswith("permit-without-calls") else int, default=None)
    for name in IGNORED_FLAGS:  # so tritonserver command lines run unchanged; logged at startup
        flag(f"--{name}", action="append", nargs="?", const="", default=[], help=argparse.SUPPRESS)
    return p


# tritonserver's gRPC keepalive / HTTP/2 flags -> grpc server options (milliseconds, counts, 0/1).
GRPC_OPTIONS = {
    "grpc-keepalive-time": "grpc.keepalive_time_ms",
    "grpc-keepalive-timeout": "grpc.keepalive_timeout_ms",
    "grpc-keepalive-permit-without-calls": "grpc.keepalive_permit_without_calls",
    "grpc-http2-max-pings-without-data": "grpc.http2.max_pings_without_data",
    "grpc-http2-min-recv-ping-interval-without-data": "grpc.http2.min_ping_interval_without_data_ms",
    "grpc-http2-max-ping-strikes": "grpc.http2.max_ping_strikes",
    "grpc-max-connection-age": "grpc.max_connection_age_ms",
    "grpc-max-connection-age-grace": "grpc.max_connection_age_grace_ms",
}

# tritonserver flags that have nothing to act on in Pier (backends are built in; no pinned or CUDA
# memory pools or rate limiter): accepted and named in a warning. --backend-config is named only when
# one of its settings has no effect (the python backend's own settings act: _backend_config).
IGNORED_FLAGS = (
    "backend-directory", "backend-config", "repoagent-directory", "pinned-memory-pool-byte-size",
    "cuda-memory-pool-byte-size", "cuda-virtual-address-size", "min-supported-compute-capability",
    "buffer-manager-thread-count", "host-policy", "rate-limit", "rate-limit-resource",
    "cache-directory", "http-thread-count", "grpc-infer-allocation-pool-size",
    "grpc-max-response-pool-size", "grpc-infer-response-compression-level", "model-load-retry-count",
    "allow-sagemaker", "allow-vertex-ai",
)


def _api_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> frozenset[str]:
    from pier.frontends import guards

    try:
        keys = guards.parse_keys(args.api_key, args.api_key_file)
        guards.parse_model_rates(args.rate_limit_model)
        if args.rate_limit_key:
            guards.parse_rate(args.rate_limit_key, "--rate-limit-key")
            if not keys:
                parser.error("--rate-limit-key needs API keys (--api-key or --api-key-file)")
    except ValueError as exc:
        parser.error(str(exc))
    if (args.api_key or args.api_key_file) and not keys:
        parser.error("--api-key / --api-key-file: no key given (empty)")
    return keys


def _grpc_ssl(args: argparse.Namespace, parser: argparse.ArgumentParser) -> GrpcSsl | None:
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        return None
    needed = ["grpc_server_cert", "grpc_server_key"] + (["grpc_root_cert"] if args.grpc_use_ssl_mutual else [])
    for attr in needed:
        value = getattr(args, attr)
        flag = "--" + attr.replace("_", "-")
        if not value:
            parser.error(f"{flag} is required with --grpc-use-ssl{'-mutual' if args.grpc_use_ssl_mutual else ''}")
        if not Path(value).is_file():
            parser.error(f"{flag} {value}: no such file")
    root = Path(args.grpc_root_cert) if args.grpc_root_cert else None
    return GrpcSsl(Path(args.grpc_server_cert), Path(args.grpc_server_key), root, args.grpc_use_ssl_mutual)


def _backend_config(values: list[str], parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """tritonserver's `--backend-config=[BACKEND,]KEY=VALUE` (repeatable). Settings of a backend that
    takes settings (python: execution-mode, ...) are handed to it now, and an unknown key or a bad
    value is an error naming it; the rest (other backends', and global ones without a backend)
    have no effect here and are returned for the startup warning."""
    from pier.repository import backend_registry

    by_backend: dict[str, dict[str, str]] = {}
    for raw in values:
        head, comma, rest = raw.partition(",")
        backend, setting = (head, rest) if comma and "=" not in head else ("", raw)
        key, eq, value = setting.partition("=")
        if not eq or not key:
            parser.error(f"--backend-config {raw}: expected [BACKEND,]KEY=VALUE")
        by_backend.setdefault(backend, {})[key] = value
    ignored: list[str] = []
    for backend, settings in by_backend.items():
        try:
            no_effect = backend_registry.configure(backend, settings) if backend else None
        except ValueError as exc:
            parser.error(str(exc))
        keys = settings if no_effect is None else no_effect
        ignored += [f"{backend + ',' if backend else ''}{k}={settings[k]}" for k in keys]
    return tuple(ignored)


# Commands a backend contributes, named by module as backend_registry names backends (the server
# imports no backend): each module has add_parser(sub) and run(args) -> exit code. Its top-level
# imports stay light (every `pier` invocation builds its parser).
BACKEND_COMMANDS = {"tp-worker": "pier.backends.llm.parallel.tp_worker"}  # a tensor-parallel rank elsewhere


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pier", description="Pier model server", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"pier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    from pier import model_cli

    model_cli.add_parser(sub)
    for module in BACKEND_COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def _served_path(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Path | None, tuple[Path, ...]]:
    """PATH (`pier serve PATH`) as the model it names, or as one more repository when it is one."""
    if args.path is None:
        if args.served_model_name:
            parser.error("--served-model-name names the model of PATH: give PATH (pier serve PATH)")
        if not args.model_repository:
            parser.error("nothing to serve: give PATH (a model) or --model-repository")
        return None, ()
    from pier.repository import single_model

    try:
        served = single_model.classify(Path(args.path), args.served_model_name)
    except ValueError as exc:
        parser.error(str(exc))
    if served.kind == single_model.REPOSITORY:
        return None, (served.path,)
    return served.path, ()


def settings_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Settings:
    serve_path, more_repos = _served_path(args, parser)
    repos = tuple(Path(r) for r in args.model_repository) + more_repos
    for r in repos:
        if not r.is_dir():
            parser.error(f"--model-repository {r}: no such folder")
    if args.load_model and args.model_control_mode != "explicit":
        parser.error("--load-model requires --model-control-mode=explicit")
    if "*" in args.load_model and len(args.load_model) > 1:
        parser.error("--load-model=* must be the only --load-model")
    from pier.frontends.metrics import MetricsConfig

    try:
        MetricsConfig.parse(args.metrics_config)
    except ValueError as exc:
        parser.error(str(exc))
    from pier.observability.tracing import parse_trace_config

    try:
        parse_trace_config(args.trace_config)
    except ValueError as exc:
        parser.error(str(exc))
    from pier.frontends import restrictions

    for flag_name, specs in (("--http-restricted-api", args.http_restricted_api),
                             ("--grpc-restricted-protocol", args.grpc_restricted_protocol)):
        try:
            restrictions.parse(specs, flag_name)
        except ValueError as exc:
            parser.error(str(exc))
    for flag_name, pattern in (("--http-header-forward-pattern", args.http_header_forward_pattern),
                               ("--grpc-header-forward-pattern", args.grpc_header_forward_pattern)):
        try:
            header_pattern(pattern)
        except ValueError as exc:
            parser.error(f"{flag_name}: {exc}")
    from pier.dataplane.response_cache import parse_cache_config

    try:
        cache_bytes = parse_cache_config(args.cache_config)
    except ValueError as exc:
        parser.error(str(exc))
    if args.response_cache_byte_size is not None and not args.cache_config:
        cache_bytes = args.response_cache_byte_size
    if args.repository_poll_secs <= 0:
        parser.error("--repository-poll-secs must be positive")
    backend_config_ignored = _backend_config([v for v in args.backend_config if v], parser)
    ignored_flags = [f"--{name}" for name in IGNORED_FLAGS if getattr(args, name.replace("-", "_"))
                     and (name != "backend-config" or backend_config_ignored)]
    return Settings(
        model_repositories=repos,
        serve_path=serve_path,
        served_model_name=args.served_model_name,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        http_address=args.http_address,
        grpc_address=args.grpc_address,
        metrics_address=args.metrics_address,
        allow_http=args.allow_http,
        allow_grpc=args.allow_grpc,
        allow_metrics=args.allow_metrics,
        model_control_mode=args.model_control_mode,
        load_models=tuple(args.load_model),
        auto_complete_config=not (args.disable_auto_complete_config or args.strict_model_config),
        exit_on_error=args.exit_on_error,
        strict_readiness=args.strict_readiness,
        exit_timeout_secs=args.exit_timeout_secs,
        log_verbose=args.log_verbose,
        log_info=args.log_info,
        log_warning=args.log_warning,
        log_error=args.log_error,
        log_format=args.log_format,
        log_file=args.log_file,
        http_max_input_size=args.http_max_input_size,
        grpc_max_message_size=args.grpc_max_message_size,
        model_load_thread_count=args.model_load_thread_count,
        repository_poll_secs=args.repository_poll_secs,
        metrics_config=tuple(args.metrics_config),
        trace_config=tuple(args.trace_config),
        allow_cpu_metrics=args.allow_cpu_metrics,
        server_id=args.id,
        model_config_name=args.model_config_name,
        model_namespacing=args.model_namespacing,
        api_keys=_api_keys(args, parser),
        rate_limit_model=tuple(args.rate_limit_model),
        rate_limit_key=args.rate_limit_key,
        http_restricted_api=tuple(args.http_restricted_api),
        response_cache_bytes=cache_bytes,
        grpc_restricted_protocol=tuple(args.grpc_restricted_protocol),
        http_header_forward_pattern=args.http_header_forward_pattern,
        grpc_header_forward_pattern=args.grpc_header_forward_pattern,
        reuse_http_port=args.reuse_http_port,
        reuse_grpc_port=args.reuse_grpc_port,
        frontend_processes=args.frontend_processes,
        grpc_ssl=_grpc_ssl(args, parser),
        grpc_options=tuple((option, int(value)) for name, option in GRPC_OPTIONS.items()
                           if (value := getattr(args, name.replace("-", "_"))) is not None),
        ignored_flags=tuple(ignored_flags),
        backend_config_ignored=backend_config_ignored,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from pier.app import run

        return run(settings_from_args(args, parser))
    if args.command == "model":
        from pier import model_cli

        return model_cli.run(args)
    if args.command in BACKEND_COMMANDS:
        return int(importlib.import_module(BACKEND_COMMANDS[args.command]).run(args))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
