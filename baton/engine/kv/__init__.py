"""The paged KV cache: the pool of pages every layer's K and V live in, the dtype they are stored
in (--kv-cache-dtype), and the pool's size from the config and the model. Imports nothing of the
engine."""
