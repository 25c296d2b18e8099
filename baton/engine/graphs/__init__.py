"""Decode steps as the GPU replays them: batch-size buckets and padding, the persistent input
buffers a recorded step reads, and the graphs recorded per bucket. Plain tensor code:
on CPU tensors it is the same code, tested without a GPU (cuda_setup.py alone needs CUDA).
Imports the engine's `kv/`, `attention/` and `models/`."""
