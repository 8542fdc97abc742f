"""Transports: one interface (base.py), one file each; the choice is made here.

Which transports a backend's arrays can travel by is the backend's answer (its
TRANSPORTS, preferred first); the single process needs none and gets Local.
"""
from __future__ import annotations

import importlib

from ..backends.protocol import Backend
from .base import Transport
from .local import Local

KINDS = {"mpi": ("mpi", "Mpi"), "nccl": ("nccl", "Nccl"), "nvshmem": ("nvshmem", "Nvshmem")}


def make_transport(name: str, be: Backend, mesh, timeout: float) -> Transport:
    """name: auto or one of the backend's TRANSPORTS (config/sections.py's Device.validate
    checked it)."""
    if mesh.size == 1:
        return Local()
    name = be.TRANSPORTS[0] if name == "auto" else name
    module, cls = KINDS[name]
    kind = getattr(importlib.import_module(f".{module}", __name__), cls)
    return kind(be, mesh, timeout)
