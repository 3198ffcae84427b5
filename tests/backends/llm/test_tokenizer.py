"""Incremental detokenization, stop strings, chat templates."""

from __future__ import annotations

import pytest

from pier.backends.llm.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Héllo wörld ☃ 日本語 🙂 the lazy dog 🙂🙂 ünïcode"


@pytest.fixture(scope="module")
def tok(llama_dir):
    return Tokenizer(llama_dir)


def test_never_splits_utf8(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    # byte-level BPE: some characters span several tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt", add_special_tokens=True))
    pieces = []
    for i in ids:
        detok.add(i)
        piece = detok.take(finished=False)
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # a whole-character string
        pieces.append(piece)
    pieces.append(detok.take(finished=True))
    assert "".join(pieces) == TEXT == tok.decode(ids)


def test_stop_string_cut_and_held_back(tok):
    ids = tok.encode("the quick brown fox jumps", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [0], stop=("brown fox",))
    emitted = ""
    stop = None
    for i in ids:
        stop = detok.add(i)
        emitted += detok.take(finished=stop is not None)
        assert "brown" not in emitted
        if stop:
            break
    assert stop == "brown fox"
    assert emitted == "the quick "


def test_stop_string_included(tok):
    ids = tok.encode("the quick brown fox jumps", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [0], stop=("quick",), include_stop=True)
    for i in ids:
        if detok.add(i):
            break
    assert detok.take(finished=True) == "the quick"


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>hi</s><|assistant|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 0


def test_encode_adds_bos(tok):
    assert tok.encode("hi")[0] == 0
    assert tok.encode("hi", add_special_tokens=False)[0] != 0


def test_config_special_tokens_are_skipped(tmp_path):
    """eos/bos named in tokenizer_config.json are special even when tokenizer.json has them as
    plain vocabulary (as transformers counts them): skip_special_tokens leaves them out."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "a": 3, "b": 4}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    t = Tokenizer(tmp_path)
    assert t.decode([3, 1, 4]) == "a b"
    assert t.decode([3, 1, 4], skip_special_tokens=False) == "a </s> b"
    assert {0, 1} <= t.special_ids


def test_chat_template_options(tok):
    """The OpenAI frontend's template options: no generation prompt, continuing the final message,
    extra template variables; contradictory or reserved ones are errors."""
    from pier.backends.llm.chat import render_chat

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    assert render_chat(tok, msgs[:1]) == "<s><|user|>hi</s><|assistant|>"  # a plain list: as before
    assert render_chat(tok, {"messages": msgs[:1], "add_generation_prompt": False}) == "<s><|user|>hi</s>"
    cont = render_chat(tok, {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    assert cont == "<s><|user|>hi</s><|assistant|>Once upon"  # no end-of-turn after the final message
    with pytest.raises(ValueError, match="cannot both be true"):
        render_chat(tok, {"messages": msgs, "continue_final_message": True})
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        render_chat(tok, {"messages": msgs, "chat_template_kwargs": {"messages": []}})


def test_chat_content_parts_null_content_and_developer_role(tok):
    """As vLLM renders them for a string-content template: text parts joined by newlines, null
    content empty, the developer role as system (the SDK and agent frameworks send all three)."""
    from pier.backends.llm.chat import render_chat

    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    assert render_chat(tok, parts) == render_chat(tok, [{"role": "user", "content": "hi\nthere"}])
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
               {"role": "user", "content": "x"}]
    assert "None" not in render_chat(tok, history)
    assert render_chat(tok, history) == render_chat(tok, [{**m, "content": m["content"] or ""} for m in history])
    dev = render_chat(tok, [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert dev == render_chat(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="text parts"):
        render_chat(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_a_character_cut_at_the_end_is_dropped(tok):
    """As vLLM: a generation that ends mid-character (max_tokens) ends with the last whole one."""
    ids = tok.encode("ab 🙂", add_special_tokens=False)
    whole = tok.encode("ab ", add_special_tokens=False)
    assert len(ids) > len(whole) + 1 and "\ufffd" in tok.decode(ids[:-1])  # the emoji spans several tokens
    detok = IncrementalDetokenizer(tok, [0])
    for i in ids[:-1]:
        detok.add(i)
    detok.flush()
    text = detok.take(finished=True)
    assert "\ufffd" not in text and text == tok.decode(whole)


def test_chat_template_sees_the_tools(llama_dir):
    """Tools sent with tool_choice "none" reach a template that renders them (vLLM's default)."""
    from pier.backends.llm.chat import render_chat

    tok = Tokenizer(llama_dir)
    tok.chat_template = ("{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, {"messages": msgs, "tools": [tool, tool]}) == "[get_weather;get_weather;]hi"
    assert render_chat(tok, msgs) == "hi"


def test_logprob_token_texts_read_in_place(tok):
    """A logprob token's text is what it adds after what precedes it (the prompt's tail for the
    first one): a character split across tokens is carried by its last byte token, the ones before
    it read '', so the texts spell the text."""
    from types import SimpleNamespace

    from pier.backends.llm.backend import LLMInstance

    ids = tok.encode("a ☃ b 日本", add_special_tokens=False)
    split = next(i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i]))  # inside a character
    texts = LLMInstance._token_texts(SimpleNamespace(tokenizer=tok), ids[split:], ids[:split])
    assert "".join(texts) == tok.decode(ids)[len(tok.decode(ids[:split]).rstrip("\ufffd")):]
    assert "\ufffd" not in "".join(texts)
