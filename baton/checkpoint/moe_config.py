"""A mixture-of-experts model's routing and experts, parsed from its `config.json`: Qwen2-MoE
(a shared expert beside the routed ones), Qwen3-MoE and Mixtral."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """Each token's `top_k` of `num_experts` experts (gated MLPs of `expert_intermediate_size`
    features), chosen by a softmax router whose chosen probabilities are renormalised to sum to
    1 where `normalize_top_k`; a shared expert of `shared_intermediate_size` features (0: none)
    added to every token under a sigmoid gate. `dense_layers` keep a plain MLP of the model's
    intermediate size. `prefix` and `expert_names` are the checkpoint's tensor names: the block
    under a layer, and each expert's gate, up and down projections. `float32_weights`: the
    routing weights multiply the experts' outputs in float32 (Mixtral's), else in the
    activations' dtype (Qwen's)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize_top_k: bool
    shared_intermediate_size: int = 0
    dense_layers: frozenset[int] = frozenset()
    prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    float32_weights: bool = False

    def expert_weight_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """The checkpoint's names of expert `expert`'s gate, up and down weights in `layer`."""
        prefix = f"model.layers.{layer}.{self.prefix}.experts.{expert}."
        gate, up, down = (f"{prefix}{name}.weight" for name in self.expert_names)
        return gate, up, down

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` (the checkpoint's index) routes among experts."""
        return layer not in self.dense_layers


def moe_config(architecture: str, config: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """The MoE settings of a `config.json` dict of `architecture` (None for a dense model).
    ValueError naming a setting that makes no sense (the caller words it as a CheckpointError)."""
    if architecture == "MixtralForCausalLM":
        return _checked(
            MoEConfig(
                num_experts=int(config.get("num_local_experts", 8)),
                top_k=int(config.get("num_experts_per_tok", 2)),
                expert_intermediate_size=int(config["intermediate_size"]),
                normalize_top_k=True,
                prefix="block_sparse_moe",
                expert_names=("w1", "w3", "w2"),
                float32_weights=True,
            )
        )
    if architecture not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    step = int(config.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    only_mlp = set(config.get("mlp_only_layers") or ())
    dense = frozenset(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
    qwen2 = architecture == "Qwen2MoeForCausalLM"
    return _checked(
        MoEConfig(
            # (transformers 5 writes Qwen3-MoE's count as num_local_experts)
            num_experts=int(config.get("num_experts") or config.get("num_local_experts") or 0),
            top_k=int(config.get("num_experts_per_tok", 0)),
            expert_intermediate_size=int(config.get("moe_intermediate_size", 0)),
            normalize_top_k=bool(config.get("norm_topk_prob", False)),
            shared_intermediate_size=(
                int(config.get("shared_expert_intermediate_size", 0)) if qwen2 else 0
            ),
            dense_layers=dense,
        )
    )


def _checked(moe: MoEConfig) -> MoEConfig:
    if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts:
        raise ValueError(
            f"{moe.top_k} experts per token of {moe.num_experts}: need 1 <= top-k <= experts"
        )
    if moe.expert_intermediate_size < 1:
        raise ValueError("the experts' intermediate size must be positive")
    return moe
