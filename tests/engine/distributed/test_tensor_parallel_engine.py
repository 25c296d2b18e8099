"""Tensor parallelism in the engine: two ranks over gloo, each holding its shard of the model,
give a single process's greedy tokens (Llama with GQA, o bias and a vocabulary the ranks do not
divide; Qwen2's qkv bias and tied head from bf16 weights; Qwen3's q/k norms; a GGUF held as
stored; one KV head copied on both ranks; a draft model run whole on each rank; mixtures of
experts, each rank holding half of them: float32 in torch, bf16 and a GGUF's blocks in the
native expert kernel, a shared expert on the first rank), and the same tokens on both ranks,
sampled ones too; what the ranks cannot divide is refused at start-up in one line."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.distributed_ranks import run_ranks

from baton.bench.gguf_export import export_gguf
from baton.checkpoint.load import load_checkpoint
from baton.config import BatonConfig, ConfigurationError
from baton.distributed.process_group import Ranks
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.batch.forward_batch import ForwardBatch
from baton.engine.batch.seeded_uniforms import seeded_uniforms
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.engine import Engine
from baton.engine.models.moe import SparseMoE
from baton.hardware import isa_rank
from baton.sampling_params import SamplingParams

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
NATIVE = isa_rank(detect_cpu_capabilities().isa) >= isa_rank("avx2") and shutil.which("cc")
# Prefill chunks of this many tokens: the longest prompt takes three, the others one or two,
# so decode rows and prefill chunks share batches.
CHUNK = 16
NEW_TOKENS = 10
PROMPTS = [
    [(7 * j + 3) % 250 for j in range(41)],
    [(5 * j + 1) % 250 for j in range(9)],
    [(11 * j + 2) % 250 for j in range(23)],
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# Sampled rows: one with its own seed, one drawing from the engine's generator (--seed).
SAMPLED = [
    SamplingParams(temperature=1.0, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True),
]
PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@dataclass(frozen=True)
class Case:
    """One model the ranks serve; `hf`: its folder, to check tokens against transformers;
    `drafts`: how many drafts a decode row verifies (with a speculative config in `options`)."""

    name: str
    model: str
    hf: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    drafts: int = 0


def engine_config(model: str, **options: Any) -> BatonConfig:
    """A float32 engine on one thread; the AVX2 plan on every CPU, so that no bf16 GEMM rounds
    a rank's partial product (which would part its tokens from a single process's)."""
    return BatonConfig(
        model=model,
        dtype="float32",
        max_cpu_isa="avx2",
        num_threads=1,
        omp_threads_bind="nobind",
        num_pages=32,
        max_model_len=256,
        max_running_requests=8,
        **options,
    )


def run_requests(
    engine: Engine, prompts: list[list[int]], params: list[SamplingParams], drafts: int = 0
) -> tuple[list[list[int]], int]:
    """Each prompt's NEW_TOKENS tokens, through `Engine.forward` as the scheduler drives it,
    and the number of steps: prompts prefilled CHUNK tokens a step, every unfinished request a
    row of each batch, and with `drafts`, decode rows verifying up to that many drafts."""
    longest = max(map(len, prompts)) + NEW_TOKENS + drafts
    pages_each = -(-longest // engine.page_size)
    tables = [list(range(i * pages_each, (i + 1) * pages_each)) for i in range(len(prompts))]
    generators = [seeded_uniforms(p.seed, engine.device) for p in params]
    cached = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    steps = 0
    while any(len(tokens) < NEW_TOKENS for tokens in outputs):
        steps += 1
        batch = ForwardBatch([], [], [], [], [], [], [], [], [], num_drafts=[], contexts=[])
        decoding = set()
        for i, prompt in enumerate(prompts):
            if len(outputs[i]) >= NEW_TOKENS:
                continue
            start = cached[i]
            if start < len(prompt):
                part, num_drafts = prompt[start : start + CHUNK], 0
                cached[i] += len(part)
            else:  # the last token, then placeholders for the drafts the engine proposes
                num_drafts = min(drafts, NEW_TOKENS - len(outputs[i]) - 1)
                part = outputs[i][-1:] + [0] * num_drafts
                decoding.add(i)
            if cached[i] >= len(prompt):
                batch.sample_rows.append(len(batch.slots))
                batch.sampling_params.append(params[i])
                batch.generators.append(generators[i])
                batch.suppressed_token_ids.append([])
            batch.input_ids.extend(part)
            batch.kv_starts.append(start)
            batch.q_lens.append(len(part))
            batch.page_tables.append(tables[i])
            batch.slots.append(i)
            batch.num_drafts.append(num_drafts)
            batch.contexts.append(prompt + outputs[i] if num_drafts else [])
        rows = [batch.slots[row] for row in batch.sample_rows]
        for i, tokens in zip(rows, engine.forward(batch).token_ids):
            if i in decoding:
                cached[i] += len(tokens)  # the last token's and the accepted drafts' K/V
            outputs[i].extend(tokens)
    return outputs, steps


def serve_cases(cases: list[Case], ranks: Ranks) -> dict[str, dict[str, Any]]:
    """Per case, the greedy and the sampled requests' tokens, whether a native decode step
    ran, and the KV heads of the pool (and of a draft model's); on one thread, so that two
    ranks share two cores."""
    torch.set_num_threads(1)
    results = {}
    for case in cases:
        engine = Engine(engine_config(case.model, **case.options), tp=ranks.tp)
        draft = engine.speculator.drafter if engine.speculator else None
        greedy, steps = run_requests(engine, PROMPTS, [GREEDY] * len(PROMPTS), case.drafts)
        results[case.name] = {
            "greedy": greedy,
            "steps": steps,
            "sampled": run_requests(engine, PROMPTS[:2], SAMPLED, case.drafts)[0],
            "native_step": engine.decode_step is not None,
            "kv_heads": engine.kv_pool.k_cache(0).shape[-2],
            "draft_kv_heads": draft.kv_pool.k_cache(0).shape[-2] if draft else None,
            # Each mixture-of-experts layer's experts: which, held as stored, a shared expert.
            "experts": [
                (layer.mlp.held, layer.mlp.stored is not None, layer.mlp.shared_expert is not None)
                for layer in engine.model.layers
                if isinstance(layer.mlp, SparseMoE)
            ],
        }
    return results


@pytest.fixture(scope="module")
def cases(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    gguf_source = tiny_model_factory(
        "llama", vocab_size=301, head_dim=32, intermediate_size=192, **PLAIN_ROPE
    )
    gguf = export_gguf(gguf_source, "float32", tmp_path_factory.mktemp("gguf") / "t.gguf", "Q8_0")
    # Every layer sparse (as llama.cpp's MoE files are), each expert whole on one rank: its
    # 64 features whole Q8_0 blocks.
    moe_source = tiny_model_factory(
        "qwen3_moe", vocab_size=300, mlp_only_layers=[], moe_intermediate_size=64
    )
    moe_gguf = export_gguf(
        moe_source, "float32", tmp_path_factory.mktemp("gguf") / "moe.gguf", "Q8_0"
    )
    for path in (gguf, moe_gguf):
        load_checkpoint(str(path))  # its metadata converted once, not by both ranks at once
    llama = str(tiny_model_factory("llama"))
    # The target as its own draft model: every draft is accepted, so rows verify several.
    speculative = {"method": "draft_model", "model": llama, "num_speculative_tokens": 3}
    return [
        Case("llama", llama, hf=True),
        Case("draft_model", llama, True, {"speculative_config": speculative}, drafts=3),
        Case("qwen2", str(tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)), hf=True),
        Case("qwen3", str(tiny_model_factory("qwen3")), hf=True),
        Case("gguf_q8_0", str(gguf)),
        Case("one_kv_head", str(tiny_model_factory("qwen3", num_key_value_heads=1)), hf=True),
        # Each rank's q/k norm heads, post-norms after the row-parallel sums, windowed layers.
        Case("gemma3", str(tiny_model_factory("gemma3")), hf=True),
        # Three of six experts a rank, routed over all six; a shared expert and bf16 experts
        # multiplied as stored (their widths whole blocks of 32); a GGUF's experts read where
        # the file maps them.
        Case("qwen3_moe", str(tiny_model_factory("qwen3_moe")), hf=True),
        Case(
            "qwen2_moe",
            str(
                tiny_model_factory(
                    "qwen2_moe",
                    weights_dtype=torch.bfloat16,
                    moe_intermediate_size=64,
                    shared_expert_intermediate_size=96,
                )
            ),
            hf=True,
        ),
        Case("gguf_qwen3_moe_q8_0", str(moe_gguf)),
    ]


@pytest.fixture(scope="module")
def served(cases: list[Case]) -> tuple[dict, dict, dict]:
    """(rank 0's, rank 1's, a single process's) results of every case."""
    ranks = run_ranks(functools.partial(serve_cases, cases), size=2, timeout_s=120)
    for status, value in ranks.values():
        assert status == "ok", value
    threads = torch.get_num_threads()
    try:
        single = serve_cases(cases, Ranks())
    finally:
        torch.set_num_threads(threads)  # (the engines set this process's threads to one)
    return ranks[0][1], ranks[1][1], single


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen2",
        "qwen3",
        "gguf_q8_0",
        "one_kv_head",
        "draft_model",
        "gemma3",
        "qwen3_moe",
        "qwen2_moe",
        "gguf_qwen3_moe_q8_0",
    ],
)
def test_two_ranks_give_one_process_greedy_tokens(
    served: tuple[dict, dict, dict], cases: list[Case], name: str
) -> None:
    rank0, rank1, single = (results[name] for results in served)
    assert rank0["greedy"] == rank1["greedy"] == single["greedy"]
    assert len({tuple(tokens) for tokens in single["greedy"]}) == len(PROMPTS)  # not degenerate
    case = next(case for case in cases if case.name == name)
    if case.hf:  # and they are transformers' float32 greedy tokens
        # (Imported here: the rank processes unpickle this module, and need no transformers.)
        from helpers import assert_greedy_matches_hf

        for prompt, tokens in zip(PROMPTS, rank0["greedy"]):
            assert_greedy_matches_hf(Path(case.model), prompt, tokens)


