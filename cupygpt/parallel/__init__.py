"""Parallelism: the process grid (mesh.py), one rank's step over it (runner.py) and a folder
per axis: data/, tensor/, pipeline/."""
