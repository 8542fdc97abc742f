"""Transports: one interface (base.py), one file each; the choice is made here.

Which transports a backend's arrays can travel by is the backend's answer (its
TRANSPORTS, preferred first); the single process needs none and gets Local.
"""
import importlib

from .. import CupyGPTError

KINDS = {"mpi": ("mpi", "Mpi"), "nccl": ("nccl", "Nccl"), "nvshmem": ("nvshmem", "Nvshmem")}


def make_transport(name, be, mesh, timeout):
    """name: auto | mpi | nccl | nvshmem. Refuses one this backend cannot use."""
    if mesh.size == 1:
        from .local import Local
        return Local()
    name = be.TRANSPORTS[0] if name == "auto" else name
    if name not in be.TRANSPORTS:
        raise CupyGPTError(f"the {be.name} backend's arrays travel by "
                           f"{', '.join(be.TRANSPORTS)} only", "transport", name)
    module, cls = KINDS[name]
    kind = getattr(importlib.import_module(f".{module}", __name__), cls)
    return kind(be, mesh, timeout)
