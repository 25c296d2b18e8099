"""The float32 plan with bf16 GEMMs, which native-bf16 CPUs (AVX512_BF16, AMX) take on bf16
checkpoints: decode steps of a few rows read the stored weights in the native step, larger
batches cast their rows to bf16 for the GEMMs. Forced here on any AVX2 machine (where the CPU
has no bf16, torch emulates those GEMMs: slower, same results)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_greedy_matches_hf, hf_greedy_generate
from helpers.decode_steps import CountingStep

import baton.engine.cpu.startup_timing as startup_timing
import baton.engine.engine as engine_module
import baton.engine.speculation.setup as speculation_setup
from baton import LLM, SamplingParams
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.cpu.startup_timing import CROSSOVER_ROWS, compact_crossover
from baton.engine.decode_step import NATIVE_STEP_MAX_ROWS
from baton.engine.models.layers import Linear
from baton.engine.models.mlp import MLP_BLOCK_ROWS, GatedMLP
from baton.engine.native.formats import COMPACT_MAX_ROWS, CompactWeight
from baton.engine.native.library import load_native_kernels
from baton.engine.speculation.draft_budget import StepCost
from baton.hardware import ComputePlan, isa_rank

NATIVE_KERNELS = isa_rank(detect_cpu_capabilities().isa) >= isa_rank("avx2") and bool(
    shutil.which("cc")
)
needs_native = pytest.mark.skipif(
    not NATIVE_KERNELS, reason="the native kernels need an AVX2 CPU and a C compiler"
)

BF16_GEMMS = ComputePlan(
    dtype="float32",
    gemm_dtype="bfloat16",
    pack_weights=False,  # oneDNN packs bf16 only with AVX-512; packed or not, the same sums
    compact_small_batches=True,
    reason="forced by the test",
)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Rows rounded to bf16 move these models' logits by up to ~0.2 each (test_llm's tolerance).
BF16_TIE_TOLERANCE = 0.5


# The crossover the engines of most tests get, as if start-up had timed it (a timed one would
# depend on the machine's load): bf16 GEMMs win from 9 rows.
FIXED_CROSSOVER = 8


def fixed_crossover(rows: int) -> Callable[..., int]:
    def timed(run_step, model, largest: int) -> int:
        model.limit_compact_rows(rows)
        return rows

    return timed


@pytest.fixture
def timed_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine built in the test takes the plan a native-bf16 CPU would choose, and times
    its crossover on this machine."""
    monkeypatch.setattr(engine_module, "choose_compute_plan", lambda *args, **kw: BF16_GEMMS)


