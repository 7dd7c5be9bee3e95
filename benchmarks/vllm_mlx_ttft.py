"""Time to first token after a restart: vllm-mlx alone vs ``kvstore vllm-mlx serve``.

    python -m benchmarks.vllm_mlx_ttft [--model tiny-llama] [--repeat 30]   # in the compat venv

Per engine (SimpleEngine default, ``--prefix-trie-cache``, ``--continuous-batching``), on one
trace: request A (a long system prompt + question 1) on a fresh server, then the server
restarted and request B (same system prompt, question 2), streamed; TTFT = time to the first
content chunk. vllm-mlx alone runs with its own persistence on (the batched engine saves its
prefix cache at a graceful shutdown and loads it at start; ``--ssd-cache-dir`` spills RAM
evictions), restarted after SIGTERM (its best case) and after SIGKILL; kvstore after SIGKILL.
Also: a request whose longer prefix (A's conversation, on disk) competes with a shorter one
in RAM (the system prompt of another request made after the restart).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.compat.test_vllm_mlx_serve import ENGINES, SYSTEM, Server, _entries, _serve, _wait


def ttft(server: Server, model: str, messages: list[dict[str, str]]) -> float:
    body = {"model": model, "max_tokens": 4, "temperature": 0.0, "stream": True, "messages": messages}
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                ev = json.loads(line[5:])
                if ev.get("choices") and (ev["choices"][0].get("delta") or {}).get("content"):
                    took = time.perf_counter() - t0
                    for _ in resp:
                        pass
                    return took
    raise AssertionError("no content streamed")


def chat(system: str, *turns: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return msgs


def run(engine: str, mode: str, model: str, work: Path, system: str) -> dict[str, Any]:
    flags = list(ENGINES[engine])
    work.mkdir(parents=True)
    kv = work / "kv" if mode == "kvstore" else None
    if mode != "kvstore" and engine == "batched":
        flags += ["--ssd-cache-dir", str(work / "ssd")]
    sig = signal.SIGTERM if mode == "alone-sigterm" else signal.SIGKILL
    long_turns = ("Tell me about the sea.", "The sea is large and deep.", "And rivers?")
    out: dict[str, Any] = {}
    s = _serve(work, "1", model, flags, kv)
    try:
        out["cold"] = ttft(s, model, chat(system, "What is two plus two?"))
        ttft(s, model, chat(system, *long_turns))
        if kv is not None:
            want = 1 if engine == "simple" else 2  # SimpleEngine default: the system prompt slot only
            _wait(lambda: len(_entries(kv)) >= want, "entries on disk")
    finally:
        s.stop(sig)
    s = _serve(work, "2", model, flags, kv)
    try:
        out["restart"] = ttft(s, model, chat(system, "Name one primary colour."))
        # now the system prompt is in RAM; the longer conversation prefix is only on disk
        out["longer_on_disk"] = ttft(s, model, chat(system, *long_turns[:2], "And lakes?"))
    finally:
        s.stop(signal.SIGKILL)
    return out


def main(argv: list[str] | None = None) -> int:
    from tools.testing.model_builds import model_path

    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_mlx_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--repeat", type=int, default=30, help="the system prompt: a sentence this many times")
    args = p.parse_args(argv)
    model = str(model_path(args.model))
    from kvstore import blas

    os.environ.update(blas.preload_environment())  # every server on the BLAS kvstore's commands preload
    system = SYSTEM.split(". ")[0] + ". "
    system = system * args.repeat
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ENGINES:
            for mode in ("alone-sigterm", "alone-sigkill", "kvstore"):
                got = run(engine, mode, model, Path(tmp) / f"{engine}-{mode}", system)
                rows.append((engine, mode, got))
                print(engine, mode, {k: round(v, 3) for k, v in got.items()}, flush=True)
    print("\n| engine | server | cold (s) | first after restart (s) | longer prefix on disk, shorter in RAM (s) |")
    print("|---|---|---|---|---|")
    for engine, mode, got in rows:
        print(f"| {engine} | {mode} | {got['cold']:.2f} | {got['restart']:.2f} | {got['longer_on_disk']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
