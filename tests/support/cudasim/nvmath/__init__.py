"""cudasim's nvmath-python: the cuBLASLt bindings (bindings/cublasLt.py) the CUDA backend's
matmuls call, on the CPU."""