@pytest.fixture
def bf16_gemm_plan(timed_plan: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan, with FIXED_CROSSOVER for a crossover."""
    monkeypatch.setattr(engine_module, "compact_crossover", fixed_crossover(FIXED_CROSSOVER))


def test_a_linear_layer_casts_its_rows_to_the_gemm_dtype_and_adds_the_bias_in_float32() -> None:
    torch.manual_seed(0)
    linear = Linear(64, 48, True, torch.float32, "cpu", torch.bfloat16)
    weight, bias = torch.randn(48, 64), torch.randn(48)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    assert (linear.weight.dtype, linear.bias.dtype) == (torch.bfloat16, torch.float32)
    rows = torch.randn(40, 64)
    out = linear(rows)
    assert out.dtype == torch.float32
    want = F.linear(rows.bfloat16(), weight.bfloat16()).float() + bias
    torch.testing.assert_close(out, want)


@needs_native
@pytest.mark.parametrize("inter", [96, 1030])  # a vector tail; slices of 1024 and a tail
def test_the_bf16_activation_rounds_the_float32_one_once(inter: int) -> None:
    """silu(gate) * up from bf16 rows, computed in float32 and rounded once: torch's float32
    value rounded to bf16, up to one bf16 step where the two float32 values straddle a
    rounding boundary (the kernel's exp is within 2 ulp of torch's)."""
    native = load_native_kernels()
    gate_up = torch.randn(37, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    gate_up = gate_up.to(torch.bfloat16)
    got = native.silu_mul_bf16(gate_up)
    gate, up = gate_up.float().split(inter, dim=-1)
    want = (F.silu(gate) * up).to(torch.bfloat16)
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.999


@needs_native
def test_a_prefill_mlp_stays_bf16_between_its_gemms_block_by_block() -> None:
    """Past the compact rows, a bias-free MLP with bf16 GEMMs keeps its activation bf16 from
    the gate/up product to the down product, MLP_BLOCK_ROWS rows at a time: the values of the
    float32 path, which rounds that activation to bf16 for its down GEMM."""
    torch.manual_seed(3)
    mlp = GatedMLP(64, 96, False, torch.float32, "cpu", torch.bfloat16)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn(192, 64) / 8)
        mlp.down_proj.weight.copy_(torch.randn(64, 96) / 8)
    rows = torch.randn(MLP_BLOCK_ROWS + 77, 64)
    float32_path = mlp(rows)
    native = load_native_kernels()
    blocks: list[int] = []

    class CountingKernels:  # the activation of each bf16 block, counted
        def silu_mul_bf16(self, gate_up: torch.Tensor) -> torch.Tensor:
            blocks.append(gate_up.shape[0])
            return native.silu_mul_bf16(gate_up)

        def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # float32 rows
            return native.silu_mul(gate_up)

    mlp.native = CountingKernels()
    out = mlp(rows)
    assert blocks == [MLP_BLOCK_ROWS, 77] and out.dtype == torch.float32
    # One bf16 step of an activation (of ~1) moves an output by a weight's size (~0.1).
    torch.testing.assert_close(out, float32_path, rtol=0, atol=0.05)
    assert (out - float32_path).abs().mean() < 1e-3
    # A layer reading its compact weights at these rows keeps the float32 path.
    mlp.gate_up_proj.compact = CompactWeight.from_tensor(mlp.gate_up_proj.weight.detach())
    mlp.gate_up_proj.native = native
    mlp(rows[:8])
    mlp(rows[: COMPACT_MAX_ROWS + 1])
    assert blocks == [MLP_BLOCK_ROWS, 77, COMPACT_MAX_ROWS + 1]


@needs_native
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_native_steps_keep_the_tokens_of_the_same_plan_op_by_op(
    bf16_gemm_plan: None, tiny_model_factory: Callable[..., Path], variant: str
) -> None:
    """Up to the crossover decode batches run natively from the stored weights; a batch of more
    rows decodes through the bf16 GEMMs. Tokens are those of the same plan with
    `--enforce-eager`, whose op-by-op batches split the same way."""
    path = tiny_model_factory(variant, weights_dtype=torch.bfloat16)
    native = LLM(str(path))
    eager = LLM(str(path), enforce_eager=True)
    assert native.engine.dtype == torch.float32 and native.engine.plan.gemm_dtype == "bfloat16"
    layer = native.engine.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == torch.bfloat16 and layer.compact is not None
    assert layer.compact_max_rows == FIXED_CROSSOVER == eager.engine.model.compact_max_rows
    # The float32 LM head has no bf16 GEMM: it reads its compact weights up to the step's size.
    assert native.engine.model.lm_head.compact_max_rows == NATIVE_STEP_MAX_ROWS
    counting = native.engine.decode_step = CountingStep(native.engine.decode_step)
    for batch in (1, 5, FIXED_CROSSOVER, FIXED_CROSSOVER + 1):
        prompts = [[(7 * i + j) % 250 for j in range(3 + 5 * i)] for i in range(batch)]
        before = counting.batches
        got = [output.token_ids for output in native.generate(prompts, GREEDY)]
        want = [output.token_ids for output in eager.generate(prompts, GREEDY)]
        assert got == want, f"batch of {batch}"
        # Each step decodes every row at once (the prompts all prefill in the first batch).
        native_steps = 0 if batch > FIXED_CROSSOVER else GREEDY.max_tokens - 1
        assert counting.batches - before == native_steps


@needs_native
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["native", "eager"])
def test_start_up_times_the_crossover_on_this_machine(
    timed_plan: None, tiny_model_factory: Callable[..., Path], enforce_eager: bool
) -> None:
    """Whatever this machine's load makes of it, the engine serves with the crossover it timed
    (op by op too), and a loss at one row leaves no native step and no compact layer weights."""
    path = tiny_model_factory("llama", weights_dtype=torch.bfloat16)
    llm = LLM(str(path), enforce_eager=enforce_eager, max_running_requests=64)
    crossover = llm.engine.model.compact_max_rows
    assert crossover in (0, *CROSSOVER_ROWS)
    layer = llm.engine.model.layers[0].self_attn.qkv_proj
    assert layer.compact_max_rows == crossover and (layer.compact is None) == (crossover == 0)
    has_step = llm.engine.decode_step is not None
    assert has_step == (crossover > 0 and not enforce_eager)
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == GREEDY.max_tokens


@needs_native
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_are_transformers_float32_ones(
    bf16_gemm_plan: None, tiny_model_factory: Callable[..., Path], variant: str
) -> None:
    """Token for token where every batch reads the stored weights (a prompt of a few tokens);
    up to bf16's near-ties where a prefill's rows go through the bf16 GEMMs and attention (in
    chunks here: the first attends causally, the later ones past their prefix, masked)."""
    path = tiny_model_factory(variant, weights_dtype=torch.bfloat16)
    llm = LLM(str(path), chunk_size=40)
    assert llm.engine.attention.prefill_dtype == torch.bfloat16
    short, long = [5, 17, 3], [(11 * j) % 250 for j in range(90)]
    assert len(short) <= FIXED_CROSSOVER and len(long) > NATIVE_STEP_MAX_ROWS
    [output] = llm.generate([short], GREEDY)
    assert output.token_ids == hf_greedy_generate(path, short, GREEDY.max_tokens)
    [output] = llm.generate([long], GREEDY)
    assert_greedy_matches_hf(path, long, output.token_ids, BF16_TIE_TOLERANCE)


@needs_native
@pytest.mark.skipif(
    not detect_cpu_capabilities().can_pack("bfloat16"),
    reason="oneDNN packs bf16 weights only on AVX-512 CPUs",
)
def test_packed_bf16_weights_as_a_native_bf16_cpu_multiplies_them(
    bf16_gemm_plan: None, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan as AVX512_BF16 and AMX machines take it: bf16 weights packed for oneDNN, which
    prefill and batches past the crossover multiply (with a bias added after, in float32)."""
    packed = msgspec.structs.replace(BF16_GEMMS, pack_weights=True)
    monkeypatch.setattr(engine_module, "choose_compute_plan", lambda *args, **kw: packed)
    path = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    llm = LLM(str(path))
    assert llm.engine.model.layers[0].self_attn.qkv_proj.packed
    prompts = [[(5 * i + j) % 250 for j in range(20 + 7 * i)] for i in range(FIXED_CROSSOVER + 1)]
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert_greedy_matches_hf(path, prompt, output.token_ids, BF16_TIE_TOLERANCE)


@needs_native
def test_past_a_lower_crossover_decode_batches_leave_the_native_step_for_the_gemms(
    bf16_gemm_plan: None, tiny_model_factory: Callable[..., Path]
) -> None:
    """As on a machine whose bf16 GEMMs win from 5 rows: 4 rows run natively, 5 do not, and
    both keep the tokens of the op-by-op path limited alike."""
    path = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    native = LLM(str(path))
    eager = LLM(str(path), enforce_eager=True)
    for llm in (native, eager):
        llm.engine.model.limit_compact_rows(4)
    counting = native.engine.decode_step = CountingStep(native.engine.decode_step)
    for batch, native_steps in ((4, GREEDY.max_tokens - 1), (5, 0)):
        prompts = [[(3 * i + j) % 250 for j in range(4 + 6 * i)] for i in range(batch)]
        before = counting.batches
        got = [output.token_ids for output in native.generate(prompts, GREEDY)]
        assert got == [output.token_ids for output in eager.generate(prompts, GREEDY)]
        assert counting.batches - before == native_steps


@needs_native
def test_an_engine_whose_native_step_loses_at_one_row_decodes_op_by_op(
    bf16_gemm_plan: None, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "compact_crossover", fixed_crossover(0))
    llm = LLM(str(tiny_model_factory("llama", weights_dtype=torch.bfloat16)))
    assert llm.engine.decode_step is None
    # The layers' compact copies, which no batch reads now, are freed; the head keeps its own.
    layer = llm.engine.model.layers[0].self_attn.qkv_proj
    assert layer.compact is None and layer.compact_max_rows == 0
    assert llm.engine.model.lm_head.compact is not None
    assert len(llm.generate([[1, 2, 3]], GREEDY)[0].token_ids) == GREEDY.max_tokens


@needs_native
def test_speculation_drafts_past_a_low_crossover(
    bf16_gemm_plan: None, tiny_model_factory: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows past the crossover take the GEMMs start-up found faster: no cap on a batch's rows
    (the float32 plan's cap keeps batches in its native step)."""
    monkeypatch.setattr(engine_module, "compact_crossover", fixed_crossover(1))
    # Rows as cheap as the hardware's GEMMs make them (here torch emulates bf16: rows look dear,
    # and the draft budget would rightly decline every draft).
    cheap_rows = StepCost(fixed_s=1e-3, per_row_s=1e-6)
    monkeypatch.setattr(speculation_setup.StepCost, "measure", lambda *args: cheap_rows)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    path = tiny_model_factory("qwen2", weights_dtype=torch.bfloat16)
    llm = LLM(str(path), speculative_config=ngram)
    assert llm.engine.speculator.budget.max_rows is None
    # Long enough for the random model's greedy text to repeat itself, which ngram drafts from.
    long_enough = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7, 8] * 6, [9, 10, 11] * 8], long_enough)
    assert [len(output.token_ids) for output in outputs] == [40, 40]
    assert llm.scheduler.aggregate_stats().spec_decode_num_draft_tokens > 0


