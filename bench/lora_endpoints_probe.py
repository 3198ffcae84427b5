"""Ask an OpenAI-compatible server's LoRA endpoints what issue 34 compares (load, a duplicate name,
load_inplace, bad paths, a missing field, an over-rank adapter, /v1/models, unload, an unknown name)
and print [call, status, content type, body] as JSON (bench/results/lora_endpoints_vllm.md).

Usage: python -m bench.lora_endpoints_probe URL FOLDER, where FOLDER holds PEFT adapters a1 (served
at start), a2, big (rank above the server's max_lora_rank) and an empty folder `empty`."""

from __future__ import annotations

import json
import sys
from typing import Any

import requests


def probe(url: str, folder: str) -> list[list[Any]]:
    out: list[list[Any]] = []

    def call(label: str, method: str, path: str, body: dict[str, Any] | None = None) -> None:
        r = requests.request(method, url + path, json=body, timeout=120)
        try:
            got: Any = r.json()
        except ValueError:
            got = r.text
        out.append([label, r.status_code, r.headers.get("content-type", ""), got])

    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    call("load", "POST", load, {"lora_name": "a2", "lora_path": f"{folder}/a2"})
    call("load duplicate name", "POST", load, {"lora_name": "a2", "lora_path": f"{folder}/a2"})
    call("load_inplace", "POST", load, {"lora_name": "a2", "lora_path": f"{folder}/a1", "load_inplace": True})
    call("load bad path (empty folder)", "POST", load, {"lora_name": "a3", "lora_path": f"{folder}/empty"})
    call("load bad path (missing)", "POST", load, {"lora_name": "a3", "lora_path": f"{folder}/nothere"})
    call("load without lora_path", "POST", load, {"lora_name": "a3"})
    call("over-rank adapter", "POST", load, {"lora_name": "big", "lora_path": f"{folder}/big"})
    call("models with adapters", "GET", "/v1/models")
    call("unload", "POST", unload, {"lora_name": "a2"})
    call("unload unknown name", "POST", unload, {"lora_name": "a2"})
    call("unload without lora_name", "POST", unload, {})
    return out


if __name__ == "__main__":
    print(json.dumps(probe(sys.argv[1], sys.argv[2]), indent=1))
