"""Parallelism: the process grid (mesh.py) and one sub-package per axis (pipeline/)."""
