# As the models of Triton's QA (L0_model_namespacing): model.py defines no class itself, it takes
# TritonPythonModel (with its config hook) from another module, so nothing in this file
# says that it auto-completes its config.
import importlib.util
import os

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "auto_add_sub", "1", "model.py")
_spec = importlib.util.spec_from_file_location("auto_add_sub_reexported", _path)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
TritonPythonModel = _module.TritonPythonModel
