"""The OpenAPI components: the request and response bodies of KServe v2, Triton's extensions, the
OpenAI API and Pier's own routes, and the two error shapes (`{"error": "..."}` on every route but
the OpenAI API's, whose errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`).

Schemas say what Pier sends and requires; they leave objects open (extra fields allowed) where a
client may send fields Pier ignores or Pier adds fields of its own, so that the document stays
true as the API grows."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: tuple[str, ...] = (), **props: Schema) -> Schema:
    out: Schema = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    return out


def array(items: Schema) -> Schema:
    return {"type": "array", "items": items}


STRING: Schema = {"type": "string"}
INT: Schema = {"type": "integer"}
NUMBER: Schema = {"type": "number"}
BOOL: Schema = {"type": "boolean"}
ANY_OBJECT: Schema = {"type": "object", "additionalProperties": True}
NULLABLE_STRING: Schema = {"type": "string", "nullable": True}
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES"]
_PARAMETERS: Schema = {"type": "object", "additionalProperties": {"oneOf": [STRING, NUMBER, BOOL]}}
_DURATION = obj(("count", "ns"), count=INT, ns=INT)

_TENSOR_META = obj(("name", "datatype", "shape"), name=STRING, datatype=STRING, shape=array(INT))
_TENSOR_DATA: Schema = {"description": "The tensor's elements, row-major, flat or nested; absent when "
                                       "they travel as binary data or in shared memory"}
_INPUT = obj(("name", "shape", "datatype"), name=STRING, shape=array(INT),
             datatype={"type": "string", "enum": DATATYPES}, parameters=_PARAMETERS, data=_TENSOR_DATA)
_OUTPUT = obj(("name", "datatype", "shape"), name=STRING, shape=array(INT), datatype=STRING, parameters=_PARAMETERS,
              data=_TENSOR_DATA)

SCHEMAS: dict[str, Schema] = {
    "Error": {**obj(("error",), error=STRING), "description": "Every error outside the OpenAI API"},
    "OpenAIError": obj(("error",), error=obj(("message", "type"), message=STRING, type=STRING,
                                             param=NULLABLE_STRING, code={"nullable": True})),
    "ServerMetadata": obj(("name", "version", "extensions"), name=STRING, version=STRING, extensions=array(STRING)),
    "ModelMetadata": obj(("name", "versions", "platform", "inputs", "outputs"), name=STRING, versions=array(STRING),
                         platform=STRING, inputs=array(_TENSOR_META), outputs=array(_TENSOR_META)),
    "InferenceRequest": obj(("inputs",), id=STRING, parameters=_PARAMETERS, inputs=array(_INPUT),
                            outputs=array(obj(("name",), name=STRING, parameters=_PARAMETERS))),
    "InferenceResponse": obj(("model_name", "outputs"), model_name=STRING, model_version=STRING, id=STRING,
                             parameters=_PARAMETERS, outputs=array(_OUTPUT)),
    "GenerateRequest": {"type": "object", "additionalProperties": True,
                        "description": "Input tensors by name (scalars or lists), and optional `id` and "
                                       "`parameters`"},
    "GenerateResponse": {**obj(("model_name",), model_name=STRING, model_version=STRING, id=STRING),
                         "additionalProperties": True},
    "ModelConfig": {**ANY_OBJECT, "description": "The completed model configuration, as Triton's JSON"},
    "ModelStatistics": obj(("model_stats",), model_stats=array(obj(
        ("name", "version", "inference_count", "execution_count", "inference_stats"),
        name=STRING, version=STRING, last_inference=INT, inference_count=INT, execution_count=INT,
        inference_stats={"type": "object", "additionalProperties": _DURATION},
        batch_stats=array(ANY_OBJECT), response_stats=ANY_OBJECT, memory_usage=array(ANY_OBJECT)))),
    "RepositoryIndexRequest": obj(ready=BOOL),
    "RepositoryIndex": array(obj(("name",), name=STRING, version=STRING, state=STRING, reason=STRING)),
    "LoadRequest": obj(parameters={"type": "object", "additionalProperties": True,
                                   "description": "`config` (ModelConfig JSON) and `file:<path>` (base64)"}),
    "UnloadRequest": obj(parameters=obj(unload_dependents=BOOL)),
    "RolloutRequest": obj(version={"oneOf": [STRING, INT]},
                          weights={"type": "object", "additionalProperties": NUMBER}),
    "Traffic": obj(("name", "traffic"), name=STRING, traffic={"type": "object", "additionalProperties": NUMBER}),
    "SharedMemoryStatus": array(obj(("name",), name=STRING, key=STRING, offset=INT, byte_size=INT, device_id=INT)),
    "SharedMemoryRegister": obj(("key", "byte_size"), key=STRING, offset=INT, byte_size=INT),
    "CudaSharedMemoryRegister": obj(raw_handle=ANY_OBJECT, device_id=INT, byte_size=INT),
    "LogSettings": {"type": "object", "additionalProperties": {"oneOf": [STRING, INT, BOOL]}},
    "TraceSettings": {"type": "object", "additionalProperties": {"oneOf": [STRING, array(STRING)]}},
    "ModelList": obj(("object", "data"), object=STRING, data=array(obj(
        ("id", "object"), id=STRING, object=STRING, created=INT, owned_by=STRING, root=STRING,
        parent=NULLABLE_STRING, max_model_len=INT))),
    "CompletionRequest": {**obj(("model",), model=STRING, prompt={"description": "text, token ids, or a list"},
                                max_tokens={"type": "integer", "nullable": True}, temperature=NUMBER, top_p=NUMBER,
                                n=INT, stream=BOOL, stop={"oneOf": [STRING, array(STRING)], "nullable": True},
                                seed={"type": "integer", "nullable": True}, logprobs={"nullable": True}),
                          "additionalProperties": True},
    "ChatCompletionRequest": {**obj(("model", "messages"), model=STRING, messages=array(obj(
        ("role",), role=STRING, content={"nullable": True})), max_tokens={"type": "integer", "nullable": True},
        max_completion_tokens={"type": "integer", "nullable": True}, temperature=NUMBER, top_p=NUMBER, n=INT,
        stream=BOOL, tools=array(ANY_OBJECT), response_format=ANY_OBJECT), "additionalProperties": True},
    "Usage": obj(("prompt_tokens", "total_tokens"), prompt_tokens=INT, completion_tokens=INT, total_tokens=INT),
    "Completion": obj(("id", "object", "created", "model", "choices"), id=STRING, object=STRING, created=INT,
                      model=STRING, choices=array(obj(("index",), index=INT, text=STRING,
                                                      finish_reason=NULLABLE_STRING, logprobs={"nullable": True})),
                      usage=ref("Usage")),
    "ChatCompletion": obj(("id", "object", "created", "model", "choices"), id=STRING, object=STRING, created=INT,
                          model=STRING, choices=array(obj(("index",), index=INT, message=ANY_OBJECT,
                                                          finish_reason=NULLABLE_STRING, logprobs={"nullable": True})),
                          usage=ref("Usage")),
    "EmbeddingRequest": {**obj(("model", "input"), model=STRING, input={"description": "text, token ids, or a list"},
                               encoding_format=STRING, dimensions=INT), "additionalProperties": True},
    "Embeddings": obj(("object", "data", "model"), object=STRING, model=STRING, usage=ref("Usage"),
                      data=array(obj(("index", "embedding"), index=INT, object=STRING,
                                     embedding={"oneOf": [array(NUMBER), STRING]}))),
    "TokenizeRequest": {**obj(("model",), model=STRING, prompt=STRING, messages=array(ANY_OBJECT),
                              add_special_tokens=BOOL), "additionalProperties": True},
    "Tokens": obj(("tokens", "count"), tokens=array(INT), count=INT, max_model_len=INT,
                  token_strs={**array(STRING), "nullable": True}),  # null unless asked for (vLLM's)
    "DetokenizeRequest": obj(("model", "tokens"), model=STRING, tokens=array(INT)),
    "Text": obj(("prompt",), prompt=STRING),
    "LoadLoRARequest": obj(("lora_name", "lora_path"), lora_name=STRING, lora_path=STRING, load_inplace=BOOL,
                           model=STRING),
    "UnloadLoRARequest": obj(("lora_name",), lora_name=STRING, model=STRING),
    "Version": obj(("version",), version=STRING),
    "Status": {**obj(("refresh_s", "withheld"), refresh_s=NUMBER, window_s=NUMBER, withheld=array(STRING),
                     server=ANY_OBJECT, models=array(obj(("name", "state"), name=STRING,
                                                        version={"type": "string", "nullable": True},
                                                        state=STRING, reason=STRING, traffic_percent={
                                                            "type": "number", "nullable": True},
                                                        execution=ANY_OBJECT, stats=ANY_OBJECT))),
               "description": "The status page's data (docs/status-and-api.md); a part the caller may not read "
                              "(--http-restricted-api) is absent and its category named in `withheld`"},
}
