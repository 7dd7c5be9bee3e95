"""A server whose request-path parts are timed: what each turn spends rendering, looking up
and inserting, for ``kvstore serve`` and ``mlx_lm.server`` alike (issue 47, item 4).

    python -m benchmarks.turn_parts OUT.jsonl kvstore serve --model M --port P ...
    python -m benchmarks.turn_parts OUT.jsonl mlx_lm.server --model M --port P ...
    python -m benchmarks.turn_parts --render [MODEL [ROUNDS]]   # _tokenize alone (``render``)

Runs the server in this process with its generation thread's calls timed, one JSON line per
call appended to OUT.jsonl (``part``, seconds ``s``, the calling thread's CPU seconds ``cpu``
(what the call computed; the rest of ``s`` it waited: for the GIL, a lock, the stream, a
core of a loaded machine), prompt tokens ``n``):

- ``render``: ``ResponseGenerator._tokenize`` as the server runs it (the chat template and
  the tokenizer; kvstore's wrappers of it included),
- ``lookup``: the prompt cache's ``fetch_nearest_cache``; inside it for kvstore ``lookup:
  memory`` (``MemoryTier.lookup``: settling pending inserts, the trie, the hit's cache
  objects) and ``lookup: disk`` (``KVStore._fetch_disk``: the disk plan),
- ``insert``: its ``insert_cache`` (the end of a turn: the next request waits for it),
  and, inside it for kvstore, ``snapshot`` (``WritePath.take``: the checks and the
  snapshot); the rest of ``insert`` is the persist hand-off (host views, the writer's
  queue: ``hand-off`` in ``summary``),
- ``persist``: kvstore's ``WritePath.persist``, on its writer thread (off the request
  path, but on the same cores).

The wrappers are installed when the ``ResponseGenerator`` is made, i.e. after kvstore's own
patches: the same code runs, each call's wall time around it. Timing only; nothing else changes.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from typing import Any, Callable

_LOCK = threading.Lock()


def _timed(fn: Callable[..., Any], part: str, out: Any, n_of: Callable[..., int]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            took, cpu = time.perf_counter() - t0, time.thread_time() - c0
            try:
                n = n_of(*args, **kwargs)
            except Exception:
                n = -1
            with _LOCK:
                out.write(json.dumps({"part": part, "s": took, "cpu": cpu, "n": n, "t": time.time()}) + "\n")
                out.flush()
    wrapper._turn_parts = True  # type: ignore[attr-defined]
    return wrapper


def _install(out: Any) -> None:
    import mlx_lm.server as server_mod

    generator = server_mod.ResponseGenerator
    init = generator.__init__

    def __init__(self: Any, model_provider: Any, prompt_cache: Any, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        if not getattr(cls._tokenize, "_turn_parts", False):  # outermost: after kvstore's wrappers
            cls._tokenize = _timed(cls._tokenize, "render", out,
                                   lambda self, tokenizer, request, args: len(request.messages or []))
        pc = type(prompt_cache)
        for name, part in (("fetch_nearest_cache", "lookup"), ("insert_cache", "insert")):
            if not getattr(getattr(pc, name), "_turn_parts", False):
                setattr(pc, name, _timed(getattr(pc, name), part, out,
                                         lambda self, model, tokens, *a, **k: len(tokens)))
        if "kvstore.writes" in sys.modules:
            from kvstore.writes import WritePath

            if not getattr(WritePath.take, "_turn_parts", False):  # a staticmethod: kept one
                WritePath.take = staticmethod(_timed(WritePath.take, "snapshot", out,  # type: ignore[method-assign]
                                                     lambda ident, enc, *a, **k: len(enc) // 8))
            from kvstore.memory import MemoryTier
            from kvstore.store import KVStore

            if not getattr(MemoryTier.lookup, "_turn_parts", False):  # inside lookup: settle, trie, hit
                MemoryTier.lookup = _timed(MemoryTier.lookup, "lookup: memory", out,  # type: ignore[method-assign]
                                           lambda self, model, tokens, *a, **k: len(tokens))
            if not getattr(KVStore._fetch_disk, "_turn_parts", False):  # inside lookup: the disk plan
                KVStore._fetch_disk = _timed(KVStore._fetch_disk, "lookup: disk", out,  # type: ignore[method-assign]
                                             lambda self, ident, q, *a, **k: len(q.tokens))
            if not getattr(WritePath.persist, "_turn_parts", False):  # the writer thread's
                WritePath.persist = _timed(WritePath.persist, "persist", out,  # type: ignore[method-assign]
                                           lambda self, job: job.query.n)
        init(self, model_provider, prompt_cache, *args, **kwargs)

    generator.__init__ = __init__  # type: ignore[method-assign]


def render(model: str = "smollm2", rounds: int = 21, paragraphs: int = 128, n_tools: int = 8) -> dict[str, Any]:
    """``python -m benchmarks.turn_parts --render [MODEL [ROUNDS]]``: mlx-lm's ``_tokenize``
    of the agent trace's third request (``paragraphs`` of system prompt, the tools, two
    turns; 128 paragraphs: ~8.6k SmolLM2 tokens, the issue's agent prompt), plain
    and with kvstore's ``system_render`` (the probe remembered), interleaved in one process;
    median seconds of ``rounds`` each."""
    import statistics
    import types

    import mlx_lm.server as server_mod
    from mlx_lm.utils import load_tokenizer

    from benchmarks.agent_trace import Session, system_prompt, tools
    from kvstore.serve import system_render
    from kvstore.serve.anthropic import chat_request
    from tools.testing.model_builds import model_path
    from tools.testing.templates import TOOL_TEMPLATE

    tok = load_tokenizer(model_path(model), tokenizer_config_extra={"chat_template": TOOL_TEMPLATE})
    session = Session(system_prompt(paragraphs), tools(n_tools), 16)
    for _ in range(2):  # the third request ends with a user message (the second's with a tool result,
        session.request()  # which mlx-lm renders once: no system segment without a user message last)
        session.answer([{"type": "text", "text": "Looking."}])
    req = session.request()
    req.pop("extra_body")
    chat = chat_request(req, False)
    plain: Any = type("Plain", (server_mod.ResponseGenerator,), {})
    probed: Any = type("Probed", (server_mod.ResponseGenerator,), {})
    system_render.install(types.SimpleNamespace(ResponseGenerator=probed))
    me = types.SimpleNamespace(model_provider=types.SimpleNamespace(
        processor=None, cli_args=types.SimpleNamespace(chat_template_args={})))
    args = types.SimpleNamespace(chat_template_kwargs=None)
    times: dict[str, list[float]] = {"plain": [], "system_render": []}
    n = 0
    for _ in range(rounds):
        for name, cls in (("plain", plain), ("system_render", probed)):
            request = server_mod.CompletionRequest("chat", "", json.loads(json.dumps(chat["messages"])),
                                                   chat.get("tools"), None)
            t0 = time.perf_counter()
            n = len(cls._tokenize(me, tok, request, args)[0])
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    import os

    return {"model": model, "prompt_tokens": n, "rounds": rounds, "median_s": med,
            "ratio": med["system_render"] / med["plain"], "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--render"]:
        print(json.dumps(render(argv[1] if len(argv) > 1 else "smollm2", int(argv[2]) if len(argv) > 2 else 21),
                         indent=1))
        return 0
    if len(argv) < 2 or argv[1] not in ("kvstore", "mlx_lm.server"):
        print(__doc__, file=sys.stderr)
        return 2
    path, which, rest = argv[0], argv[1], argv[2:]
    out = open(path, "a", buffering=1)
    _install(out)
    if which == "kvstore":
        from kvstore.cli.main import main as kvstore_main

        return int(kvstore_main(rest) or 0)
    import mlx_lm.server as server_mod

    sys.argv = ["mlx_lm.server", *rest]
    server_mod.main()
    return 0


def summary(path: str) -> dict[str, Any]:
    """Per part: the calls' seconds in order, and the median over the turns after the
    first (``steady``)."""
    import statistics

    parts: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return {}
    for line in lines:
        row = json.loads(line)
        parts.setdefault(row["part"], []).append(row["s"])
        cpu.setdefault(row["part"], []).append(row.get("cpu", float("nan")))
    if "snapshot" in parts and len(parts["snapshot"]) == len(parts.get("insert", ())):  # one take per insert
        parts["hand-off"] = [i - t for i, t in zip(parts["insert"], parts["snapshot"])]
        cpu["hand-off"] = [i - t for i, t in zip(cpu["insert"], cpu["snapshot"])]
    return {p: {"calls": len(v), "seconds": v, "steady_median_s": statistics.median(v[1:] or v),
                "cpu_seconds": cpu[p], "steady_median_cpu_s": statistics.median(cpu[p][1:] or cpu[p])}
            for p, v in parts.items()}


if __name__ == "__main__":
    raise SystemExit(main())
