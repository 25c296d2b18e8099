"""The engine: runs the batches the scheduler hands it on a model, a paged KV pool, an attention
backend and a sampler. Only the scheduler process imports it (and torch).

Its rooms, lowest first; a room imports only rooms below it (tests/test_import_layers.py):
- `cpu/`, `native/`, `batch/`: what this CPU can do and the plan chosen from it; the C kernels
  and their formats; what a batch carries (`ForwardBatch` and each request's grammar matcher
  and random source, which the scheduler builds).
- `kv/`, `weights/`, `attention/`: the paged KV pool; a checkpoint's tensors (safetensors,
  GGUF, random) as the model loads them; the attention backends.
- `models/`: the transformer and its layers.
- `sampling/`, `graphs/`: from logits to tokens, in torch or in the native step; decode steps
  replayed from CUDA graphs (batch-size buckets, persistent inputs, one graph per bucket).
- `speculation/`: drafting tokens and verifying them.
- this folder: `Engine` (built from the config), `BatchRunner` (one batch, end to end) and
  `NativeDecodeStep` (a decode step in one C call).
"""
