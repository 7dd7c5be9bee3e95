"""Server warm start: TTFT of the first chat request after ``kvstore serve`` restarts.

A real ``kvstore serve`` subprocess per row (each start a fresh process), chat completions
streamed over HTTP, TTFT = time from sending the request to the first content chunk. The
system prompt (~8,192 tokens of text; the tiny model's 1,024 in --quick) is prefilled once
with ``kvstore warm --system-file`` and pinned with ``kvstore pin``; every request asks a
different ~32-token question under it.

1. memory hit: a server that never stopped; its first request restores the system prompt
   from disk, then further questions are timed (the prefix comes from memory);
2. restart, no preload: page cache dropped (sync; drop_caches as root), a new server
   started; TTFT of the first request after ``GET /health`` says ready (a disk restore
   inside the request). Run twice: with the warm-up pass (the default) and with
   ``--no-warmup`` (what a restart cost before warm start existed);
3. restart with ``--preload pinned``: page cache dropped, TTFT of the first request after
   ready (the system prompt is in memory before it arrives); plus the start-up time the
   preload adds (ready time with it minus ready time of row 2).

Ready time: from ``Popen`` to the first 200 from ``GET /health``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import common as C

NAME = "server"
QUESTION = 32
MAX_TOKENS = 8
DEFAULT = [("smollm2", 8192), ("bench-qwen3-0.6b", 8192)]
QUICK = [("tiny-llama", 1024)]
MEMORY_HITS = 3
RESTARTS = 2  # runs of the restart rows (each a fresh process after a page-cache drop)
HOST = "127.0.0.1"


# ----------------------------------------------------------------------------- a server process


class Serve:
    """One ``kvstore serve`` subprocess on a free port; ``ready_s`` is Popen -> /health 200."""

    def __init__(self, model: Path, cache_dir: Path, log: Path, flags: list[str]) -> None:
        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.log_path = log
        self._log = open(log, "wb")
        cmd = [sys.executable, "-m", "kvstore.cli", "serve", "--model", str(model), "--cache-dir", str(cache_dir),
               "--host", HOST, "--port", str(self.port), "--max-tokens", str(MAX_TOKENS), *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.t0 = time.perf_counter()
        self.proc = C.spawn(cmd, self._log, env=env)
        try:
            self.ready_s = self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float = 1800) -> float:  # a hang, not a slow start on a busy machine
        while time.perf_counter() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.get("/health")[0] == 200:
                    return time.perf_counter() - self.t0
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"kvstore serve not ready after {timeout} s:\n{self.log()}")

    def get(self, path: str) -> tuple[int, Any]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=30)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            conn.close()

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        code = C.terminate(self.proc)
        self._log.close()
        return code


def chat(server: Serve, system: str, question: str) -> dict[str, Any]:
    """One streamed chat completion: TTFT (first content chunk), total time, usage, and
    which tier the store served it from (the stats' hit counters before and after)."""
    before = server.get("/v1/cache/stats")[1]
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(HOST, server.port, timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    ttft, usage, text = None, None, ""
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
        piece = delta.get("content") or delta.get("reasoning") or ""
        if piece and ttft is None:
            ttft = time.perf_counter() - t0
        text += piece
        usage = chunk.get("usage") or usage
    total = time.perf_counter() - t0
    conn.close()
    after = server.get("/v1/cache/stats")[1]
    source = ("memory" if after["hits_memory"] > before["hits_memory"] else
              "disk" if after["hits_disk"] > before["hits_disk"] else "miss")
    return {"ttft": ttft if ttft is not None else total, "total_s": total, "source": source,
            "cached_tokens": (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens"),
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "text": text, "loadavg1": C.loadavg1()}


# ----------------------------------------------------------------------------- the prompt


def prompts(model_dir: Path, system_tokens: int, n_questions: int) -> tuple[str, list[str]]:
    """A system prompt of about ``system_tokens`` tokens of text, and questions of about
    ``QUESTION`` tokens that start differently."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model_dir)
    system = tok.decode(C.text_tokens(tok, system_tokens, seed=system_tokens))
    questions = [tok.decode(C.question_tokens(tok, QUESTION, k)).strip() for k in range(n_questions)]
    return system, questions


def kvstore_cli(*args: Any, timeout: float = 1800) -> str:
    proc = subprocess.run([sys.executable, "-m", "kvstore.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=C.REPO_ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"kvstore {args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return proc.stdout


def warm_and_pin(model_dir: Path, cache_dir: Path, system_file: Path) -> dict[str, Any]:
    """``kvstore warm --system-file`` then ``kvstore pin`` the entry it printed."""
    t0 = time.perf_counter()
    out = kvstore_cli("warm", "--model", model_dir, "--system-file", system_file, "--cache-dir", cache_dir)
    warm_s = time.perf_counter() - t0
    m = re.search(r"(?:warmed|already warm:) (\d+) tokens.*entry ([0-9a-f]+)", out.replace(",", ""))
    if m is None:
        raise RuntimeError(f"cannot read the entry from kvstore warm's output: {out!r}")
    kvstore_cli("pin", m.group(2), "--cache-dir", cache_dir)
    return {"warm_s": warm_s, "system_tokens": int(m.group(1)), "entry": m.group(2)}


# ----------------------------------------------------------------------------- rows


def started(ctx: C.Context, model_dir: Path, cache_dir: Path, tag: str, flags: list[str],
            drop: bool) -> tuple[Serve, dict[str, Any]]:
    """A fresh server (the page cache dropped first when ``drop``) and how it started."""
    page_cache = C.drop_page_cache([cache_dir, model_dir], enabled=drop and ctx.drop)
    server = Serve(model_dir, cache_dir, ctx.work / f"serve-{tag}.log", flags)
    health = server.get("/v1/cache/stats")[1]["startup"]  # the start's timings (/health is mlx-lm's body)
    return server, {"flags": flags, "ready_s": server.ready_s, "page_cache": page_cache, "health": health}


def row_memory(ctx: C.Context, model_dir: Path, cache_dir: Path, system: str, qs: list[str]) -> dict[str, Any]:
    """Row 1: a server that never stopped; the first request (from disk) is not timed as a
    memory hit, the next ``MEMORY_HITS`` questions are."""
    server, info = started(ctx, model_dir, cache_dir, f"{model_dir.name}-memory", [], drop=False)
    try:
        first = chat(server, system, qs[0])
        hits = [chat(server, system, q) for q in qs[1: 1 + MEMORY_HITS]]
    finally:
        info["exit"] = server.stop()
    return {**info, "first_request": first, "requests": hits}


def row_restart(ctx: C.Context, model_dir: Path, cache_dir: Path, system: str, q: str, tag: str,
                flags: list[str]) -> dict[str, Any]:
    """Rows 2 and 3: page cache dropped, a new server, its first request after ready."""
    server, info = started(ctx, model_dir, cache_dir, tag, flags, drop=True)
    try:
        stats = server.get("/v1/cache/stats")[1]
        info["memory_entries_at_ready"] = stats["memory_entries"]
        info["request"] = chat(server, system, q)
    finally:
        info["exit"] = server.stop()
    return info


def prepare(ctx: C.Context, name: str, system_tokens: int) -> dict[str, Any]:
    """The model's system prompt and questions, and its store: ``kvstore warm`` + ``pin``."""
    from tools.testing.model_builds import model_path

    model_dir = model_path(name)
    d = ctx.scratch(f"server-{name}")
    system, qs = prompts(model_dir, system_tokens, 2 * RESTARTS + 2 + MEMORY_HITS)
    (d / "system.txt").write_text(system)
    warm = warm_and_pin(model_dir, d / "cache", d / "system.txt")
    ctx.log(f"  {name}: {warm['system_tokens']} tokens warmed in {warm['warm_s']:.1f} s")
    return {"name": name, "model_dir": model_dir, "cache_dir": d / "cache", "system": system, "qs": qs, "warm": warm}


def run_model(ctx: C.Context, prep: dict[str, Any]) -> dict[str, Any]:
    """All rows for one model, the preload row first: the first processes of a run meet
    memory the VM host has not backed yet, which makes them slower, never faster."""
    name, model_dir, cache_dir, system = prep["name"], prep["model_dir"], prep["cache_dir"], prep["system"]
    q = iter(prep["qs"])
    rows: dict[str, Any] = {}
    for tag, flags, runs in (("preload", ["--preload", "pinned"], RESTARTS), ("restart", [], RESTARTS),
                             ("restart_no_warmup", ["--no-warmup"], 1)):
        ctx.log(f"  {name} {tag}: {runs} x (page cache dropped, kvstore serve {' '.join(flags)}, first request) ...")
        rows[tag] = [row_restart(ctx, model_dir, cache_dir, system, next(q), f"{name}-{tag}-{i}", flags)
                     for i in range(runs)]
    ctx.log(f"  {name} memory: a server that never stops, a first request, then memory hits ...")
    rows["memory"] = row_memory(ctx, model_dir, cache_dir, system, [next(q) for _ in range(1 + MEMORY_HITS)])
    row = {"model": name, "system_tokens": prep["warm"]["system_tokens"], "question_tokens": QUESTION,
           "warm": prep["warm"], **rows}
    row["medians"] = medians(row)
    m = row["medians"]
    ctx.log(f"    memory hit {C.fmt(m['memory_ttft'], 's')}, restart {C.fmt(m['restart_ttft'], 's')} "
            f"(no warm-up {C.fmt(m['restart_no_warmup_ttft'], 's')}), --preload pinned {C.fmt(m['preload_ttft'], 's')} "
            f"= {C.fmt(m['preload_vs_memory'], 'x')} of a memory hit; preload adds {C.fmt(m['preload_startup_s'], 's')}")
    return row


def medians(row: dict[str, Any]) -> dict[str, Any]:
    restarts = ("preload", "restart", "restart_no_warmup")
    med = {k: C.median([r["request"]["ttft"] for r in row[k]]) for k in restarts}
    ready = {k: C.median([r["ready_s"] for r in row[k]]) for k in restarts}
    m: dict[str, Any] = {
        "memory_ttft": C.median([r["ttft"] for r in row["memory"]["requests"]]),
        "memory_first_request_ttft": row["memory"]["first_request"]["ttft"],
        **{f"{k}_ttft": v for k, v in med.items()},
        **{f"ready_{k}_s": v for k, v in ready.items()},
        "preload_seconds_in_server": C.median([r["health"]["preload"]["preload_seconds"] for r in row["preload"]]),
        "warmup_seconds_in_server": C.median([r["health"]["warmup_seconds"] for r in row["restart"]]),
        # the model's identity, derived at start with the loaded model (page cache dropped before the start)
        "identity_seconds_in_server": C.median([r["health"].get("identity_seconds") or 0.0 for k in restarts
                                                for r in row[k]]),
        "preloaded_entries": [r["memory_entries_at_ready"] for r in row["preload"]],
    }
    m["preload_vs_memory"] = C.ratio(m["preload_ttft"], m["memory_ttft"])
    m["restart_vs_memory"] = C.ratio(m["restart_ttft"], m["memory_ttft"])
    m["preload_startup_s"] = m["ready_preload_s"] - m["ready_restart_s"]
    m["goal_met"] = m["preload_vs_memory"] is not None and m["preload_vs_memory"] <= 1.2
    m["sources"] = {"memory": sorted({r["source"] for r in row["memory"]["requests"]}),
                    **{k: sorted({r["request"]["source"] for r in row[k]}) for k in restarts}}
    m["cached_tokens"] = {"memory": C.median([r["cached_tokens"] for r in row["memory"]["requests"]]),
                          **{k: C.median([r["request"]["cached_tokens"] for r in row[k]]) for k in restarts}}
    m["page_cache_dropped"] = all(r["page_cache"]["dropped"] for k in restarts for r in row[k])
    return m


def run(ctx: C.Context) -> dict[str, Any]:
    started_at = time.perf_counter()
    models = ctx.options.get("server_models") or (QUICK if ctx.quick else DEFAULT)
    from concurrent.futures import ThreadPoolExecutor

    ctx.log(f"  kvstore warm + pin for {', '.join(n for n, _ in models)}, concurrently (cold prefills) ...")
    with ThreadPoolExecutor(len(models)) as pool:  # each cold prefill keeps about one core busy
        prepared = list(pool.map(lambda m: prepare(ctx, *m), models))
    rows = [run_model(ctx, prep) for prep in prepared]
    medians_ = {f"{r['model']}/{r['system_tokens']}": r["medians"] for r in rows}
    headline = {k: {"memory_s": v["memory_ttft"], "restart_s": v["restart_ttft"], "preload_s": v["preload_ttft"],
                    "preload_vs_memory": v["preload_vs_memory"], "preload_startup_s": v["preload_startup_s"]}
                for k, v in medians_.items()}
    settings = {"models": [{"model": n, "system_tokens": k} for n, k in models], "question_tokens": QUESTION,
                "max_tokens": MAX_TOKENS, "memory_hits": MEMORY_HITS, "restart_runs": RESTARTS,
                "no_warmup_runs": 1, "order": ["preload", "restart", "restart_no_warmup", "memory"],
                "drop_page_cache": ctx.drop, "goal": "preload_ttft <= 1.2 x memory_ttft"}
    notes = [
        "Every row is a fresh `kvstore serve` process (python -m kvstore.cli serve, OpenBLAS as the CLI "
        "preloads it); requests are streamed chat completions at temperature 0; TTFT is send -> first "
        "content chunk, measured by the client.",
        "The system prompt is prefilled once by `kvstore warm --system-file` and pinned by `kvstore pin`; "
        "warm.warm_s is that cold prefill (a separate process, not a server request; the models' warms run "
        "concurrently, each keeps about one core busy, so they slow each other somewhat).",
        "Ready time is Popen -> first 200 from GET /health; preload_startup_s = ready with --preload pinned "
        "minus ready without (both after the page cache was dropped).",
        "Restart rows are the median of RESTARTS runs (each a fresh process after a page-cache drop; "
        "--no-warmup: one run); memory hits are the median of several questions on one server that never "
        "stopped. The preload row runs first: a fresh process meets memory this VM's host has not backed "
        "yet, which slows whichever runs first.",
        "preload_seconds_in_server / warmup_seconds_in_server / identity_seconds_in_server are the server's own "
        "timings (GET /v1/cache/stats: startup); "
        "ready times also carry process start-up noise.",
    ]
    return C.document(NAME, ctx, settings, rows, medians_, headline, notes, started_at)


def report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["raw"]:
        m = r["medians"]
        rows.append([r["model"], r["system_tokens"], C.fmt(m["memory_ttft"], "s"), C.fmt(m["restart_no_warmup_ttft"], "s"),
                     C.fmt(m["restart_ttft"], "s"), C.fmt(m["preload_ttft"], "s"), C.fmt(m["preload_vs_memory"], "x"),
                     C.fmt(m["ready_restart_s"], "s"), C.fmt(m["preload_startup_s"], "s"),
                     C.fmt(m["preload_seconds_in_server"], "s"), C.fmt(m.get("identity_seconds_in_server"), "s"),
                     "yes" if m["page_cache_dropped"] else "NO"])
    return C.table("kvstore serve: TTFT of a streamed chat request under a pinned system prompt (medians)",
                   ["model", "system tok", "memory hit", "restart, no warm-up", "restart", "restart --preload pinned",
                    "preload / memory", "ready (restart)", "preload adds to ready", "preload (server)",
                    "identity at start", "pc dropped"], rows)


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    for r in doc["raw"]:
        m = r["medians"]
        out.append((f"kvstore serve restarted, first chat request, {r['model']} {r['system_tokens']}-token system prompt",
                    f"{C.fmt(m['preload_ttft'], 's')} with --preload pinned ({C.fmt(m['preload_vs_memory'], 'x')} "
                    f"of a memory hit), {C.fmt(m['restart_ttft'], 's')} without",
                    f"memory hit {C.fmt(m['memory_ttft'], 's')}; preload adds {C.fmt(m['preload_startup_s'], 's')} "
                    "to start-up"))
    return out
