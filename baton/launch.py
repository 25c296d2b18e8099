"""`baton launch`: start every server process, wait until each is ready, supervise them.

If any child dies, the frontend ends every open request at once ("unavailable"), the rest are
stopped and the launcher exits non-zero: no orphans (children also die with the launcher, via
PR_SET_PDEATHSIG). Ctrl-C / SIGTERM stop everything cleanly: the frontend drains its open
requests first (`--shutdown-timeout`); a second signal cuts them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType

import zmq

from baton.addresses import ServerAddresses
from baton.checkpoint.chat_template import read_chat_template
from baton.checkpoint.model_config import CheckpointError
from baton.checkpoint.source import load_model_config
from baton.child_process import (
    PIPELINE_LOST_SIGNAL,
    LauncherMessage,
    process_name,
    start_child,
)
from baton.config import BatonConfig
from baton.config_cli import add_config_args, config_from_args
from baton.cpu_binding import AUTO, NOBIND, rank_bindings, resolve_binding
from baton.distributed.stage_layers import stage_layers
from baton.generation_defaults import load_sampling_defaults
from baton.messages import Codec
from baton.process_messages import Shutdown
from baton.zmq_curve import CurveServerKeys

logger = logging.getLogger(__name__)

# Started in this order: the scheduler binds what the tokenizer and detokenizer connect to, but
# ZMQ reconnects, so order only matters for readability of logs.
PROCESS_MODULES = {
    "scheduler": "baton.scheduler_proc",
    "router": "baton.router_proc",  # with several data-parallel replicas only
    "detokenizer": "baton.detokenizer_proc",
    "tokenizer": "baton.tokenizer_proc",
    "frontend": "baton.frontend",
}


class ServerStartError(RuntimeError):
    """A child process failed to start or did not report ready in time."""


def resolve_cpu_binding(config: BatonConfig) -> BatonConfig:
    """`config` with `omp_threads_bind=auto` made concrete for this machine, once for every
    child (each binds itself from it; each scheduler process from its own share,
    `scheduler_configs`); ValueError for a CPU list naming cores this process may not use."""
    available = os.sched_getaffinity(0)
    ranks = config.engine_processes // config.nnodes  # this machine's
    if config.omp_threads_bind != AUTO:
        resolve_binding(config.omp_threads_bind, available, ranks)  # checks a CPU list's cores
        return config
    if config.device.partition(":")[0] != "cpu":
        return config.replace(omp_threads_bind=NOBIND)  # the engine's threads do no math
    setting = resolve_binding(AUTO, available, ranks)
    logger.info("engine CPU binding: %s (%d cores)", setting, len(available))
    return config.replace(omp_threads_bind=setting)


def scheduler_configs(config: BatonConfig) -> list[tuple[int, int, BatonConfig]]:
    """(replica, rank, config) of every scheduler process this machine runs (its node's ranks,
    `BatonConfig.node_ranks`): each with its own cores (and, unbound, its share of the threads:
    processes that each ran a thread per core would fight over every core), the ranks of a
    replica with their meeting place (`replica_address`)."""
    processes = config.engine_processes // config.nnodes
    threads = config.num_threads or max(1, len(os.sched_getaffinity(0)) // processes)
    bindings = iter(rank_bindings(config.omp_threads_bind, processes))
    configs = []
    for replica in range(config.data_parallel_size):
        address = replica_address(config, replica)
        for rank in config.node_ranks:
            binding = next(bindings)
            unbound = binding in (AUTO, NOBIND) and processes > 1
            rank_config = config.replace(
                omp_threads_bind=binding,
                num_threads=threads if unbound else config.num_threads,
                dist_init_addr=address,
            )
            configs.append((replica, rank, rank_config))
    return configs


def replica_address(config: BatonConfig, replica: int) -> str | None:
    """Where a replica's ranks meet: --dist-init-addr's port plus the replica, else a free
    local port (a single rank needs none)."""
    if config.ranks_per_replica == 1:
        return config.dist_init_addr
    if config.dist_init_addr is not None:
        host, _, port = config.dist_init_addr.rpartition(":")
        return f"{host}:{int(port) + replica}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


class Server:
    """A running server: its child processes and addresses. Use as a context manager."""

    def __init__(self, config: BatonConfig) -> None:
        self.config = config
        self.addresses = ServerAddresses.create(config.host, config.zmq_port)
        self.processes: dict[str, subprocess.Popen] = {}
        self.info: dict[str, str] = {}
        self.serving = False  # every child reported ready
        self._context = zmq.Context()
        self._ready = self._context.socket(zmq.PULL)
        self._ready.bind(self.addresses.launcher)
        self._codec = Codec(LauncherMessage)
        self._shutdown_codec = Codec(Shutdown)

    def start(self, timeout: float = 600.0, stopping: Callable[[], bool] = lambda: False) -> bool:
        """Start the children and wait for each to report ready (ServerStartError if one does
        not): True once all are, False if `stopping()` (a signal) came first."""
        for name, module in PROCESS_MODULES.items():
            if name == "scheduler":
                for replica, rank, rank_config in scheduler_configs(self.config):
                    self.processes[process_name(name, self.config, replica, rank)] = start_child(
                        module, rank_config, self.addresses, replica, rank
                    )
            elif self.config.node_rank > 0:
                continue  # a worker node runs its ranks only: node 0 serves
            elif name != "router" or self.config.data_parallel_size > 1:
                self.processes[name] = start_child(module, self.config, self.addresses)
        pending = set(self.processes)
        deadline = time.monotonic() + timeout
        while pending:
            if stopping():
                return False
            dead = self.dead_child()
            if dead is not None:
                ended = self.how_it_ended(dead)
                if self.processes[dead].returncode == -signal.SIGKILL:
                    # Nothing of Baton's sends it: at start-up, it is the kernel's OOM killer.
                    ended += " (most likely out of memory: the model and its KV pool do not fit)"
                raise ServerStartError(f"{dead} process {ended} during startup")
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"not ready after {timeout:.0f}s: {', '.join(sorted(pending))}"
                )
            if not self._ready.poll(200):
                continue
            report = self._codec.decode_or_none(self._ready.recv())
            if report is None:
                continue
            if report.error is not None:
                separator = "\n" if "\n" in report.error else " "  # a traceback, or one line
                raise ServerStartError(f"{report.name} failed to start:{separator}{report.error}")
            pending.discard(report.name)
            self.info.update(report.info)
        self.serving = True
        return True

    def cut_drain(self) -> None:
        """End the frontend's drain now: a second SIGTERM makes it cut its open requests."""
        frontend = self.processes.get("frontend")
        if frontend is not None and frontend.poll() is None:
            frontend.terminate()

    def dead_child(self) -> str | None:
        """The name of a child that has exited, if any."""
        for name, process in self.processes.items():
            if process.poll() is not None:
                return name
        return None

    def how_it_ended(self, name: str) -> str:
        """How the exited child `name` ended: "was killed by SIGKILL", "exited with status 1"."""
        status = self.processes[name].returncode
        if status < 0:
            try:
                return f"was killed by {signal.Signals(-status).name}"
            except ValueError:  # a real-time signal has no name
                return f"was killed by signal {-status}"
        return f"exited with status {status}"

    def stop(self, grace: float = 5.0, drain: bool = True) -> None:
        """Stop every child and clean up. The frontend goes first: with `drain` (SIGTERM) it
        lets its open requests finish (up to `shutdown_timeout`) while the pipeline still
        serves them; without (a child died), a serving frontend ends them at once
        (PIPELINE_LOST_SIGNAL). Then Shutdown to the scheduler and detokenizer (they leave
        their loops), SIGTERM to all, SIGKILL for any still alive after `grace` seconds."""
        frontend = self.processes.get("frontend")
        if frontend is not None and frontend.poll() is None and (drain or self.serving):
            frontend.send_signal(signal.SIGTERM if drain else PIPELINE_LOST_SIGNAL)
            try:
                frontend.wait(self.config.shutdown_timeout + grace if drain else grace)
            except subprocess.TimeoutExpired:
                logger.warning("the frontend did not end its open requests; stopping it")
        for address in (self.addresses.scheduler, self.addresses.detokenizer):
            with self._context.socket(zmq.PUSH) as shutdown:
                shutdown.setsockopt(zmq.LINGER, 200)
                shutdown.connect(address)
                shutdown.send(self._shutdown_codec.encode(Shutdown()), zmq.NOBLOCK)
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + grace
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._ready.close(linger=0)
        self._context.term()
        shutil.rmtree(self.addresses.directory, ignore_errors=True)

    def __enter__(self) -> Server:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run(config: BatonConfig) -> int:
    """Serve until a signal (exit 0) or a child's death (exit 1)."""
    try:
        # Refused here in one line rather than by every child with a traceback.
        model_config = load_model_config(config.model)
        model_config.served_context_length(config.max_model_len)
        stage_layers(model_config.num_layers, config.pipeline_parallel_size)
        load_sampling_defaults(config)
        CurveServerKeys.from_config(config)
        if config.chat_template is not None:
            read_chat_template(config.chat_template)
        if config.speculative_config is not None and config.speculative_config.model:
            try:
                load_model_config(config.speculative_config.model)
            except CheckpointError as error:
                raise CheckpointError(f"the draft model of --speculative-config: {error}") from None
        config = resolve_cpu_binding(config)
    except (CheckpointError, ValueError) as error:
        logger.error("%s", error)
        return 1
    stopping = False
    server = Server(config)

    def request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:  # a second signal: do not wait out the drain
            server.cut_drain()
        stopping = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(server, lambda: stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(server: Server, stopping: Callable[[], bool]) -> int:
    """Start `server`, then supervise it until `stopping()` or a child's death."""
    try:
        started = server.start(stopping=stopping)
    except ServerStartError as error:
        logger.error("%s", error)
        server.stop(drain=False)
        return 1
    if not started:  # a signal during start-up: nothing is served yet, nothing to drain
        server.stop(drain=False)
        return 0
    model = server.info.get("model", server.config.model or "built-in default")
    config = server.config
    if config.node_rank > 0:
        ranks = config.node_ranks
        print(
            f"Baton worker node {config.node_rank} of {config.nnodes} ready: ranks "
            f"{ranks.start}-{ranks.stop - 1} of {config.ranks_per_replica}, model {model}",
            flush=True,
        )
    else:
        print(
            f"Baton ready: model {model}\n"
            f"  HTTP (OpenAI-compatible): {server.info.get('http')}\n"
            f"  ZMQ requests: {server.addresses.requests}\n"
            f"  ZMQ replies:  {server.addresses.replies}",
            flush=True,
        )
    exit_code = 0
    while not stopping():
        dead = server.dead_child()
        if dead is not None:
            logger.error("%s process %s; stopping the server", dead, server.how_it_ended(dead))
            exit_code = 1
            break
        time.sleep(0.2)
    # With a child dead, the open requests cannot finish: they are cut, not drained.
    server.stop(drain=exit_code == 0)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m baton.launch`."""
    parser = argparse.ArgumentParser(prog="baton launch", description=__doc__)
    add_config_args(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s launch %(levelname)s %(message)s"
    )
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
