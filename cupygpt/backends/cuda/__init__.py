"""The CUDA backend (backend.CudaBackend): our kernels (kernels_cu/, compiled by CuPy's
RawModule), cuBLASLt's matmuls and cuDNN's fused attention, over CuPy arrays.

Nothing is imported here: cudasim's CuPy imports kernels.py, which must load without
CuPy."""
