"""What every child process of a server shares: arguments, logging, parent-death and readiness."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable

import msgspec
import zmq

from baton.addresses import ServerAddresses
from baton.checkpoint.model_config import CheckpointError
from baton.config import BatonConfig, ConfigurationError
from baton.cpu_binding import bind_service_process
from baton.distributed.errors import DistributedError
from baton.messages import Codec

logger = logging.getLogger(__name__)


# The launcher's messages with its children (msgspec, as every message of a server).
class ChildSpec(msgspec.Struct, kw_only=True):
    """What a child process is started with: written to its stdin, never on its argv, where every
    local user could read secrets such as the API key (`ps`)."""

    config: BatonConfig
    addresses: ServerAddresses
    # The launcher's pid: a child whose launcher died before it asked to die with it (while it
    # imported its modules: seconds, for the scheduler's torch) sees another parent, and exits.
    launcher_pid: int
    # A scheduler's data-parallel replica and tensor-parallel rank in it (0 for every other
    # process).
    replica: int = 0
    rank: int = 0


class ProcessReady(msgspec.Struct, tag="ready", kw_only=True):
    """A child process reports it is serving (or that it failed to start, with `error`)."""

    name: str
    error: str | None = None
    info: dict[str, str] = {}


LauncherMessage = ProcessReady


class StartError(RuntimeError):
    """A process could not start, for a reason its message says (its log has the details)."""


# Failures at start-up whose message says what is wrong: a configuration that cannot work, a
# port taken or an address that cannot be bound (OSError, zmq's), an unreadable checkpoint.
# Before the process serves they are logged and reported in one line, as a bad flag is; later,
# and for anything else, with their traceback.
ONE_LINE_START_ERRORS = (ConfigurationError, CheckpointError, StartError, OSError, zmq.ZMQError)

# The launcher's word to a serving frontend that another child died: the pipeline cannot finish
# any open request, so the frontend ends them all at once ("unavailable") and exits. A signal,
# as SIGTERM's drain is: the frontend has no socket the launcher writes to.
PIPELINE_LOST_SIGNAL = signal.SIGUSR1

_PR_SET_PDEATHSIG = 1
# The longest a child's loop waits on its sockets. A process-directed signal (the launcher's
# SIGTERM, or PR_SET_PDEATHSIG's when the launcher dies) may land on any thread: ZMQ's, OpenMP's,
# the engine's. Python runs the handler on the main thread only once it executes bytecode again,
# which an unbounded poll would prevent: the process would outlive its launcher, idle, forever.
IDLE_POLL_MS = 1000


def process_name(name: str, config: BatonConfig, replica: int = 0, rank: int = 0) -> str:
    """What the launcher and the logs call a process: a scheduler past the first by its place
    among every rank of every replica ("scheduler-3": replica 1's rank 1 of 2)."""
    index = replica * config.ranks_per_replica + rank
    return f"{name}-{index}" if index else name


def start_child(
    module: str, config: BatonConfig, addresses: ServerAddresses, replica: int = 0, rank: int = 0
) -> subprocess.Popen:
    """Start `module` (a process's `__main__`) for this server and hand it its spec on stdin
    (`replica`, `rank`: a scheduler's place among the data- and tensor-parallel ones)."""
    # A session of its own: a terminal's Ctrl-C reaches only the launcher, which stops the
    # children in order (the frontend drains first) rather than all of them at once.
    process = subprocess.Popen(
        [sys.executable, "-m", module], stdin=subprocess.PIPE, start_new_session=True
    )
    assert process.stdin is not None
    spec = ChildSpec(
        config=config, addresses=addresses, launcher_pid=os.getpid(), replica=replica, rank=rank
    )
    process.stdin.write(msgspec.json.encode(spec))
    process.stdin.close()
    return process


class ReadyReporter:
    """Tells the launcher this process is serving, or why it could not start."""

    def __init__(self, context: zmq.Context, name: str, launcher_address: str) -> None:
        self.name = name
        self.serving = False  # whether `ready` was sent
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.connect(launcher_address)
        self._codec = Codec(LauncherMessage)

    def ready(self, **info: str) -> None:
        self.serving = True
        self._socket.send(self._codec.encode(ProcessReady(name=self.name, info=info)))

    def failed(self, error: str) -> None:
        self._socket.send(self._codec.encode(ProcessReady(name=self.name, error=error)))

    def close(self) -> None:
        self._socket.close()


def run_child(name: str, serve: Callable[..., None], ranked: bool = False) -> None:
    """Read the launcher's ChildSpec from stdin, run `serve(config, addresses, context,
    reporter)` (and the spec's replica and rank after them, if `ranked`: a scheduler's) until it
    returns or the process is stopped, then exit the process (status 1 if `serve` raised). A
    scheduler past the first is named after its place among all of them (`process_name`).

    The process dies with its parent (PR_SET_PDEATHSIG), so a killed launcher leaves no orphans;
    SIGTERM and SIGINT end it quietly. A failure to start is reported to the launcher.
    """
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=ChildSpec)
    config, addresses = spec.config, spec.addresses
    name = process_name(name, config, spec.replica, spec.rank)
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
    )
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != spec.launcher_pid:
        # The launcher died before the line above took effect: no signal will come.
        os._exit(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    sys.unraisablehook = exit_outside_finalizers
    # Before ZMQ's I/O threads start, so they inherit the mask (threads imports started move).
    bind_service_process(config.omp_threads_bind)
    context = zmq.Context()
    # What a stopping process still has queued for its peers is not wanted: the server is
    # stopping, and a peer that died never takes it (by zmq's default, a socket with a message
    # for a dead peer would hold up the process's exit forever). Only a failure report waits,
    # under the reporter's own linger.
    context.setsockopt(zmq.LINGER, 0)
    reporter = ReadyReporter(context, name, addresses.launcher)
    exit_code = 0
    try:
        serve(config, addresses, context, reporter, *([spec.replica, spec.rank] if ranked else []))
    except SystemExit:
        pass
    except Exception as error:
        if isinstance(error, (ConfigurationError, DistributedError)) or (
            not reporter.serving and isinstance(error, ONE_LINE_START_ERRORS)
        ):
            logger.error("%s", error)
            reporter.failed(str(error))
        else:
            logger.exception("%s failed", name)
            reporter.failed(traceback.format_exc(limit=5))
        exit_code = 1
    # A second SIGTERM while tearing down must not interrupt it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if exit_code:
        deliver_failure_report(context)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's own teardown: everything of value is done, and a thread
    # or a zmq context left blocked by the signal must not keep the process alive.
    os._exit(exit_code)


def exit_outside_finalizers(unraisable: sys.UnraisableHookArgs) -> None:
    """The SIGTERM handler's SystemExit can land inside a finalizer (a zmq socket's `__del__`,
    say), where Python only prints it ("Exception ignored") and goes on: the exit is asked
    again from another thread, so it lands in ordinary code, with no traceback on stderr.
    Anything else unraisable is reported as usual."""
    if isinstance(unraisable.exc_value, SystemExit):
        threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return
    sys.__unraisablehook__(unraisable)


def deliver_failure_report(context: zmq.Context, timeout: float = 2.0) -> bool:
    """Close every socket, so that the failure report goes out under its reporter's linger
    (up to a second); True once done, False after `timeout` seconds.

    Only a failure report is worth waiting for: every other socket has linger 0, so its close
    drops what it still holds, and the process leaves without closing anything (os._exit).
    zmq's term can block forever after a signal interrupted a socket call, so it runs on a
    daemon thread waited for a bounded time: a stopping process must not wait it out."""
    closer = threading.Thread(target=context.destroy, daemon=True)
    closer.start()
    closer.join(timeout)
    return not closer.is_alive()
