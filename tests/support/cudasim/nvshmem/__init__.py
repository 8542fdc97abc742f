"""cudasim's nvshmem4py: see nvshmem/core/__init__.py."""
