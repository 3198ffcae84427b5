"""Tokenizer (HF `tokenizers`), chat template (Jinja2), incremental detokenization + stop strings."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode/decode and chat templates, from tokenizer.json + tokenizer_config.json, or from a GGUF
    file's metadata (models/gguf.py) where the folder holds one and no tokenizer.json."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        from .models import gguf

        path = folder / "tokenizer.json"
        gguf_file = None if path.is_file() else gguf.find(folder)
        cfg: dict[str, Any]
        if gguf_file is not None:
            self._tok, cfg = gguf.tokenizer(gguf_file)
        elif not path.is_file():
            raise ValueError(f"no tokenizer.json in {folder}")
        else:
            self._tok = HFTokenizer.from_file(str(path))
            cfg_path = folder / "tokenizer_config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template
        self._compiled: Any = None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.json = self._tok.to_str()  # the whole tokenizer, for llguidance (structured output)
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        # tokenizer_config's bos/eos/unk/pad are special too (as transformers counts them), even when
        # tokenizer.json lists them as plain vocabulary: skip_special_tokens leaves them out.
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_text(cfg.get(key))
            tid = self._tok.token_to_id(text) if text else None
            if tid is not None:
                self.special_ids.add(tid)
        self._plain_specials = {i for i in self.special_ids
                                if not (t := self._tok.get_added_tokens_decoder().get(i)) or not t.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self._plain_specials:
            ids = [i for i in ids if i not in self._plain_specials]
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the model's chat template (HF's Jinja environment: sandboxed, trim/lstrip blocks).

        Raises ValueError when the model has no chat template or the template rejects the messages.
        """
        if not self.chat_template:
            raise ValueError("the model has no chat template")
        if self._compiled is None:
            from jinja2.exceptions import TemplateError
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                       sort_keys: bool = False) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled = env.from_string(self.chat_template)
        from jinja2.exceptions import TemplateError

        try:
            return str(self._compiled.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
            ))
        except TemplateError as e:
            raise ValueError(f"chat template error: {e}") from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Never emits half a UTF-8 character (a decode ending in U+FFFD waits for more tokens), and
    keeps leading-space handling right by decoding a few tokens of context (the TGI/vLLM
    prefix/read offsets). Stop strings: the text is cut before the first stop string (or after
    it with `include_stop`), and text that could still become a stop string is held back.
    """

    _CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop: bool = False) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-self._CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text decoded so far (cut at a stop string)
        self.emitted = 0  # characters of `text` already handed out
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.stopped = False

    def flush(self) -> None:
        """At the end: add the text still held back, less the bytes waiting for the rest of a
        character (a generation cut mid-character ends with its last whole one, as vLLM's does,
        not with U+FFFD)."""
        if self.stopped or self.read_offset == len(self.ids):
            return
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip).rstrip("\ufffd")
        if len(full) > len(prefix):
            self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.ids)

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string it completed, if any (none while
        `check_stop` is False: min_tokens not reached yet)."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            before = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            if len(self.ids) > 64:  # keep the window small
                drop = self.prefix_offset
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            if self.stop and check_stop:
                return self._find_stop(before)
        return None

    def _find_stop(self, before: int) -> str | None:
        start = max(0, before - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.stopped = True
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.emitted = min(self.emitted, len(self.text))
        return s

    def take(self, finished: bool) -> str:
        """The text not yet handed out; while running, minus a tail that may start a stop string."""
        end = len(self.text)
        if not finished and self.stop:
            hold = 0
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.emitted), hold, -1):
                    if self.text.endswith(s[:k]):
                        hold = k
                        break
            end -= hold
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta
