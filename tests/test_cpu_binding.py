"""CPU binding: the setting's grammar, auto's resolution, and the cores a launched server uses."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from helpers import free_port

from baton import launch
from baton.config import BatonConfig
from baton.cpu_binding import (
    NOBIND,
    bind_engine_thread,
    engine_cores,
    parse_cpu_list,
    rank_bindings,
    resolve_binding,
)
from baton.launch import Server, resolve_cpu_binding, scheduler_configs

linux_with_two_cores = pytest.mark.skipif(
    sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux thread affinity and two usable cores",
)


def test_cpu_lists_parse_like_taskset() -> None:
    assert parse_cpu_list("1,3-5") == (1, 3, 4, 5)
    assert parse_cpu_list(" 2 , 0 ") == (0, 2)
    for bad in ("", "a", "1-", "-2", "1,,2", "3-1x"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_the_config_rejects_a_bad_setting() -> None:
    assert BatonConfig(omp_threads_bind="0-1").omp_threads_bind == "0-1"
    with pytest.raises(ValueError, match="CPU list"):
        BatonConfig(omp_threads_bind="everything")


def test_auto_reserves_a_core_on_many_cores_only() -> None:
    assert resolve_binding("auto", {0, 1}) == NOBIND
    assert resolve_binding("auto", {0, 1, 2}) == NOBIND
    assert resolve_binding("auto", {4, 5, 6, 7}) == "5,6,7"
    assert resolve_binding("auto", {3}) == NOBIND
    assert resolve_binding("0-1", {0, 1}) == "0-1"  # explicit settings are kept
    assert resolve_binding(NOBIND, {0, 1}) == NOBIND


def test_tensor_parallel_ranks_each_get_their_own_cores() -> None:
    """vLLM's per-rank form (0-3|4-7), a plain list split evenly, and auto: every core shared
    out wherever there are as many as ranks (one reserved for the server from MANY_CORES), so
    two ranks on two cores never fight over both."""
    assert resolve_binding("auto", {0, 1}, ranks=2) == "0|1"
    assert resolve_binding("auto", {0}, ranks=2) == NOBIND
    assert resolve_binding("auto", set(range(8)), ranks=2) == "1,2,3,4|5,6,7"
    assert rank_bindings("0-3|4-7", 2) == ["0-3", "4-7"]
    assert rank_bindings("0-4", 2) == ["0,1,2", "3,4"]
    assert rank_bindings(NOBIND, 2) == [NOBIND, NOBIND]
    assert engine_cores("0,1|4-5") == (0, 1, 4, 5)  # the server's processes avoid them all
    with pytest.raises(ValueError, match="fewer cores than 3 ranks"):
        rank_bindings("0-1", 3)
    with pytest.raises(ValueError, match="3 CPU lists for 2 rank"):
        BatonConfig(omp_threads_bind="0|1|2", tensor_parallel_size=2)


def test_every_scheduler_process_gets_its_cores_or_its_share_of_the_threads() -> None:
    """Every rank of every data-parallel replica, in order; unbound ones share the threads."""
    cores = len(os.sched_getaffinity(0))
    unbound = BatonConfig(omp_threads_bind=NOBIND, tensor_parallel_size=2, data_parallel_size=2)
    configs = scheduler_configs(unbound)
    assert [(replica, rank) for replica, rank, _ in configs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [config.num_threads for *_, config in configs] == [max(1, cores // 4)] * 4
    bound = BatonConfig(omp_threads_bind="0|1", tensor_parallel_size=2)
    assert [(c.omp_threads_bind, c.num_threads) for *_, c in scheduler_configs(bound)] == [
        ("0", None),
        ("1", None),
    ]
    # Each replica's ranks meet at a port of their own.
    placed = BatonConfig(
        tensor_parallel_size=2, data_parallel_size=2, dist_init_addr="10.0.0.1:29500"
    )
    addresses = [config.dist_init_addr for *_, config in scheduler_configs(placed)]
    assert addresses == ["10.0.0.1:29500"] * 2 + ["10.0.0.1:29501"] * 2


def test_a_cpu_list_naming_unavailable_cores_is_refused() -> None:
    with pytest.raises(ValueError, match=r"CPUs \[5, 6\] are not available"):
        resolve_binding("1,5-6", {0, 1, 2})


def test_bad_settings_stop_the_launcher_with_a_message(tmp_path: Path) -> None:
    unavailable = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(SystemExit, match="not a CPU list"):
        launch.main(["--omp-threads-bind", "all"])
    assert (
        launch.main(
            [
                "--model",
                "baton-random",
                "--omp-threads-bind",
                str(unavailable),
                "--port",
                str(free_port()),
            ]
        )
        == 1
    )


def test_the_launcher_resolves_auto_for_this_machine(tiny_qwen2_dir: Path) -> None:
    config = BatonConfig(model=str(tiny_qwen2_dir))
    expected = resolve_binding("auto", os.sched_getaffinity(0))
    assert resolve_cpu_binding(config).omp_threads_bind == expected
    assert resolve_cpu_binding(config.replace(device="cuda")).omp_threads_bind == NOBIND
    assert resolve_cpu_binding(config.replace(omp_threads_bind="0")).omp_threads_bind == "0"


@linux_with_two_cores
def test_the_engine_thread_binds_itself_alone() -> None:
    before = os.sched_getaffinity(0)
    seen: dict[str, object] = {}

    def engine_thread() -> None:
        seen["threads"] = bind_engine_thread("1")
        seen["cores"] = os.sched_getaffinity(0)
        seen["unbound"] = bind_engine_thread(NOBIND)

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    assert seen == {"threads": 1, "cores": {1}, "unbound": 1}  # nobind leaves the mask as is
    assert os.sched_getaffinity(0) == before  # only the calling thread moved


def thread_affinities(pid: int) -> list[set[int]]:
    """The CPU affinity of every thread of process `pid`."""
    return [os.sched_getaffinity(int(task.name)) for task in Path(f"/proc/{pid}/task").iterdir()]


@linux_with_two_cores
def test_a_bound_server_keeps_every_other_thread_off_the_engines_core(
    tiny_qwen2_dir: Path,
) -> None:
    config = BatonConfig(
        model=str(tiny_qwen2_dir),
        dtype="float32",
        num_pages=64,
        omp_threads_bind="1",
        port=free_port(),
        log_level="warning",
    )
    others = os.sched_getaffinity(0) - {1}
    with Server(config) as server:
        for name, process in server.processes.items():
            affinities = thread_affinities(process.pid)
            if name == "scheduler":
                # The engine thread (and any OpenMP worker it started) on core 1, the rest off it.
                assert {1} in affinities
                assert all(cores in ({1}, others) for cores in affinities), affinities
            else:
                assert all(cores == others for cores in affinities), (name, affinities)
