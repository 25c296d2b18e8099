"""The paged KV cache: the pool of pages every layer's K and V live in, and its size from the
config and the model. Imports nothing of the engine."""
