"""Attention over the paged KV cache: the backend interface, its per-batch metadata, torch's
paged backend with the native kernels on CPU, and FlashInfer on CUDA. Imports the engine's
`native/`."""
