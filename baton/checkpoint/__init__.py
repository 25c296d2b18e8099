"""Checkpoints: resolving a model (folder, hub id, GGUF file, the built-in random model), its
config, tokenizer and chat template, without torch: every process reads these, only the
engine loads tensors (engine/weights/). Imports only the package's foundation modules."""
