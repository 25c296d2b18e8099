"""Decode steps as the GPU replays them: batch-size buckets and padding, the persistent input
buffers a captured step reads, and the device-side pool of each slot's last sampled token that
the next step's inputs are taken from, so the host never waits for step N's tokens to launch
step N+1. Plain tensor code: on CPU tensors it is the same code, tested without a GPU. Imports
the engine's `batch/` and `attention/`."""
