"""The benchmark suite runs (``python -m benchmarks --quick``) and writes what it promises.

One subprocess run of the whole quick suite (a tiny model, small sizes); this is what keeps
the benchmarks from rotting. It checks every JSON file exists with the keys the README and
the chart read, and that the chart and summary were drawn. The run has no time limit (a busy
laptop is slow, not broken): only a hang ends it, and its process group (the servers it
started included) and its scratch and output directories end with it.
"""

from __future__ import annotations

import json
import shutil
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tools.testing.procs import end_group, run_watched

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("ttft", "bandwidth", "agent_loop", "overhead", "scale", "shared", "server", "serve", "long_entry")
TOP_KEYS = {"benchmark", "schema", "quick", "machine", "settings", "raw", "medians", "headline", "notes", "seconds"}
MACHINE_KEYS = {"cpu", "cores", "ram_bytes", "os", "blas", "versions", "loadavg"}


@pytest.fixture(scope="module")
def quick_run():
    base = Path(tempfile.mkdtemp(prefix="kvstore-test-bench-"))
    out, work = base / "out", base / "work"
    work.mkdir()
    (base / "tmp").mkdir()
    env = dict(os.environ, KVSTORE_NO_OPENBLAS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TMPDIR=str(base / "tmp"))
    try:
        # --no-drop: a test run must not empty the machine's page cache (the benchmarks do, as root)
        code = run_watched([sys.executable, "-m", "benchmarks", "--quick", "--no-drop", "--out", str(out),
                            "--work-dir", str(work)], base / "log", cwd=ROOT, env=env)
        stdout = (base / "log").read_text(errors="replace")
        assert code == 0, stdout[-6000:]
        yield out, stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_every_benchmark_writes_json(quick_run):
    out, _ = quick_run
    for name in NAMES:
        doc = json.loads((out / f"{name}.json").read_text())
        assert TOP_KEYS <= set(doc), (name, TOP_KEYS - set(doc))
        assert doc["benchmark"] == name and doc["quick"] is True
        assert MACHINE_KEYS <= set(doc["machine"]), name
        assert {"mlx", "mlx_lm", "kvstore"} <= set(doc["machine"]["versions"])
        assert doc["raw"] and doc["medians"] and doc["headline"], name


def test_expected_medians(quick_run):
    out, _ = quick_run
    load = lambda n: json.loads((out / f"{n}.json").read_text())  # noqa: E731
    ttft = load("ttft")
    for row in ttft["raw"]:
        m = row["medians"]
        assert m["cold_ttft"] > 0 and m["memory_ttft"] > 0 and m["disk_ttft"] > 0
        assert m["all_disk_hits_from_disk"], row["disk_hits"]
        assert row["disk_hits"][0]["page_cache"] == {"dropped": False, "method": "disabled"}
    for m in load("bandwidth")["medians"].values():
        for state in ("cold", "warm"):
            for method in ("kvstore", "raw", "mlx_lm"):
                assert m[f"{state}_{method}_gbps"] > 0
        assert m["all_reads_ok"]
        assert m["write_kvstore_gbps"] > 0 and m["write_mlx_lm_gbps"] > 0
        assert m["running_kvstore_gbps"] > 0 and m["kvstore_open_s"] > 0
        if shutil.which("strace"):  # sync calls per persisted entry: one pack, its directory, one commit
            assert 0 < m["syncs_per_entry"] <= 6, m["syncs_per_entry"]
    agent = load("agent_loop")["medians"]
    assert agent["storage"]["write_amp_median_turns_2_20"] > 0
    assert agent["storage"]["restart_turn_source"] == "disk"
    assert agent["storage"]["footprint_vs_whole_snapshot"] < 1
    assert agent["ttft"]["ttft_median_turns_2_20_s"] > 0
    written = {k: p["bytes_written_session"] for k, p in agent["policy"].items()}
    assert 0 < written["system"] < written["reused"] < written["all"], written  # what each policy keeps off disk
    for m in load("overhead")["medians"].values():
        assert m["insert_s"] > 0 and m["prefill_s"] > 0 and m["memory_fetch_exact_s"] > 0
    scale = load("scale")["medians"]
    assert scale["dropped_writes"] == 0
    assert scale["persisted_per_s"] > 0 and scale["lookup_present_p50_s"] > 0 and scale["open_warm_s"] > 0
    assert scale["gc_s"] > 0
    for m in load("server")["medians"].values():  # real `kvstore serve` processes
        assert m["memory_ttft"] > 0 and m["restart_ttft"] > 0 and m["preload_ttft"] > 0
        assert m["sources"] == {"memory": ["memory"], "preload": ["memory"], "restart": ["disk"],
                                "restart_no_warmup": ["disk"]}, m["sources"]
        assert m["cached_tokens"]["preload"] > 1000 and m["preloaded_entries"] == [1, 1]
        assert m["preload_seconds_in_server"] > 0 and m["warmup_seconds_in_server"] > 0
    serve = load("serve")["medians"]  # kvstore serve vs mlx_lm.server, same run
    for scenario in ("unique", "shared"):
        for per in serve[scenario].values():
            assert per["mlx_lm"]["tokens_per_s"] > 0 and per["kvstore"]["tokens_per_s"] > 0
    assert all(per["kvstore"]["cached_tokens"] > 0 for per in serve["shared"].values())  # from disk
    assert all(v["insert_ms"] > 0 for v in serve["thread"].values())
    long_entry = load("long_entry")["medians"]["warm"]  # each way's entry restored (sources checked by the run)
    assert set(long_entry) == {"one_insert", "many_turns", "import", "shared", "mlx_lm"}
    for cells in long_entry.values():
        for c in cells.values():  # every KV byte came through a read call (file or socket), counted
            assert c["seconds"] > 0 and c["read_vs_kv"] >= 1 and c["faults_vs_kv_pages"] > 0.5 and c["linearity"] > 0


