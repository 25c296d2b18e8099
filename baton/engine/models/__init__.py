"""The transformer: `CausalLM`, its decoder layers and their building blocks (linear layers in
every stored form, norms, RoPE, the gated MLP), and a tensor-parallel rank's shard of each
(`parallel_layers.py`, `weight_targets.py`). Imports the engine's `attention/`, `kv/`, `native/`
and `weights/`, and `baton/distributed/`'s collectives."""
