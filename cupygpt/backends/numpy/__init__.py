"""The NumPy backend (backend.NumpyBackend): the reference every other backend is held
to, on the CPU, each op family in the module named as the CUDA backend's."""
