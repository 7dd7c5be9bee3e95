"""The warm-up does a request's first-time work before ``kvstore serve`` is ready (issue 56).

A restarted server with ``--preload pinned`` holds its pinned system prompt in memory, so
its first request is a memory hit; what it paid over the second one was first-time work in
the request path, outside the store: the chat template's Jinja compile, and the first pass
through mlx-lm's batched generation. A real ``kvstore serve`` (tiny model, real HTTP) runs
in a child process that counts, never times: template compiles (transformers' compile
cache) and the Python calls the request path makes on the generation thread (kvstore's
``_tokenize`` and mlx-lm's ``BatchGenerator``), at ready and after each of two requests.
With the warm-up the first request makes no more of them than the second; with
``--no-warmup`` (the control) it compiles the template and makes many more calls. The
warm-up changes nothing a fresh server would show: the same store counts at ready,
nothing learned or written, this thread's MLX state (random key, stream, limits) as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.children import run_py
from tests.support.servers import free_port
from tests.system.test_server import USER1, USER2
from tests.system.test_warm_start import SYSTEM, warm_and_pin

CHILD = """
    import json, os, sys, threading, time, urllib.request
    args = json.loads(sys.argv[1])
    from transformers.utils import chat_template_utils as templates
    import importlib
    mlx_generate = importlib.import_module("mlx_lm.generate")  # the package names a function so
    from kvstore import hoststate
    from kvstore.serve import generator, startup

    inside, calls = threading.local(), [0]

    def counted(fn):
        def wrapped(*a, **k):
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return fn(*a, **k)
            finally:
                inside.depth -= 1
        return wrapped

    def profile(frame, event, arg):
        if event in ("call", "c_call") and getattr(inside, "depth", 0):
            calls[0] += 1

    generator.Generator._tokenize = counted(generator.Generator._tokenize)
    for name in ("insert_segments", "next"):
        setattr(mlx_generate.BatchGenerator, name, counted(getattr(mlx_generate.BatchGenerator, name)))
    host = {}
    warm = startup.warm_up_request if hasattr(startup, "warm_up_request") else None

    def watched(*a):
        before = hoststate.snapshot()
        try:
            return warm(*a)
        finally:
            host["changes"] = repr(hoststate.changes(before, hoststate.snapshot()))

    if warm is not None:
        startup.warm_up_request = watched
    threading.setprofile(profile)
    url = f"http://127.0.0.1:{args['port']}"

    def get(path):
        with urllib.request.urlopen(url + path, timeout=30) as r:
            return json.loads(r.read())

    def chat(question):
        body = {"messages": [{"role": "system", "content": args["system"]}, {"role": "user", "content": question}],
                "temperature": 0, "max_tokens": 3}
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def now():
        return {"compiles": templates._compile_jinja_template.cache_info().misses, "calls": calls[0]}

    def client():
        out = {}
        try:
            for _ in range(3000):
                try:
                    if get("/health").get("status") == "ok":
                        break
                except OSError:
                    pass
                time.sleep(0.05)
            else:
                raise RuntimeError("kvstore serve never said it was ready")
            out["stats_at_ready"], out["ready"] = get("/v1/cache/stats"), now()
            d = os.path.join(args["cache"], "stable-prefix")
            out["records_at_ready"] = {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read().hex()
                                       for r, _, fs in os.walk(d) for f in fs}
            out["cached"] = []
            for k, q in enumerate(args["questions"]):
                out["cached"].append(chat(q)["usage"].get("prompt_tokens_details", {}).get("cached_tokens"))
                out[f"after_{k + 1}"] = now()
            out["host"] = host.get("changes")
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            print(json.dumps(out), flush=True)
            os._exit(0)

    threading.Thread(target=client, daemon=True).start()
    from kvstore.cli.main import main
    main(["serve", "--model", args["model"], "--cache-dir", args["cache"], "--host", "127.0.0.1",
          "--port", str(args["port"]), *args["flags"]])
"""

COUNTERS = ("memory_entries", "hits_memory", "hits_disk", "misses", "restores", "inserts", "evictions",
            "preloaded_entries", "preloaded_tokens")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def serve(model_dir: Path, cache_dir: Path, flags: list[str], questions: list[str]) -> dict[str, Any]:
    """A real ``kvstore serve --preload pinned`` in a child process: its counts at ready
    and after each of two chat requests under the pinned system prompt (``questions``:
    each new to the store, so each is a hit of the system prompt alone)."""
    return run_py(CHILD, {"model": str(model_dir), "cache": str(cache_dir), "port": free_port(),
                          "system": SYSTEM, "questions": questions,
                          "flags": ["--preload", "pinned", *flags]}, timeout=600)


def records(cache_dir: Path) -> dict[str, bytes]:
    """The stable prefix's records (what it learned) in ``cache_dir``."""
    d = cache_dir / "stable-prefix"
    return {str(p.relative_to(d)): p.read_bytes().hex() for p in d.rglob("*") if p.is_file()} if d.exists() else {}


def test_the_first_request_after_a_warm_start_does_no_first_time_work(model_dir: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    n_sys = warm_and_pin(model_dir, cache_dir, tmp_path)
    cold = serve(model_dir, cache_dir, ["--no-warmup"], [USER1, USER2])
    learned = records(cache_dir)  # what the control's requests recorded
    warm = serve(model_dir, cache_dir, [], ["Which rule names a navigator?", "Quote rule 15, please."])

    for got in (cold, warm):  # both requests are memory hits of the pinned system prompt
        assert "error" not in got, got.get("error")
        assert got["cached"][0] == got["cached"][1] == n_sys, got["cached"]
    # the control: without the warm-up the first request compiles the template and makes
    # many more request-path calls than the second (what the counters catch)
    first = {k: cold["after_1"][k] - cold["ready"][k] for k in ("compiles", "calls")}
    second = {k: cold["after_2"][k] - cold["after_1"][k] for k in ("compiles", "calls")}
    assert first["compiles"] >= 1 and second["compiles"] == 0, cold
    assert first["calls"] > 1.5 * second["calls"], cold
    # the warm-up compiled it before ready: the first request does what the second does
    first = {k: warm["after_1"][k] - warm["ready"][k] for k in ("compiles", "calls")}
    second = {k: warm["after_2"][k] - warm["after_1"][k] for k in ("compiles", "calls")}
    assert warm["ready"]["compiles"] >= 1 and first["compiles"] == second["compiles"] == 0, warm
    # ... and went through mlx-lm's batched generation (the control's start never does)
    assert warm["ready"]["calls"] > 0 and cold["ready"]["calls"] == 0, (warm["ready"], cold["ready"])
    assert first["calls"] <= 1.1 * second["calls"], (first, second)
    # and changed nothing a fresh server would show
    assert warm["host"] == "{}", warm["host"]
    assert warm["records_at_ready"] == learned, "the warm-up recorded a stable-prefix record"
    assert {k: warm["stats_at_ready"].get(k) for k in COUNTERS} == {k: cold["stats_at_ready"].get(k) for k in COUNTERS}
    startup = warm["stats_at_ready"]["startup"]
    assert isinstance(startup["warmup_request_seconds"], float), startup
    assert "warmup_request_seconds" not in cold["stats_at_ready"]["startup"], cold["stats_at_ready"]["startup"]
