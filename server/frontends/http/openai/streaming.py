"""`stream: true`: the answer as server-sent events, a chunk per step that made tokens (as vLLM's),
ending with `data: [DONE]`; usage as stream_options asks for it."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from pier.contract.errors import PierError
from pier.frontends.http.openai.choices import Deltas
from pier.frontends.http.openai.endpoint import Call, choice
from pier.frontends.http.openai.llm_io import Delta
from pier.frontends.http.openai.protocol import stream_error


class _Chunks:
    """A call's chunks and their usage: with include_usage every chunk has `usage`: null, then the
    totals in a last chunk of its own; with continuous_usage_stats too, every chunk carries the
    running totals (vLLM)."""

    def __init__(self, call: Call, reply: web.StreamResponse, include_usage: bool, continuous_usage: bool) -> None:
        self.call, self.reply = call, reply
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.completion: dict[int, int] = {}  # completion tokens of each choice so far

    def usage(self) -> dict[str, int]:
        prompt, total = self.call.prompt_tokens, sum(self.completion.values())
        return {"prompt_tokens": prompt, "completion_tokens": total, "total_tokens": prompt + total}

    def chunk(self, choices: list[dict[str, Any]], final: bool = False) -> dict[str, Any]:
        c = self.call
        doc: dict[str, Any] = {"id": c.ident, "object": c.endpoint.chunk_object, "created": c.created,
                               "model": c.model, "choices": choices}
        if self.include_usage:
            doc["usage"] = self.usage() if final or self.continuous_usage else None
        return doc

    async def send(self, doc: dict[str, Any]) -> None:
        await self.reply.write(b"data: " + orjson.dumps(doc) + b"\n\n")


async def stream(request: web.Request, call: Call, deltas: Deltas, first: Delta, include_usage: bool,
                 continuous_usage: bool) -> web.StreamResponse:
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                        "Cache-Control": "no-cache", **call.headers})
    await reply.prepare(request)
    out = _Chunks(call, reply, include_usage, continuous_usage)
    endpoint = call.endpoint
    started: set[int] = set()
    sent: dict[int, int] = {}  # completion tokens of each choice that chunks went out for
    offset: dict[int, int] = {}  # completions logprobs: characters of each choice's text so far
    item: Delta | None = first
    try:
        while item is not None:
            i = item["index"]
            out.completion[i] = item["completion_tokens"]
            if i not in started:
                started.add(i)
                opening = endpoint.opening(call, item)
                if opening is not None:
                    opening_choice, offset[i] = opening
                    await out.send(out.chunk([opening_choice]))
            logprobs = endpoint.logprobs([item["logprobs"]] if item["logprobs"] else [], offset.get(i, 0))
            if logprobs:  # completions' text_offset runs on across chunks
                offset[i] = offset.get(i, 0) + endpoint.text_length(logprobs)
            if item["text"] or item["finish_reason"] or logprobs or item["completion_tokens"] > sent.get(i, 0):
                # a chunk per step that made tokens, as vLLM's
                delta, finish = endpoint.stream_delta(call, item)
                await out.send(out.chunk([choice(i, delta, logprobs, finish, item["stop_reason"])]))
                sent[i] = item["completion_tokens"]
            item = await anext(deltas, None)
        if include_usage:
            await out.send(out.chunk([], final=True))
    except PierError as exc:
        await out.send(stream_error(exc))
    finally:
        await deltas.aclose()  # when the client went away too: that cancels the request
    await reply.write(b"data: [DONE]\n\n")
    await reply.write_eof()
    return reply
