"""The backend contract (`pier.contract`): what the server and every backend share, and nothing
else. Like Triton's `tritonbackend.h`, it sits apart from both sides: `pier.contract` imports no
other module of Pier, the server and the backends import it, and a backend imports nothing of
Pier beyond it (tests/layout/test_layers.py keeps these rules).

- `backend`: the Backend / ModelInstance interfaces, the contexts a backend is built with, the
  execute result, and ServerServices (what a model may call back: BLS, model control).
- `types`: Tensor, InferenceRequest / InferenceResponse, TensorSpec, ModelSpec.
- `errors`: PierError and the protocol-neutral ErrorCode.
- `prometheus`: the text exposition format every exporter writes (backends' metrics included).
- `llm`: the LLM tensor protocol between the OpenAI frontend and the LLM backend.
"""