def test_sampled_rows_draw_the_same_tokens_on_both_ranks(served: tuple[dict, dict, dict]) -> None:
    """Identical gathered logits, and generators seeded alike (the request's own seed, or
    --seed's): both ranks sample the same tokens."""
    rank0, rank1, _ = served
    for name in rank0:
        assert rank0[name]["sampled"] == rank1[name]["sampled"], name


def test_ranks_hold_their_kv_heads_and_step_op_by_op(served: tuple[dict, dict, dict]) -> None:
    """2 KV heads: one a rank; 1 KV head: copied on both. No native one-call step with two
    ranks, where a single process of the GGUF has one."""
    rank0, rank1, single = served
    assert [rank0["llama"]["kv_heads"], single["llama"]["kv_heads"]] == [1, 2]
    assert [rank1["one_kv_head"]["kv_heads"], single["one_kv_head"]["kv_heads"]] == [1, 1]
    # The draft model runs whole on every rank, and its drafts are verified: fewer steps.
    assert rank0["draft_model"]["kv_heads"] == 1 and rank0["draft_model"]["draft_kv_heads"] == 2
    assert rank0["draft_model"]["steps"] < rank0["llama"]["steps"]
    assert not any(results["native_step"] for results in (*rank0.values(), *rank1.values()))
    assert single["gguf_q8_0"]["native_step"] == bool(NATIVE)


