"""The LLM tensor protocol: what a model served by the LLM backend (`backend: "llm"`,
pier.backends.llm) takes and answers, named once for both sides of it (the backend, and the
OpenAI frontend, pier.frontends.http.openai, that talks to it through the data plane). The
tensors are Triton's vLLM backend's, so clients written for Triton + vLLM work unchanged; Pier
adds a few for the OpenAI frontend. Every tensor holds one element, except INPUT_IDS.

Inputs (only TEXT_INPUT is required; the others are optional):

  text_input (BYTES)                the prompt, as text
  stream (BOOL)                     a response per engine step that made tokens, with its new text;
                                    otherwise one response per sequence with its whole text
  sampling_parameters (BYTES)       a JSON object of vLLM's sampling fields (SAMPLING_* name those
                                    the OpenAI frontend sets itself); request parameters with those
                                    names count too, the input wins
  exclude_input_in_output (BOOL)    whole (non-stream) texts without the prompt first
  return_finish_reason, return_num_input_tokens, return_num_output_tokens, return_logprobs (BOOL)
                                    ask for the outputs of those names (FLAG_INPUTS: every BOOL input)
  chat_messages (BYTES)             Pier's: a JSON list of chat messages, rendered with the model's
                                    chat template (in place of text_input); or an object of
                                    CHAT_OPTIONS (the messages, and template options)
  input_ids (INT64, [-1])           Pier's: the prompt as token ids (in place of the two above)

  A prompt from chat_messages or input_ids is never put in front of the output text.

Outputs, per response (the last one of a request carries the final flag):

  text_output (BYTES)               the sequence's new text (stream) or its whole text
  finish_reason (BYTES)             one of FINISH_REASONS on a sequence's last response, "" before
                                    (with return_finish_reason)
  stop_reason (BYTES)               on a sequence's last response, with finish_reason: JSON, the stop
                                    string or stop token id that ended it (null for EOS, length, abort)
  num_input_tokens, num_output_tokens (UINT32)
                                    the prompt's tokens and the sequence's tokens so far (when asked)
  sequence_index (UINT32)           which of the request's `n` sequences this response is of
  logprobs (BYTES)                  with return_logprobs: a LOGPROBS document for this response's
                                    tokens (empty lists when it has none)
  prompt_logprobs (BYTES)           with sampling's prompt_logprobs: a LOGPROBS document for the
                                    prompt's tokens (the first one's entry null) plus PROMPT_TEXT,
                                    the prompt's decoded text; once, in a sequence's first response

A LOGPROBS document: {"tokens": [the text of each token in place], "ids": [token ids], "logprobs":
[[logprob, [[alternative's text, logprob, alternative's id], ... best first]] or null, ...]}.

The backend's instances report INFO_MAX_MODEL_LEN (the model's context length, in tokens) in
their `info()`, which the data plane hands to frontends (models_with_backend(BACKEND_NAME)).
"""

from __future__ import annotations

BACKEND_NAME = "llm"  # the backend's name in a model's config (backend: "llm")
INFO_MAX_MODEL_LEN = "max_model_len"  # an instance's info(): the context length, in tokens
# A request an overloaded model handed to its fallback (kv_cache_degrade_threshold, fallback_model):
# the answer names the model that answered, this header the one asked
FALLBACK_FROM_HEADER = "x-pier-fallback-from"
INFO_TOOL_CALL_PARSER = "tool_call_parser"  # ... and how tool calls are found in its text (None: no parser)
# ... and, with LoRA on (enable_lora), the adapters it serves: {name: folder}. The OpenAI API's `model`
# picks one (the request goes to the base model with SAMPLING_LORA_NAME set); /v1/models lists them.
INFO_LORA_ADAPTERS = "lora_adapters"
# An adapter model (a repository model whose config names a `base_model`: backends/llm/adapter_model.py)
# says its base and its version's folder: /v1/models lists it as vLLM lists an adapter (parent, root).
INFO_LORA_PARENT = "lora_parent"
INFO_LORA_ROOT = "lora_root"
# The config.pbtxt parameter that makes an LLM model an adapter of another (its PEFT files in each version folder)
BASE_MODEL_PARAMETER = "base_model"
ADAPTER_MODEL_FILE = "adapter_config.json"  # ... its default_model_filename (what auto-complete looks for)
# The config.pbtxt parameter `tool_call_parser` takes vLLM's names of these formats.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")

# ---- inputs ------------------------------------------------------------------------------
TEXT_INPUT = "text_input"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
RETURN_FINISH_REASON = "return_finish_reason"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
RETURN_LOGPROBS = "return_logprobs"
CHAT_MESSAGES = "chat_messages"
INPUT_IDS = "input_ids"
# Nothing is generated: one response with the prompt's token ids (PROMPT_IDS) and their count
# (vLLM's /tokenize) ...
TOKENIZE = "tokenize"
# ... or with input_ids decoded as text_output (vLLM's /detokenize) ...
DETOKENIZE = "detokenize"
# ... or with the prompt's EMBEDDING (the last token's final hidden state, L2-normalised).
EMBED = "embed"

