"""A call's choices: the deltas of its prompts' requests merged into one stream (choice p * n + i
is prompt p's sequence i, vLLM's numbering), and, when not streamed, gathered into whole choices."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from aiohttp import web

from pier.contract import llm
from pier.contract.errors import PierError
from pier.frontends.http.openai.endpoint import Call, choice
from pier.frontends.http.openai.llm_io import Delta
from pier.frontends.http.openai.protocol import pier_error

Deltas = AsyncGenerator[Delta, None]


async def close(gens: list[Deltas]) -> None:
    for g in gens:
        await g.aclose()  # cancels that prompt's request


async def merge(streams: list[tuple[Delta, Deltas]], n: int) -> Deltas:
    """One stream of deltas for a batch of prompts (each with its first delta, already read), as
    they come: prompt p's sequence i becomes choice p * n + i. Closing it cancels every prompt's
    request."""
    if len(streams) == 1:
        first, gen = streams[0]
        try:
            yield first
            async for item in gen:
                yield item
        finally:
            await gen.aclose()
        return
    queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

    async def pump(p: int, first: Delta, gen: Deltas) -> None:
        try:
            item: Delta | None = first
            while item is not None:
                queue.put_nowait({**item, "index": item["index"] + p * n})
                item = await anext(gen, None)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(p, first, gen)) for p, (first, gen) in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            got = await queue.get()
            if got is None:
                left -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close([gen for _, gen in streams])


async def whole(call: Call, deltas: Deltas, first: Delta) -> web.Response:
    """The answer in one body: each choice's text (after its echo), logprobs, finish and usage."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    stops: dict[int, str | int | None] = {}
    completion: dict[int, int] = {}
    lps: dict[int, list[dict[str, Any]]] = {}
    item: Delta | None = first
    try:
        while item is not None:
            i = item["index"]
            texts.setdefault(i, []).append(item["text"])
            if item["prompt_logprobs"]:  # echo: the prompt's text and (with logprobs) entries come first
                call.fill_echo(i, item["prompt_logprobs"])
                if llm.LOGPROBS_ENTRIES in item["prompt_logprobs"]:
                    lps.setdefault(i, []).insert(0, item["prompt_logprobs"])
            if item["logprobs"]:
                lps.setdefault(i, []).append(item["logprobs"])
            if item["finish_reason"]:
                finish[i] = item["finish_reason"]
                stops[i] = item["stop_reason"]
            completion[i] = item["completion_tokens"]
            item = await anext(deltas, None)
    except PierError as exc:
        return pier_error(exc)
    finally:
        await deltas.aclose()
    choices = []
    for i in range(call.choices):
        text = ((call.echo[i] or "") if call.echo else "") + "".join(texts.get(i, []))
        content, reason = call.endpoint.whole_choice(call, i, text, finish.get(i, llm.FINISH_STOP))
        choices.append(choice(i, content, call.endpoint.logprobs(lps.get(i, [])), reason, stops.get(i)))
    total = sum(completion.values())
    doc = {"id": call.ident, "object": call.endpoint.object, "created": call.created, "model": call.model,
           "choices": choices, "usage": {"prompt_tokens": call.prompt_tokens, "completion_tokens": total,
                                         "total_tokens": call.prompt_tokens + total}}
    return web.Response(body=orjson.dumps(doc), content_type="application/json", headers=call.headers)
