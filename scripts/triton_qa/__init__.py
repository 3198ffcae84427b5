"""Runner for NVIDIA Triton's upstream QA tests (qa/L0_*, client and python_backend examples) against Pier."""
