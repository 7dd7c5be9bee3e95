"""``kvstore serve`` end to end: a real server process, real HTTP, a restart in between.

Turn one of a chat (long system prompt) goes to a server on an empty cache directory; the
server is stopped (SIGTERM: its shutdown must flush the write-behind queue; SIGKILL: only
after the stats say the queue has flushed); a new server on the same directory answers
turn two from the disk tier (``cached_tokens`` > 0, ``hits_disk`` >= 1) with exactly the
reply a server on an empty directory gives.

mlx-lm's server has two generation paths: batched (``BatchGenerator``, which also inserts
system / user segment caches while prefilling) and single-request (``_serve_single``, one
insert at the end). ``_is_batchable`` sends a request down the single path when the server
runs with ``--kv-bits`` (or a draft model), or when the request carries a ``seed``; both
paths are run here.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.children import child_env
from tests.support.servers import Server, cached_tokens, reply, serve_command

# mode -> (server flags, extra request fields)
MODES = {
    "batched": ([], {}),
    # --kv-bits forces the single path; below --quantized-kv-start (default 5000) the cache
    # is still a plain KVCache, stored under the kv_bits=8 identity.
    "single-kv-bits": (["--kv-bits", "8", "--kv-group-size", "32"], {}),
    # a per-request seed forces the single path too, with the plain identity
    "single-seed": ([], {"seed": 0}),
}
CASES = [
    pytest.param("batched", signal.SIGTERM, id="batched-sigterm"),
    pytest.param("batched", signal.SIGKILL, id="batched-sigkill"),
    pytest.param("single-kv-bits", signal.SIGTERM, id="single-kv-bits-sigterm"),
    pytest.param("single-kv-bits", signal.SIGKILL, id="single-kv-bits-sigkill"),
    pytest.param("single-seed", signal.SIGTERM, id="single-seed-sigterm"),
]

_ADJ = ("patient", "careful", "curious", "precise", "cheerful", "laconic", "thorough", "modest")
_NOUN = ("librarian", "navigator", "gardener", "engineer", "cartographer", "archivist", "baker")
SYSTEM = " ".join(
    f"Rule {i}: answer like a {_ADJ[i % len(_ADJ)]} {_NOUN[i % len(_NOUN)]} and cite section {i * 7 % 31}."
    for i in range(16)
)  # ~1000 characters: ~1000 tokens for the byte-level tokenizer
USER1 = "Hello! Please summarise the rules above in one sentence."
USER2 = "Thanks. Now list the first three rules."


def turn1() -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER1}]


def turn2(answer: str) -> list[dict[str, str]]:
    return turn1() + [{"role": "assistant", "content": answer}, {"role": "user", "content": USER2}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


class Baselines:
    """Turn two on a server whose cache directory is empty, once per (mode, turn-one reply).

    ``start`` launches that server as soon as the turn-one reply is known, so it boots
    while the test stops and restarts its own server; ``get`` collects the response."""

    def __init__(self, model: Path, tmp: pytest.TempPathFactory) -> None:
        self.model, self.tmp = model, tmp
        self.servers: dict[tuple[str, str], Server] = {}
        self.results: dict[tuple[str, str], dict] = {}

    def start(self, mode: str, answer: str) -> None:
        key = (mode, answer)
        if key not in self.servers:
            d = self.tmp.mktemp(f"baseline-{mode}")
            self.servers[key] = Server(self.model, d / "cache", d / "server.log", MODES[mode][0])

    def get(self, mode: str, answer: str) -> dict:
        key = (mode, answer)
        if key not in self.results:
            self.start(mode, answer)
            with self.servers[key] as s:
                r = s.chat(turn2(answer), **MODES[mode][1])
                assert cached_tokens(r) == 0, r["usage"]
                assert s.stats()["hits_disk"] == 0
                assert s.stop(signal.SIGTERM) == 0, s.log()
            self.results[key] = r
        return self.results[key]

    def close(self) -> None:
        for s in self.servers.values():
            s.__exit__()


@pytest.fixture(scope="module")
def baselines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    b = Baselines(model_dir, tmp_path_factory)
    try:
        yield b
    finally:
        b.close()


def check_store(cache_dir: Path) -> dict:
    """Open the cache directory in this process: entries on disk, no problems found."""
    from kvstore import KVStore
    from kvstore.maintenance import verify

    with KVStore(cache_dir) as store:
        stats = store.stats()
        problems = verify(store.disk)
    assert stats["disk_entries"] >= 1, stats
    assert problems == [], [p.to_dict() for p in problems]
    return stats


def test_serve_help_lists_both_flag_sets() -> None:
    """``kvstore serve --help`` reaches the adapter: kvstore's flags, then mlx_lm.server's,
    exit status 0 (not the dispatcher's "unrecognized arguments")."""
    out = subprocess.run(serve_command() + ["--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--cache-dir" in out.stdout and "--max-disk-bytes" in out.stdout, out.stdout
    assert "mlx_lm.server flags" in out.stdout and "--kv-bits" in out.stdout, out.stdout
    ours = out.stdout[:out.stdout.index("mlx_lm.server flags")]
    assert "--model DIR|REPO" in ours and "required" in ours, ours  # the one flag a server cannot start without


def test_serve_help_imports_neither_mlx_lm_nor_transformers() -> None:
    """The help is read from mlx_lm.server's source, not by importing it (seconds of
    transformers): every flag of the imported parser is there all the same."""
    script = (
        "import contextlib, io, json, sys\n"
        "from kvstore.serve.server import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    main(['--help'])\n"
        "print(json.dumps({'text': out.getvalue(), 'loaded': sorted(m for m in ('mlx_lm', 'mlx_lm.server', "
        "'transformers') if m in sys.modules)}))\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=child_env())
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [], got["loaded"]
    import re

    import mlx_lm.server

    flags = re.findall(r"add_argument\(\s*[\"'](--[\w-]+)", Path(mlx_lm.server.__file__).read_text())
    theirs = got["text"].split("mlx_lm.server flags:")[1]
    assert len(flags) > 20 and all(f"\n  {flag}" in theirs for flag in flags), (flags, theirs)


@pytest.mark.parametrize("mode, stop", CASES)
def test_restart_reuses_disk_cache(model_dir: Path, tmp_path: Path, baselines: Baselines,
                                   mode: str, stop: int) -> None:
    flags, extra = MODES[mode]
    cache_dir = tmp_path / "cache"

    # -- first server: turn one, then stop it -------------------------------------------
    with Server(model_dir, cache_dir, tmp_path / "server1.log", flags) as s:
        r1 = s.chat(turn1(), **extra)
        assert cached_tokens(r1) == 0, r1["usage"]
        assert r1["usage"]["prompt_tokens"] > 800, r1["usage"]  # byte-level: ~1 token a char
        answer, ids1 = reply(r1)
        assert len(ids1) == r1["usage"]["completion_tokens"] > 0
        baselines.start(mode, answer)  # boots while this server stops and the next starts
        if stop == signal.SIGKILL:
            st = s.wait_flushed()
            assert st["disk_entries"] >= 1 and st["write_errors"] == 0 and st["dropped_writes"] == 0, st
            # which path ran: the batched one also stores the system / user segments
            if mode == "batched":
                assert st["writes"] >= 2, st
            else:
                assert st["writes"] == 1, st
        rc = s.stop(stop)
        log1 = s.log()
    if stop == signal.SIGTERM:
        assert rc == 0, f"SIGTERM exit status {rc}\n{log1}"
        assert "store flushed and closed" in log1, log1
    else:
        assert rc == -signal.SIGKILL, rc

    stored = check_store(cache_dir)

    # -- second server, same directory: turn two comes from disk -------------------------
    with Server(model_dir, cache_dir, tmp_path / "server2.log", flags) as s:
        r2 = s.chat(turn2(answer), **extra)
        st = s.stats()
        assert cached_tokens(r2) > 0, (r2["usage"], st)
        assert st["hits_disk"] >= 1 and st["restores"] >= 1 and st["corrupt"] == 0, st
        assert st["tokens_saved"] >= cached_tokens(r2), st
        rc = s.stop(signal.SIGTERM)
        assert rc == 0, f"SIGTERM exit status {rc}\n{s.log()}"
    after = check_store(cache_dir)
    assert after["disk_entries"] >= stored["disk_entries"], (stored, after)

    # -- same reply as a server that computed everything ---------------------------------
    b = baselines.get(mode, answer)
    assert r2["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert reply(r2) == reply(b), (reply(r2), reply(b))
    print(f"\n{mode}/{signal.Signals(stop).name}: turn1 prompt_tokens={r1['usage']['prompt_tokens']} "
          f"turn2 prompt_tokens={r2['usage']['prompt_tokens']} cached_tokens={cached_tokens(r2)} "
          f"hits_disk={st['hits_disk']} disk_entries={stored['disk_entries']} reply_ids={reply(r2)[1]}")


@pytest.mark.skipif(sys.platform != "linux", reason="the OpenBLAS preload is Linux-only (Metal on macOS)")
@pytest.mark.parametrize("opt_out", [False, True], ids=["default", "KVSTORE_NO_OPENBLAS"])
def test_serve_names_its_blas_once(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   opt_out: bool) -> None:
    """`kvstore serve` logs the BLAS it runs with once, at start. Where Debian's OpenBLAS is
    installed the server process (same pid, re-executed) has it mapped, unless
    KVSTORE_NO_OPENBLAS is set; where it is not, the line says how to install it."""
    from kvstore.blas import OPT_OUT, openblas_path
    from tests.support.servers import CLI_COMMAND

    if serve_command() != CLI_COMMAND:
        pytest.skip("the OpenBLAS preload belongs to the `kvstore` command's entry point")
    if opt_out:
        monkeypatch.setenv(OPT_OUT, "1")
    else:
        monkeypatch.delenv(OPT_OUT, raising=False)
    installed = openblas_path().exists()
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log") as s:
        mapped = str(openblas_path()) in Path(f"/proc/{s.proc.pid}/maps").read_text()
        assert s.stop(signal.SIGTERM) == 0, s.log()
        lines = [line for line in s.log().splitlines() if line.startswith("kvstore: BLAS:")]
    assert len(lines) == 1, s.log()
    assert mapped == (installed and not opt_out), (lines, installed)
    if mapped:
        assert "OpenBLAS" in lines[0] and OPT_OUT in lines[0]
    elif opt_out:
        assert "reference" in lines[0] and f"{OPT_OUT} is set" in lines[0]
    else:
        assert "apt-get install libopenblas0-pthread" in lines[0]


def test_sigusr1_prints_every_thread_and_the_server_goes_on(model_dir: Path, tmp_path: Path) -> None:
    """SIGUSR1 makes a running ``kvstore serve`` print each thread's Python stack to its log
    (how a server that stops answering is looked into), SIGUSR2 too (from inside the
    signal, for a stuck interpreter); it keeps serving, and SIGTERM still ends it cleanly.
    Sent right after a request (a request thread ending), several times: faulthandler's
    in-signal dump on SIGUSR1 crashed the server (SIGSEGV) about 1 time in 15 that way."""
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log") as s:
        for _ in range(10):
            assert s.get("/health")["status"] == "ok"
            s.proc.send_signal(signal.SIGUSR1)
        dump = s.stacks()
        assert s.proc.poll() is None, s.log()
        assert s.get("/health")["status"] == "ok"
        n = s.log(1 << 30).count("most recent call first")
        s.proc.send_signal(signal.SIGUSR2)
        time.sleep(1.0)
        assert s.log(1 << 30).count("most recent call first") > n, s.log()
        assert s.get("/health")["status"] == "ok"
        assert s.stop(signal.SIGTERM) == 0, s.log()
    assert dump.count("most recent call first") >= 2, dump  # the HTTP loop and the generation thread
    assert "serve_forever" in dump, dump


def test_seeded_first_request_samples_what_mlx_lm_server_samples(model_dir: Path, tmp_path: Path) -> None:
    """A seeded request (temperature 1: sampled, not greedy) is the first request of a
    fresh ``kvstore serve`` (empty cache directory) and of a second one on the now filled
    directory; both sample the tokens plain ``mlx_lm.server`` samples. mlx_lm.server seeds
    MLX's random key right before its cache lookup, and kvstore's first lookup derives the
    model's identity (building the model lazily): issue 22 found that draw changing the
    text. /health answers mlx_lm.server's body exactly; the start's details are in the stats."""
    body = {"seed": 7, "temperature": 1.0, "top_p": 1.0, "max_tokens": 24}
    messages = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
    upstream = Server(model_dir, None, tmp_path / "upstream.log")  # boots beside the first kvstore
    cache_dir = tmp_path / "cache"
    got = []
    for run in range(2):
        with Server(model_dir, cache_dir, tmp_path / f"kvstore{run}.log") as s:
            got.append(reply(s.chat(messages, **body)))
            health, stats = s.get("/health"), s.stats()
            assert health == {"status": "ok"}, health  # mlx_lm.server's body, nothing added
            assert stats["startup"]["ready"] and stats["startup"]["phase"] == "ready", stats
            assert s.stop(signal.SIGTERM) == 0, s.log()
    with upstream:
        assert upstream.get("/health") == {"status": "ok"}
        want = reply(upstream.chat(messages, **body))
        other = reply(upstream.chat(messages, **dict(body, seed=8)))
    assert other != want  # the seed decides the text: the comparison below can fail
    assert got[0] == want, (got[0], want)
    assert got[1] == want, (got[1], want)


def test_batched_segment_types_survive_a_restart_and_order_eviction(model_dir: Path, tmp_path: Path) -> None:
    """The batched path inserts the system prompt's cache as "system", the prompt's as
    "user" and the finished request as "assistant" (mlx-lm's segment types); all three
    types are on disk, come back after a restart (here: a preload in a new process), and
    eviction then follows mlx-lm's order: assistant, then user, then system. With the
    types lost, all would be "assistant" and the LRU order would evict the system prompt
    first (a preload files each entry as the least recently used)."""
    from kvstore import KVStore
    from kvstore.index import scan

    cache_dir = tmp_path / "cache"
    with Server(model_dir, cache_dir, tmp_path / "server.log") as s:
        r = s.chat(turn1())
        assert cached_tokens(r) == 0
        st = s.wait_flushed()
        assert st["writes"] >= 3, st
        assert s.stop(signal.SIGTERM) == 0, s.log()
    with KVStore(cache_dir) as store:
        entries = scan(store.disk.index, full=False).entries
        types = sorted(rec.cache_type for rec in entries.values() if rec is not None)
        assert types == ["assistant", "system", "user"], types
    with KVStore(cache_dir) as store:
        assert store.preload((str(model_dir), None, None)).entries == 3

        def held() -> tuple[int, int, int]:
            by_type = store.memory.stats_by_type()
            return tuple(by_type[t]["n_sequences"] for t in ("assistant", "user", "system"))  # type: ignore[return-value]

        assert held() == (1, 1, 1)
        store.trim_to(2)
        assert held() == (0, 1, 1)
        store.trim_to(1)
        assert held() == (0, 0, 1)