def test_each_rank_holds_half_of_every_layers_experts(served: tuple[dict, dict, dict]) -> None:
    """Three of six experts a rank, in every sparse layer (Qwen3-MoE's middle one is dense;
    Qwen2-MoE's every second is sparse); bf16 experts and a GGUF's held as stored (where the
    native kernels run); the shared expert on the first rank only."""
    rank0, rank1, single = served
    stored = bool(NATIVE)
    for name, layers, as_stored in (
        ("qwen3_moe", 2, False),
        ("qwen2_moe", 1, stored),
        ("gguf_qwen3_moe_q8_0", 3, stored),
    ):
        shared = name == "qwen2_moe"
        assert rank0[name]["experts"] == [((0, 3), as_stored, shared)] * layers, name
        assert rank1[name]["experts"] == [((3, 3), as_stored, False)] * layers, name
        assert single[name]["experts"] == [((0, 6), as_stored, shared)] * layers, name


@pytest.mark.parametrize(
    ("overrides", "size", "message"),
    [
        ({}, 3, "attention heads (4) do not divide evenly over --tensor-parallel-size 3"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16},
            2,
            "KV heads (3) do not divide evenly over --tensor-parallel-size 2",
        ),
        (
            # (Rank 1's q heads 2 and 3 would group over both KV heads.)
            {"num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 162},
            3,
            "KV heads (2) are fewer than the ranks and do not divide --tensor-parallel-size 3",
        ),
        ({"intermediate_size": 161}, 2, "MLP intermediate features (161) do not divide"),
        (
            {"variant": "qwen3_moe", "num_attention_heads": 8, "intermediate_size": 168},
            4,
            "experts (6) do not divide evenly over --tensor-parallel-size 4",
        ),
    ],
    ids=["heads", "kv_heads", "kv_heads_fewer", "intermediate", "experts"],
)
def test_what_the_ranks_cannot_divide_is_refused_in_one_line(
    tiny_model_factory: Callable[..., Path], overrides: dict, size: int, message: str
) -> None:
    """Refused before any weight is read or any rank is waited for."""
    overrides = dict(overrides)
    model = tiny_model_factory(overrides.pop("variant", "qwen3"), **overrides)
    with pytest.raises(ConfigurationError) as refused:
        Engine(engine_config(str(model)), tp=TensorParallel(rank=0, size=size))
    assert "\n" not in str(refused.value)
    assert message in str(refused.value)
    assert str(refused.value).endswith("choose another --tensor-parallel-size")


@pytest.mark.skipif(not NATIVE, reason="GGUFs are held as stored with the native kernels")
def test_a_stored_weight_the_ranks_would_cut_mid_block_is_named() -> None:
    """The fixture's o projection has 256 input features in Q4_K blocks of 256: half a block
    each on two ranks."""
    model = FIXTURES / "tiny-llama-Q3_K_M.gguf"
    with pytest.raises(ConfigurationError) as refused:
        Engine(engine_config(str(model)), tp=TensorParallel(rank=1, size=2))
    assert str(refused.value) == (
        "model.layers.0.self_attn.o_proj.weight has 256 input features, stored in q4_k blocks: "
        "256 / --tensor-parallel-size 2 is not whole blocks; choose another "
        "--tensor-parallel-size"
    )
