"""TensorRT backend (platform `tensorrt_plan`, backend `tensorrt`); needs a GPU and pier[gpu]."""
