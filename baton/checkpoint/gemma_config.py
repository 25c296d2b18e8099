"""What a `config.json` says of each layer's attention window, and the settings Gemma 2 and
Gemma 3 add to Llama's: soft-capped logits, the attention scale's own scalar, GeGLU, and
Gemma 3's local RoPE (docs/design.md, "Architectures")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Architectures whose config's `sliding_window` windows every layer's attention (Qwen2's is
# switched by `use_sliding_window`, which is refused).
WINDOWED_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' defaults for what a Gemma config.json may leave out (Gemma2Config,
# Gemma3TextConfig): the soft caps (attention logits, final logits), and every how many layers
# one attends to all positions where `layer_types` is absent (`sliding_window_pattern`).
_GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": {"softcaps": (50.0, 30.0), "pattern": 2},
    "Gemma3ForCausalLM": {"softcaps": (None, None), "pattern": 6},
}
GELU_TANH = "gelu_pytorch_tanh"
# Gemma's norms scale by 1 + w: its checkpoints' norm weights are loaded plus this, into float32
# weights (engine/models/weight_targets.py), so every norm kernel multiplies by the weight alone.
# (llama.cpp's converter stores them plus it already: a GGUF's are read minus it.)
GEMMA_NORM_SHIFT = 1.0


@dataclass(frozen=True)
class GemmaSettings:
    """What a Gemma config adds: `query_pre_attn_scalar` (attention scales by its -1/2 power,
    not head_dim's), the attention logits' and the final logits' soft caps (`c * tanh(x / c)`;
    None: none), and Gemma 3's RoPE base for its local (windowed) layers."""

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    rope_local_base_freq: float | None


def layer_windows(
    architecture: str, config: dict[str, Any], num_layers: int
) -> tuple[int | None, ...]:
    """Each layer's window (None: full attention). Gemma windows its `sliding_attention`
    layers (`layer_types`, else transformers' pattern); Mistral, Mixtral and Phi-3 every layer
    where `sliding_window` is set. ValueError for a window that is no positive integer or
    `layer_types` of another length or kind."""
    window = config.get("sliding_window")
    if architecture in GEMMA_ARCHITECTURES:
        window = 4096 if window is None else window  # transformers' default
        types = config.get("layer_types") or _default_layer_types(architecture, config, num_layers)
        if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
            raise ValueError(f"layer_types must be {num_layers} of {SLIDING!r} and {FULL!r}")
        windowed = [kind == SLIDING for kind in types]
    else:
        # (A null or 0 window is none, as Mistral's releases since v0.2 write it.)
        windowed = [architecture in WINDOWED_ARCHITECTURES and bool(window)] * num_layers
    if any(windowed) and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
    return tuple(window if is_windowed else None for is_windowed in windowed)


def _default_layer_types(architecture: str, config: dict[str, Any], num_layers: int) -> list[str]:
    """transformers' layer types where a config lists none: every `pattern`-th layer full."""
    pattern = config.get("sliding_window_pattern") or _GEMMA_DEFAULTS[architecture]["pattern"]
    return [SLIDING if (layer + 1) % pattern else FULL for layer in range(num_layers)]


def gemma_settings(architecture: str, config: dict[str, Any]) -> GemmaSettings | None:
    """A Gemma config's settings (None for another architecture). ValueError for what Baton
    does not compute: an activation other than GeGLU's tanh GELU, bidirectional attention."""
    if architecture not in GEMMA_ARCHITECTURES:
        return None
    activation = config.get("hidden_activation") or config.get("hidden_act") or GELU_TANH
    if activation != GELU_TANH:
        raise ValueError(f"unsupported hidden_activation {activation!r} (only {GELU_TANH})")
    if config.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    defaults = _GEMMA_DEFAULTS[architecture]["softcaps"]
    caps = [
        config.get(key, default)
        for key, default in zip(("attn_logit_softcapping", "final_logit_softcapping"), defaults)
    ]
    for cap in caps:
        if cap is not None and (isinstance(cap, bool) or not cap > 0):
            raise ValueError(f"a soft cap must be a number > 0, got {cap!r}")
    local_base = None
    if architecture == "Gemma3ForCausalLM":
        local = (config.get("rope_parameters") or {}).get(SLIDING)
        if local is not None and local.get("rope_type", "default") != "default":
            raise ValueError("scaled RoPE on the local (sliding) layers is not supported")
        local_base = (local or {}).get("rope_theta", config.get("rope_local_base_freq", 10000.0))
    return GemmaSettings(
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 256),
        attn_logit_softcapping=None if caps[0] is None else float(caps[0]),
        final_logit_softcapping=None if caps[1] is None else float(caps[1]),
        rope_local_base_freq=None if local_base is None else float(local_base),
    )


def global_rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of the layers that attend to every position, in either config style:
    transformers 5 writes Gemma 3's per layer type (`rope_parameters: {full_attention: {...},
    sliding_attention: {...}}`), other configs one dict, older ones `rope_scaling`."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return parameters.get(FULL, parameters)