class FakeModel:
    """Records the compact-row limit a timed step would run under."""

    def __init__(self) -> None:
        self.compact_max_rows = NATIVE_STEP_MAX_ROWS

    def limit_compact_rows(self, rows: int) -> None:
        self.compact_max_rows = rows


class FakeEngine:
    def __init__(self) -> None:
        self.model = FakeModel()


def _no_step(rows: int) -> None:
    """The step timed: here `best_time` is faked, so the step itself never runs."""


@pytest.mark.parametrize(
    ("compact_wins_up_to", "crossover"), [(0, 0), (1, 1), (4, 4), (6, 4), (32, 32), (64, 32)]
)
def test_the_crossover_is_the_last_size_timed_at_which_the_stored_weights_won(
    monkeypatch: pytest.MonkeyPatch, compact_wins_up_to: int, crossover: int
) -> None:
    engine = FakeEngine()
    timed: list[tuple[int, str]] = []

    def best_time(run_rows, rows: int) -> float:
        path = "compact" if engine.model.compact_max_rows >= rows else "gemm"
        timed.append((rows, path))
        compact_wins = rows <= compact_wins_up_to
        return {"compact": 1.0, "gemm": 2.0 if compact_wins else 0.5}[path]

    monkeypatch.setattr(startup_timing, "best_time", best_time)
    assert compact_crossover(_no_step, engine.model, largest=32) == crossover
    assert engine.model.compact_max_rows == crossover
    # Sizes are timed smallest first, both ways, up to the first the GEMMs win.
    sizes = [rows for rows in CROSSOVER_ROWS if rows <= crossover]
    lost_at = [rows for rows in CROSSOVER_ROWS if rows > crossover][:1]
    assert timed == [(rows, path) for rows in sizes + lost_at for path in ("compact", "gemm")]