def test_chart_and_summary(quick_run):
    out, stdout = quick_run
    assert (out / "chart.png").stat().st_size > 10_000
    summary = (out / "summary.md").read_text()
    assert "Headline numbers" in summary and "ttft" in summary and "scale" in summary and "server" in summary
    run = json.loads((out / "run.json").read_text())
    assert run["failed"] == [] and set(run["seconds"]) == set(NAMES)


def test_the_quick_run_left_nothing(quick_run):
    """The whole quick suite ran with TMPDIR pointed into the fixture's directory: every temp
    directory it or its children made (stores, kvstore-thread-*) was removed by the run."""
    out, _ = quick_run
    assert leftovers(out.parent / "tmp") == []


def leftovers(tmp: Path) -> list[str]:
    """What is left in a run's TMPDIR but MLX's own compiled-kernel cache (``mlx``: shared by
    every MLX process of the machine, kept on purpose)."""
    return sorted(p.name for p in tmp.iterdir() if p.name != "mlx")


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_runner_leaves_no_server_and_no_temp_dir(tmp_path, sig):
    """The runner is stopped (SIGTERM, as a timeout or a CI cancel does; SIGKILL, as an OOM
    killer does) while both servers of ``serve`` are up: neither server outlives it, and after
    SIGTERM it removed its scratch directory and every temp directory itself."""
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    env = dict(os.environ, KVSTORE_NO_OPENBLAS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TMPDIR=str(tmp))
    log = open(tmp_path / "log", "wb")
    runner = subprocess.Popen([sys.executable, "-m", "benchmarks", "--quick", "--no-drop", "--only", "serve",
                               "--no-chart", "--out", str(tmp_path / "out"), "--work-dir", str(work)],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    seen: list[psutil.Process] = []
    try:
        # both servers answered a burst: the first "unique" row is in the log (bounds a hang only)
        deadline = time.monotonic() + 1800
        while b"unique N=1" not in (tmp_path / "log").read_bytes():
            assert runner.poll() is None, (tmp_path / "log").read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "no server answered in 30 min"
            time.sleep(0.5)
        seen = _descendants(runner.pid)
        servers = [p for p in seen if "serve" in " ".join(p.cmdline()) or "mlx_lm.server" in p.cmdline()]
        assert len(servers) >= 2, [p.cmdline() for p in seen]
        os.kill(runner.pid, sig)  # the runner alone, not its group
        runner.wait(600)
        psutil.wait_procs(seen, timeout=120)
        assert [p.pid for p in _alive(seen)] == [], "outlived the runner"
        if sig == signal.SIGTERM:
            assert runner.returncode == 128 + signal.SIGTERM
            assert list(work.iterdir()) == [] and leftovers(tmp) == []
    finally:
        end_group(runner)
        log.close()
        for p in _alive(seen):  # never leave one behind, even when the assertion above failed
            p.kill()