# The BOOL inputs: options of the request, false when left out.
FLAG_INPUTS = (STREAM, EXCLUDE_INPUT_IN_OUTPUT, RETURN_FINISH_REASON, RETURN_NUM_INPUT_TOKENS,
               RETURN_NUM_OUTPUT_TOKENS, RETURN_LOGPROBS, TOKENIZE, DETOKENIZE, EMBED)

# ---- outputs -----------------------------------------------------------------------------
TEXT_OUTPUT = "text_output"
FINISH_REASON = "finish_reason"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
SEQUENCE_INDEX = "sequence_index"
LOGPROBS = "logprobs"
STOP_REASON = "stop_reason"
PROMPT_LOGPROBS = "prompt_logprobs"
PROMPT_IDS = "prompt_ids"  # TOKENIZE's answer
EMBEDDING = "embedding"  # EMBED's answer (FP32)

# The model's signature (auto-complete): (name, datatype, dims), -1 where variable.
INPUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    (TEXT_INPUT, "BYTES", (1,)),
    (STREAM, "BOOL", (1,)),
    (SAMPLING_PARAMETERS, "BYTES", (1,)),
    (EXCLUDE_INPUT_IN_OUTPUT, "BOOL", (1,)),
    (RETURN_FINISH_REASON, "BOOL", (1,)),
    (RETURN_NUM_INPUT_TOKENS, "BOOL", (1,)),
    (RETURN_NUM_OUTPUT_TOKENS, "BOOL", (1,)),
    (RETURN_LOGPROBS, "BOOL", (1,)),
    (CHAT_MESSAGES, "BYTES", (1,)),
    (INPUT_IDS, "INT64", (-1,)),
    (TOKENIZE, "BOOL", (1,)),
    (DETOKENIZE, "BOOL", (1,)),
    (EMBED, "BOOL", (1,)),
)
OUTPUTS: tuple[tuple[str, str, tuple[int, ...]], ...] = (
    (TEXT_OUTPUT, "BYTES", (-1,)),
    (FINISH_REASON, "BYTES", (-1,)),
    (NUM_INPUT_TOKENS, "UINT32", (-1,)),
    (NUM_OUTPUT_TOKENS, "UINT32", (-1,)),
    (SEQUENCE_INDEX, "UINT32", (-1,)),
    (LOGPROBS, "BYTES", (-1,)),
    (STOP_REASON, "BYTES", (-1,)),
    (PROMPT_LOGPROBS, "BYTES", (-1,)),
    (PROMPT_IDS, "INT64", (-1,)),
    (EMBEDDING, "FP32", (-1,)),
)

# ---- finish reasons (the finish_reason output; OpenAI's values) ---------------------------
FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens, or the model's context
FINISH_ABORT = "abort"  # cancelled (the client went away)
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT)

# ---- sampling_parameters keys the OpenAI frontend sets itself ------------------------------
SAMPLING_MAX_TOKENS = "max_tokens"
SAMPLING_N = "n"  # sequences per request (sequence_index 0 .. n-1)
SAMPLING_LOGPROBS = "logprobs"  # alternatives per generated token
SAMPLING_PROMPT_LOGPROBS = "prompt_logprobs"  # alternatives per prompt token (asks for that output)
SAMPLING_LORA_NAME = "lora_name"  # the LoRA adapter to run (Triton's vLLM backend's field too)
SAMPLING_STRUCTURED_OUTPUTS = "structured_outputs"  # vLLM's object: json, json_object, regex, choice, grammar

# ---- a request parameter ------------------------------------------------------------------
# TIMINGS true: each sequence's last response carries the engine's phases of it in its response
# parameters, under the same name: a JSON object of seconds, vLLM's names (its llm_request span's
# gen_ai.latency.* attributes): time_in_queue, time_in_model_inference, and once a token came
# time_in_model_prefill, time_in_model_decode. The OpenAI frontend asks for them for a call it traces.
TIMINGS = "timings"

# ---- chat_messages as an object: the messages and the chat template's options -------------
CHAT_OPTION_MESSAGES = "messages"
CHAT_OPTION_ADD_GENERATION_PROMPT = "add_generation_prompt"  # default true
CHAT_OPTION_CONTINUE_FINAL_MESSAGE = "continue_final_message"  # default false: end right after it
CHAT_OPTION_TEMPLATE_KWARGS = "chat_template_kwargs"  # extra template variables (an object)
CHAT_OPTION_TOOLS = "tools"  # a list of tools the template shows the model
CHAT_OPTIONS = (CHAT_OPTION_MESSAGES, CHAT_OPTION_ADD_GENERATION_PROMPT, CHAT_OPTION_CONTINUE_FINAL_MESSAGE,
                CHAT_OPTION_TEMPLATE_KWARGS, CHAT_OPTION_TOOLS)

# ---- the keys of a LOGPROBS document (the logprobs and prompt_logprobs outputs) -----------
LOGPROBS_TOKENS = "tokens"
LOGPROBS_IDS = "ids"
LOGPROBS_ENTRIES = "logprobs"
PROMPT_TEXT = "text"  # prompt_logprobs only
