#!/usr/bin/env python
"""Regenerate Pier's protobuf / gRPC Python modules from ``protos/``.

Usage (from anywhere; paths are resolved relative to the repository)::

    python scripts/gen_protos.py [--out DIR]

``DIR`` defaults to ``server/protocol``. Written files::

    model_config_pb2.py  model_config_pb2.pyi
    grpc_service_pb2.py  grpc_service_pb2.pyi  grpc_service_pb2_grpc.py
    health_pb2.py        health_pb2.pyi        health_pb2_grpc.py

Must be run with ``grpcio-tools==1.81.1`` (bundles libprotoc 33.5, emitting
protobuf 6.33.5 gencode). The generated ``*_pb2.py`` call
``ValidateProtobufRuntimeVersion(6, 33, 5)`` and ``*_pb2_grpc.py`` require
``grpcio>=1.81.1`` at import time, so a different grpcio-tools changes the
output and possibly the minimum runtime; ``tests/server/test_protocol.py``
checks the committed files are byte-identical to a fresh run with the
pinned version.

Post-processing applied to protoc's output:

* sibling imports (``import model_config_pb2 as ...``) become package
  imports (``from pier.protocol import model_config_pb2 as ...``);
* descriptors are added to the private pool ``server.protocol._pool.POOL``
  instead of ``descriptor_pool.Default()``, so these modules can share a
  process with ``tritonclient.grpc``, which defines the same
  ``inference.*`` names in the default pool;
* message classes are built by ``_pool.build_top_descriptors_and_messages``
  (registers them in the private symbol database, not the default one) with
  ``__module__ = "pier.protocol.<name>"``;
* the empty ``model_config_pb2_grpc.py`` (no services) is not written.

The output is deterministic: running the script twice yields identical files.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos"
DEFAULT_OUT = REPO_ROOT / "server" / "protocol"
PACKAGE = "pier.protocol"
PINNED_GRPCIO_TOOLS = "1.81.1"

PROTOS = ("model_config.proto", "grpc_service.proto", "health.proto")

# Files kept from protoc's output, in a fixed order.
OUTPUTS = (
    "model_config_pb2.py",
    "model_config_pb2.pyi",
    "grpc_service_pb2.py",
    "grpc_service_pb2.pyi",
    "grpc_service_pb2_grpc.py",
    "health_pb2.py",
    "health_pb2.pyi",
    "health_pb2_grpc.py",
)

POSTPROCESS_NOTE = f"# Post-processed by scripts/gen_protos.py: private descriptor pool, {PACKAGE} imports.\n"

_SIBLING_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)
_DEFAULT_POOL_ADD = "_descriptor_pool.Default().AddSerializedFile("
_BUILD_TOP = re.compile(r"_builder\.BuildTopDescriptorsAndMessages\(DESCRIPTOR, '(\w+)', _globals\)")
_POOL_IMPORT_ANCHOR = "from google.protobuf.internal import builder as _builder\n"


def _sub_exactly(pattern: re.Pattern[str], repl: str, text: str, count: int, what: str) -> str:
    new, n = pattern.subn(repl, text)
    if n != count:
        raise RuntimeError(f"{what}: expected {count} match(es), found {n}; protoc output format changed?")
    return new


def _replace_once(text: str, old: str, new: str, what: str) -> str:
    n = text.count(old)
    if n != 1:
        raise RuntimeError(
            f"{what}: expected 1 occurrence of {old!r}, found {n}; protoc output format changed?"
        )
    return text.replace(old, new)


def _fix_sibling_imports(text: str) -> str:
    return _SIBLING_IMPORT.sub(rf"from {PACKAGE} import \1 as \2", text)


def postprocess(name: str, text: str) -> str:
    """Rewrite one protoc-generated file (``name`` is its base name)."""
    text = _fix_sibling_imports(text)
    if name.endswith("_pb2.py"):
        text = _replace_once(
            text,
            _POOL_IMPORT_ANCHOR,
            _POOL_IMPORT_ANCHOR + f"from {PACKAGE} import _pool as _pier_pool\n",
            f"{name} (pool import)",
        )
        text = _replace_once(text, _DEFAULT_POOL_ADD, "_pier_pool.POOL.AddSerializedFile(", f"{name} (pool)")
        text = _sub_exactly(
            _BUILD_TOP,
            rf"_pier_pool.build_top_descriptors_and_messages(DESCRIPTOR, '{PACKAGE}.\1', _globals)",
            text,
            1,
            f"{name} (module name)",
        )
    # Mark the file, keeping protoc's own header lines first.
    lines = text.splitlines(keepends=True)
    insert_at = 0
    while insert_at < len(lines) and lines[insert_at].startswith("#"):
        insert_at += 1
    lines.insert(insert_at, POSTPROCESS_NOTE)
    return "".join(lines)


def run_protoc(dest: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_DIR.relative_to(REPO_ROOT)}",
        f"--python_out={dest}",
        f"--pyi_out={dest}",
        f"--grpc_python_out={dest}",
        *(str((PROTO_DIR / p).relative_to(REPO_ROOT)) for p in PROTOS),
    ]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)


def generate(out_dir: Path) -> list[Path]:
    """Generate all modules into ``out_dir``; returns the written paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory(prefix="pier-protoc-") as tmp:
        tmp_path = Path(tmp)
        run_protoc(tmp_path)
        for name in OUTPUTS:
            src = tmp_path / name
            if not src.is_file():
                raise RuntimeError(f"protoc did not produce {name}")
            text = postprocess(name, src.read_text(encoding="utf-8"))
            dst = out_dir / name
            with dst.open("w", encoding="utf-8", newline="\n") as f:
                f.write(text)
            written.append(dst)
    return written


def _check_tools_version() -> None:
    try:
        from importlib.metadata import version

        found = version("grpcio-tools")
    except Exception:  # pragma: no cover - best effort warning only
        return
    if found != PINNED_GRPCIO_TOOLS:
        print(
            f"warning: grpcio-tools {found} found, but the committed modules are generated with "
            f"grpcio-tools=={PINNED_GRPCIO_TOOLS}; output will differ",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output directory (default: {DEFAULT_OUT.relative_to(REPO_ROOT)})",
    )
    args = parser.parse_args(argv)
    _check_tools_version()
    for path in generate(args.out.resolve()):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