def test_out_of_start_up_time_the_sizes_timed_so_far_decide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large model's steps take seconds: a size whose time may not fit CROSSOVER_BUDGET_S (twice
    the last size's) is not timed."""
    engine, clock = FakeEngine(), [0.0]

    def best_time(run_rows, rows: int) -> float:
        clock[0] += startup_timing.CROSSOVER_BUDGET_S * 0.1 * rows  # a step's time grows with rows
        return 1.0 if engine.model.compact_max_rows >= rows else 2.0  # compact always wins

    monkeypatch.setattr(startup_timing, "best_time", best_time)
    monkeypatch.setattr(startup_timing.time, "perf_counter", lambda: clock[0])
    # 1 row: 0.2 budgets; 2 rows: 0.4 more (0.6 in all); 4 rows would take 0.8 more: not timed.
    assert compact_crossover(_no_step, engine.model, largest=32) == 2
    assert engine.model.compact_max_rows == 2


@pytest.mark.parametrize(
    ("gemm_over_compact", "crossover"), [(0.95, 32), (0.85, 0)], ids=["noise", "clear-win"]
)
def test_the_gemms_take_over_only_where_clearly_faster(
    monkeypatch: pytest.MonkeyPatch, gemm_over_compact: float, crossover: int
) -> None:
    engine = FakeEngine()

    def best_time(run_rows, rows: int) -> float:
        return 1.0 if engine.model.compact_max_rows >= rows else gemm_over_compact

    monkeypatch.setattr(startup_timing, "best_time", best_time)
    assert compact_crossover(_no_step, engine.model, largest=32) == crossover


def test_sizes_past_the_largest_batch_are_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With --max-num-seqs 5, no batch has more than 5 rows: won at 4, compact keeps them all."""
    engine, timed = FakeEngine(), []

    def best_time(run_rows, rows: int) -> float:
        timed.append(rows)
        return 1.0 if engine.model.compact_max_rows >= rows else 2.0

    monkeypatch.setattr(startup_timing, "best_time", best_time)
    assert compact_crossover(_no_step, engine.model, largest=5) == 5
    assert sorted(set(timed)) == [1, 2, 4]
