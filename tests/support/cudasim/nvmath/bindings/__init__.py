"""cudasim's nvmath.bindings: cublasLt only (what the CUDA backend imports)."""
