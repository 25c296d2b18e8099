"""A checkpoint's tensors as the model loads them: safetensors, GGUF (its file, tensor names and
blocks) and the built-in random model, as float tensors and as compact weights kept as stored.
Imports the engine's `native/` (its formats and repacking)."""
