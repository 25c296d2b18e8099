"""Baton vs peers: engine command lines, the ratio table, server process groups, their memory,
one real run."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

import baton
from baton.bench import compare
from baton.bench.compare_report import level_runs, print_tables
from baton.bench.peers import (
    PeakRssSampler,
    ServerCommand,
    ServerProcess,
    ServerStartError,
    baton_command,
    find_hf_to_gguf_converter,
    free_port,
    llama_server_command,
    process_tree,
    rss_bytes,
    vllm_command,
)
from baton.config_cli import add_config_args, config_from_args
from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.hardware import CpuCapabilities

# Keep the test engine's KV pool small: the default budget would zero-fill gigabytes.
SMALL_POOL = "--num-gpu-blocks-override 64 --max-model-len 1024"


def live_group_members(group: int) -> list[int]:
    """Non-zombie processes whose process group is `group` (Linux /proc), written here apart
    from the code under test."""
    members = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            members.append(int(stat_file.parent.name))
    return members


# --- command lines: pure functions ---------------------------------------------------------


def test_baton_command_is_understood_by_batons_own_parser() -> None:
    command = baton_command("/models/m", 8123, "float32", ["--disable-overlap"])
    assert command.argv[:3] == [sys.executable, "-m", "baton.launch"]
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    config = config_from_args(parser.parse_args(command.argv[3:]))
    assert (config.model, config.port, config.host) == ("/models/m", 8123, "127.0.0.1")
    assert (config.dtype, config.disable_overlap) == ("float32", True)
    assert command.env == {}


def test_vllm_command() -> None:
    command = vllm_command("/venv/bin/python", "/models/m", 9001)
    assert command.argv == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m",
        "--host", "127.0.0.1", "--port", "9001", "--dtype", "bfloat16", "--max-model-len", "4096",
    ]  # fmt: skip
    # The KV space is set; the OpenMP binding is left to vLLM's default.
    assert command.env == {"VLLM_CPU_KVCACHE_SPACE": "4"}


def test_llama_server_command_gives_each_slot_the_full_context() -> None:
    command = llama_server_command("/bin/llama-server", "/m.gguf", 9002, parallel=8, threads=3)
    argv = command.argv
    assert argv[0] == "/bin/llama-server"
    flags = dict(zip(argv[1::2], argv[2::2]))
    assert flags == {
        "--model": "/m.gguf", "--host": "127.0.0.1", "--port": "9002",
        "--ctx-size": str(4096 * 8), "--parallel": "8", "--threads": "3",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("levels", "slots"), [([], "16"), (["--concurrency-sweep", "1,32,4"], "32")]
)
def test_llama_cpp_gets_a_slot_per_request_of_the_highest_level(
    tmp_path: Path, levels: list[str], slots: str
) -> None:
    flags = ["--llama-server", "/bin/llama-server", "--gguf", "/m.gguf", *levels]
    args = compare.build_parser().parse_args(flags)
    command = compare.server_command("llama.cpp", args, "/models/m", 9003, tmp_path)
    assert dict(zip(command.argv[1::2], command.argv[2::2]))["--parallel"] == slots


def test_converter_found_in_the_llama_cpp_checkout(tmp_path: Path) -> None:
    server = tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.touch()
    assert find_hf_to_gguf_converter(server) is None
    script = tmp_path / "llama.cpp" / "convert_hf_to_gguf.py"
    script.touch()
    assert find_hf_to_gguf_converter(server) == script


# --- server processes ----------------------------------------------------------------------

# A healthy server whose grandchild ignores SIGTERM: stopping must still leave nothing behind.
# A server that answers /health on the port it is given (a stub's last lines).
HEALTH_SERVING = """
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
STUBBORN_SERVER = (
    """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
"""
    + HEALTH_SERVING
)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    port = free_port()
    command = ServerCommand("stub", [sys.executable, "-c", STUBBORN_SERVER, str(port)])
    server = ServerProcess(command, port, tmp_path / "stub.log")
    try:
        server.start(timeout_s=30)
        group = server.pid
        deadline = time.monotonic() + 10
        while len(live_group_members(group)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(live_group_members(group)) == 2
    finally:
        server.stop(grace_s=1.0)
    assert live_group_members(group) == []


def test_a_server_that_exits_reports_its_output(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('cannot load the model'); raise SystemExit(3)"]
    server = ServerProcess(ServerCommand("broken", argv), free_port(), tmp_path / "broken.log")
    with pytest.raises(ServerStartError, match="cannot load the model"), server:
        server.start(timeout_s=30)


# --- server memory -------------------------------------------------------------------------

MIB = 2**20
# A parent holding 100 MiB that starts a child holding 200 MiB, every page written, and prints
# both pids once both are resident.
MEMORY_TREE = """
import subprocess, sys, time
held = bytearray(b"\\x01") * (100 << 20)
child = subprocess.Popen([sys.executable, "-c",
    "import sys, time; held = bytearray(b'\\x01') * (200 << 20); print('ready', flush=True);"
    " time.sleep(60)"], stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_rss_sampler_sums_every_process_of_the_tree() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", MEMORY_TREE], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        child = int(parent.stdout.readline())  # both hold their memory from here on
        assert {parent.pid, child} <= set(process_tree(parent.pid))
        assert rss_bytes(child) >= 200 * MIB
        with PeakRssSampler(parent.pid, interval_s=0.05) as memory:
            pass
        assert memory.num_samples >= 2  # on start and on stop, however short the run
        # Neither process alone holds 300 MiB: the sum is over the tree.
        assert memory.peak_bytes >= 300 * MIB
        # One decimal: within half a tenth (327.25 MiB shows as 327.2, 0.05 off but for float's
        # last bits).
        assert memory.peak_mib == pytest.approx(memory.peak_bytes / MIB, abs=0.05 + 1e-9)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
    gone = PeakRssSampler(parent.pid)
    assert gone.sample() == 0 and gone.peak_mib is None


def test_report_carries_peak_rss_for_servers_only(capsys: pytest.CaptureFixture[str]) -> None:
    def result(throughput: float, peak_rss_mib: float | None = None) -> dict:
        figures = {"output_throughput": throughput, "mean_ttft_ms": 1.0, "mean_tpot_ms": 2.0}
        return figures if peak_rss_mib is None else {**figures, "peak_rss_mib": peak_rss_mib}

    records = {
        "baton": {"status": "ok", "results": [result(10.0, 300.0)], "peak_rss_mib": 300.0},
        "vllm": {"status": "ok", "results": [result(20.0, 1200.0)], "peak_rss_mib": 1200.0},
        "transformers": {"status": "ok", "results": [{"output_throughput": 5.0}]},
    }
    [run] = json.loads(json.dumps(level_runs([4], records)))  # as the JSON report holds it
    summary, ratios = run["summary"], run["ratios"]
    assert [summary[name]["peak_rss_mib"] for name in records] == [300.0, 1200.0, None]
    assert ratios["vllm"]["peak_rss_mib"] == 0.25
    assert ratios["transformers"]["peak_rss_mib"] is None
    print_tables([run])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "peak RSS MiB" in lines[1] and lines[1].split()[-1] == "RSS"  # ... "B/x RSS"
    assert lines[3].split() == [
        "vllm", "20.00", "1.00", "2.00", "1200.00", "0.50x", "1.00x", "1.00x", "0.25x",
    ]  # fmt: skip
    assert lines[4].split()[:9] == ["transformers", "5.00", "-", "-", "-", "2.00x", *"---"]
    assert "RSS: <1 Baton smaller" in lines[-1]
    # Without any memory figure (transformers alone) the table has no memory columns.
    print_tables(level_runs([4], {"transformers": records["transformers"]}))
    assert "RSS MiB" not in capsys.readouterr().out


# A healthy server holding 64 MiB, stopped by SIGTERM.
MEMORY_SERVER = (
    """
import http.server, sys
held = bytearray(b"\\x01") * (64 << 20)
"""
    + HEALTH_SERVING
)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_each_server_level_records_the_peak_rss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def stub_command(engine, args, model, port, work_dir) -> ServerCommand:
        return ServerCommand(engine, [sys.executable, "-c", MEMORY_SERVER, str(port)])

    async def stub_benchmark(args: argparse.Namespace) -> dict:
        return {"max_concurrency": args.max_concurrency, "output_throughput": 1.0}

    monkeypatch.setattr(compare, "server_command", stub_command)
    monkeypatch.setattr(compare, "run_benchmark", stub_benchmark)
    args = compare.build_parser().parse_args(["--concurrency-sweep", "1,2"])
    record = compare.run_server_engine("vllm", args, "/models/m", tmp_path)
    assert [result["max_concurrency"] for result in record["results"]] == [1, 2]
    peaks = [result["peak_rss_mib"] for result in record["results"]]
    assert min(peaks) >= 64 and record["peak_rss_mib"] == max(peaks)
    assert live_group_members(record["server_pid"]) == []


# --- compare end to end ---------------------------------------------------------------------


def test_absent_peers_are_skipped(tmp_path: Path, tiny_qwen2_dir: Path) -> None:
    flags = ["--model", str(tiny_qwen2_dir), "--engines", "vllm,llama.cpp"]
    report = compare.main([*flags, "--llama-server", str(tmp_path / "llama-server")])
    assert {name: record["status"] for name, record in report["engines"].items()} == {
        "vllm": "skipped",
        "llama.cpp": "skipped",
    }
    assert report["runs"] == [{"max_concurrency": 16, "summary": {}, "ratios": {}}]


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_compare_sweeps_baton_and_transformers(tmp_path: Path, tiny_qwen2_dir: Path) -> None:
    output, plots = tmp_path / "compare.json", tmp_path / "plots"
    workload = ["--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "16"]
    compare.main(
        [
            "--model", str(tiny_qwen2_dir),  # --dtype auto: each engine's own choice
            "--engines", "baton,transformers", "--baton-args", SMALL_POOL,
            *workload, "--concurrency-sweep", "2,4", "--disable-tqdm",
            "--output-json", str(output), "--plot", str(plots),
        ]
    )  # fmt: skip
    report = json.loads(output.read_text())
    baton, hf = report["engines"]["baton"], report["engines"]["transformers"]
    assert (baton["status"], hf["status"]) == ("ok", "ok")
    assert live_group_members(baton["server_pid"]) == []
    assert baton["peak_rss_mib"] > 0 and "peak_rss_mib" not in hf
    assert [result["max_concurrency"] for result in baton["results"]] == [2, 4]
    assert [result["seed"] for result in baton["results"]] == [0, 1]
    assert [result["details"]["batch_size"] for result in hf["results"]] == [2, 4]
    # The machine is named, and Baton's server reports the plan it chose on it: float32 for this
    # float32 checkpoint on every CPU, which transformers computes in too.
    caps = detect_cpu_capabilities()
    assert msgspec.convert(report["machine"]["cpu"], CpuCapabilities) == caps
    assert report["machine"]["copy_gb_per_s"] > 0
    for result in baton["results"]:
        assert msgspec.convert(result["server_info"]["cpu"], CpuCapabilities) == caps
        assert result["server_info"]["compute_plan"]["dtype"] == "float32"
    assert {result["details"]["dtype"] for result in hf["results"]} == {"float32"}
    assert [run["max_concurrency"] for run in report["runs"]] == [2, 4]
    for index, run in enumerate(report["runs"]):
        ours, theirs = baton["results"][index], hf["results"][index]
        assert (ours["completed"], ours["failed"]) == (8, 0)
        assert ours["total_output_tokens"] == 8 * 16
        assert theirs["output_tokens"] == 8 * 16
        assert run["summary"]["baton"]["mean_ttft_ms"] > 0
        assert run["summary"]["transformers"]["mean_ttft_ms"] is None
        assert 0 < run["summary"]["baton"]["peak_rss_mib"] == ours["peak_rss_mib"]
        assert run["summary"]["transformers"]["peak_rss_mib"] is None
        expected = ours["output_throughput"] / theirs["output_throughput"]
        assert run["ratios"]["transformers"]["output_throughput"] == pytest.approx(expected)
    png = (plots / "engines_vs_concurrency.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.parametrize(
    ("engine", "own", "seen"),
    [
        ("llama.cpp", {}, "None None"),
        ("baton", {}, "PASSIVE 1"),
        ("vllm", {"OMP_WAIT_POLICY": "X"}, "X None"),
    ],
)
def test_peers_start_without_batons_environment_defaults(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    engine: str,
    own: dict[str, str],
    seen: str,
) -> None:
    """Importing baton set OMP_WAIT_POLICY and THP_MEM_ALLOC_ENABLE (the user had not): a peer
    engine runs as it would beside no Baton, a Baton server with them; a peer command's own
    setting stays."""
    monkeypatch.setattr(baton, "DEFAULTED_ENVIRONMENT", frozenset(baton.ENVIRONMENT_DEFAULTS))
    for name, value in baton.ENVIRONMENT_DEFAULTS.items():
        monkeypatch.setenv(name, value)
    report = (
        "import os; print('policy', os.environ.get('OMP_WAIT_POLICY'),"
        " os.environ.get('THP_MEM_ALLOC_ENABLE')); raise SystemExit(3)"
    )
    argv = [sys.executable, "-c", report]
    server = ServerProcess(ServerCommand(engine, argv, own), free_port(), tmp_path / "env.log")
    with pytest.raises(ServerStartError, match=f"policy {seen}"), server:
        server.start(timeout_s=30)
