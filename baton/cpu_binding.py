"""Which cores the engine computes on, and which the rest of a server gets (CPU only).

vLLM's CPU backend binds its OpenMP threads and keeps a core for everything else
(VLLM_CPU_OMP_THREADS_BIND); Baton takes the same setting as `--omp-threads-bind`:

- a CPU list such as "1-3" or "1,3": the engine thread and its OpenMP team run there, every other
  thread of the server (HTTP, tokenizer, detokenizer, the scheduler loop) on the remaining cores;
- "nobind": no binding, the engine uses every core (the offline `LLM`'s choice: it has no other
  processes to make room for);
- "auto" (the server's default), resolved once by the launcher with `resolve_binding`.

Why bind: an OpenMP team stalls whenever one of its threads is descheduled, so the serving work
(about 0.2 ms of CPU per streamed token, client included) interrupts every step it shares a core
with. On 4+ cores one reserved core costs little compute. On 2 cores it costs half of it: since
the decode step became native kernels (docs/benchmarks.md, "CPU binding"), even the 12M-parameter
tiny shape serves 1.2-1.5x faster unbound at 1, 16 and 32 concurrent requests, and the 0.5B shape
126 tok/s unbound against 94 bound.
"""

from __future__ import annotations

import os

AUTO = "auto"
NOBIND = "nobind"
# With this many cores, one reserved core costs little compute whatever the model.
MANY_CORES = 4


def default_num_threads() -> int:
    """Every core this process may run on."""
    return len(os.sched_getaffinity(0))


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """ "1,3-5" -> (1, 3, 4, 5); ValueError when malformed or empty."""
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 1,3-5)")
        cores.update(range(int(first), int(last if dash else first) + 1))
    if not cores:
        raise ValueError(f"empty CPU list: {text!r}")
    return tuple(sorted(cores))


# Separates the tensor-parallel ranks' CPU lists in one setting (vLLM's form: 0-3|4-7).
RANK_SEPARATOR = "|"


def validate_setting(setting: str, ranks: int = 1) -> None:
    """ValueError unless `setting` is auto, nobind, a CPU list, or (with several tensor-parallel
    `ranks`) one CPU list per rank joined by |."""
    if setting in (AUTO, NOBIND):
        return
    lists = setting.split(RANK_SEPARATOR)
    if len(lists) > 1 and len(lists) != ranks:
        raise ValueError(
            f"--omp-threads-bind {setting}: {len(lists)} CPU lists for {ranks} rank(s)"
        )
    for cpu_list in lists:
        parse_cpu_list(cpu_list)


def rank_bindings(setting: str, ranks: int) -> list[str]:
    """Each tensor-parallel rank's own setting from a resolved server-wide one: its CPU list
    (a single list split into `ranks` contiguous parts), or nobind for every rank. ValueError
    when a list has fewer cores than ranks."""
    if setting in (AUTO, NOBIND):
        return [setting] * ranks
    lists = setting.split(RANK_SEPARATOR)
    if len(lists) == ranks:
        return lists
    cores = parse_cpu_list(setting)
    if len(cores) < ranks:
        raise ValueError(f"--omp-threads-bind {setting}: fewer cores than {ranks} ranks")
    per_rank, extra = divmod(len(cores), ranks)
    bindings, start = [], 0
    for rank in range(ranks):
        count = per_rank + (rank < extra)
        bindings.append(",".join(str(core) for core in cores[start : start + count]))
        start += count
    return bindings


def resolve_binding(setting: str, available: set[int], ranks: int = 1) -> str:
    """`setting` made concrete for a server of `ranks` tensor-parallel ranks on the `available`
    cores: NOBIND, a CPU list, or one list per rank joined by | (ValueError for a list naming a
    core outside `available`).

    auto reserves the lowest core for the serving processes when there are at least MANY_CORES
    cores; otherwise nothing is bound, but several ranks each get their own share of the cores
    whenever there are enough: unbound, their thread teams would fight over every core.
    """
    if setting != AUTO:
        unavailable = set(engine_cores(setting) or ()) - available
        if unavailable:
            raise ValueError(
                f"--omp-threads-bind {setting}: CPUs {sorted(unavailable)} are not available "
                f"(this process may use {sorted(available)})"
            )
        return setting
    cores = sorted(available)
    if len(cores) >= MANY_CORES and len(cores) - 1 >= ranks:
        cores = cores[1:]
    elif ranks == 1 or len(cores) < ranks:
        return NOBIND
    joined = ",".join(str(core) for core in cores)
    return RANK_SEPARATOR.join(rank_bindings(joined, ranks)) if ranks > 1 else joined


def engine_cores(setting: str) -> tuple[int, ...] | None:
    """The engine's cores under a resolved `setting` (every rank's, for per-rank lists); None
    when unbound (auto counts as nobind)."""
    if setting in (AUTO, NOBIND):
        return None
    cores: set[int] = set()
    for cpu_list in setting.split(RANK_SEPARATOR):
        cores.update(parse_cpu_list(cpu_list))
    return tuple(sorted(cores))


def bind_engine_thread(setting: str) -> int:
    """Bind the calling thread (the engine's; its OpenMP team inherits) to its cores; returns
    how many threads the engine should run: its cores, or every usable core when unbound."""
    cores = engine_cores(setting)
    if cores is None:
        return default_num_threads()
    try:
        os.sched_setaffinity(0, cores)  # pid 0: this thread only
    except OSError as error:
        raise ValueError(f"cannot bind the engine to CPUs {list(cores)}: {error}") from error
    return len(cores)


def bind_service_process(setting: str) -> None:
    """Move every thread of this process off the engine's cores; threads started later inherit
    the mask. Every server process calls it at start, the scheduler's before its engine thread
    exists (which then binds itself to the engine's cores)."""
    cores = engine_cores(setting)
    if cores is None:
        return
    remaining = os.sched_getaffinity(0) - set(cores)
    if not remaining:
        return
    # Imports may already have started threads (OpenMP, tokenizers): move each one (Linux /proc).
    for thread_id in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread_id), remaining)
