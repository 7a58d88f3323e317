"""Backends: where the forward pass runs (NumPy reference on the CPU, CUDA on a GPU)."""
