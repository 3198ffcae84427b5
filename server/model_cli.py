"""`pier model list|load|unload|rollout|rollback`: an operator's client for a running server's
repository API (HTTP). Prints readable tables, or the server's JSON with --json."""

from __future__ import annotations

import argparse
import base64
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="list, load, unload, roll out and roll back models on a running server")
    url_help, json_help = "server HTTP address (host:port or http://host:port)", "print the server's JSON answer"
    p.add_argument("--url", default="localhost:8000", help=url_help)
    p.add_argument("--json", action="store_true", help=json_help)
    # The same two options after the operation too (`pier model list --json`); SUPPRESS keeps an
    # operation that does not repeat them from resetting what came before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=url_help)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=json_help)
    ops = p.add_subparsers(dest="op", required=True)

    def op(name: str, help: str) -> argparse.ArgumentParser:
        return ops.add_parser(name, help=help, parents=[common])

    ls = op("list", "every model version with its state and traffic")
    ls.add_argument("--ready", action="store_true", help="only READY versions")
    load = op("load", "load or reload a model (or one version with --version)")
    load.add_argument("name")
    load.add_argument("--version", type=int, help="load this version beside the versions serving now")
    load.add_argument("--config", help="ModelConfig JSON (text, or @file) replacing config.pbtxt")
    load.add_argument("--file", action="append", default=[], metavar="VERSION/NAME=PATH",
                      help="send a model file with the request (needs --config), e.g. 1/model.onnx=./m.onnx")
    unload = op("unload", "unload a model (or one version with --version)")
    unload.add_argument("name")
    unload.add_argument("--version", type=int)
    unload.add_argument("--unload-dependents", action="store_true", help="also unload an ensemble's models")
    rollout = op("rollout", "send unversioned traffic to a version, or split it")
    rollout.add_argument("name")
    group = rollout.add_mutually_exclusive_group(required=True)
    group.add_argument("--version", type=int, help="all traffic to this version")
    group.add_argument("--weights", help="split, e.g. 2=90,3=10")
    group.add_argument("--newest", action="store_true", help="back to the default: newest READY version")
    rollback = op("rollback", "all traffic back to the previous version (or --version)")
    rollback.add_argument("name")
    rollback.add_argument("--version", type=int)


class ServerError(Exception):
    pass


def _call(base: str, path: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(base + path, data=data if method == "POST" else None, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            message = json.loads(raw)["error"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace") or exc.reason
        raise ServerError(f"{exc.code}: {message}") from None
    except urllib.error.URLError as exc:
        raise ServerError(f"cannot reach the server at {base}: {exc.reason}") from None
    return json.loads(raw) if raw.strip() else None


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
              for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), *(fmt.format(*r) for r in rows)]).rstrip()


def _weights(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split(","):
        v, sep, w = part.strip().partition("=")
        if not sep:
            v, sep, w = part.strip().partition(":")
        try:
            out[str(int(v))] = float(w)
        except ValueError:
            raise ServerError(f"invalid weight '{part}': expected VERSION=WEIGHT, e.g. 2=90,3=10") from None
    return out


def _traffic_line(doc: dict[str, Any]) -> str:
    split = ", ".join(f"v{v} {p:g}%" for v, p in doc["traffic"].items())
    return f"{doc['name']}: {split or 'no READY version'}"


def run(args: argparse.Namespace) -> int:
    base = args.url if args.url.startswith(("http://", "https://")) else f"http://{args.url}"
    base = base.rstrip("/")
    model = f"/v2/repository/models/{getattr(args, 'name', '')}"
    try:
        if args.op == "list":
            rows = _call(base, "/v2/repository/index", {"ready": args.ready})
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                print(_table([[r["name"], r.get("version", "-"), r.get("state", "-"), r.get("reason", "")]
                              for r in rows], ["MODEL", "VERSION", "STATE", "REASON"]))
            return 0
        if args.op == "load":
            if args.version is not None:
                if args.config or args.file:
                    raise ServerError("--version loads a version from the repository: no --config/--file")
                _call(base, f"{model}/versions/{args.version}/load")
            else:
                params: dict[str, Any] = {}
                if args.config:
                    text = args.config
                    params["config"] = Path(text[1:]).read_text() if text.startswith("@") else text
                for item in args.file:
                    rel, sep, path = item.partition("=")
                    if not sep:
                        raise ServerError(f"--file {item}: expected VERSION/NAME=PATH")
                    params[f"file:{rel}"] = base64.b64encode(Path(path).read_bytes()).decode()
                _call(base, f"{model}/load", {"parameters": params} if params else None)
            what = f"'{args.name}'" + (f" version {args.version}" if args.version is not None else "")
            print(json.dumps({"loaded": args.name}) if args.json else f"loaded {what}")
            return 0
        if args.op == "unload":
            if args.version is not None:
                _call(base, f"{model}/versions/{args.version}/unload")
            else:
                _call(base, f"{model}/unload",
                      {"parameters": {"unload_dependents": True}} if args.unload_dependents else None)
            what = f"'{args.name}'" + (f" version {args.version}" if args.version is not None else "")
            print(json.dumps({"unloading": args.name}) if args.json else f"unloading {what}")
            return 0
        if args.op == "rollout":
            if args.version is not None:
                body: dict[str, Any] = {"version": str(args.version)}
            else:
                body = {"weights": {} if args.newest else _weights(args.weights)}
            doc = _call(base, f"{model}/rollout", body)
        else:  # rollback
            doc = _call(base, f"{model}/rollback", {"version": str(args.version)} if args.version else None)
        print(json.dumps(doc, indent=2) if args.json else _traffic_line(doc))
        return 0
    except (ServerError, OSError) as exc:
        print(f"pier model {args.op}: {exc}", file=sys.stderr)
        return 1
