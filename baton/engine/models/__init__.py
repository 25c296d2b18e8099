"""The transformer: `CausalLM`, its decoder layers and their building blocks (linear layers in
every stored form, norms, RoPE). Imports the engine's `attention/`, `kv/`, `native/` and
`weights/`."""
