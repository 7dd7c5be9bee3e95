"""kvstore inside the real vllm-mlx ``SimpleEngine`` (``prefix_trie_cache=True``).

Needs vllm-mlx (0.6, which pins mlx-lm < 0.32): ``tools/gates/compat_env.sh`` builds that
environment; elsewhere this module is skipped. The model is the tiny llama from
tools.testing.model_builds (a real mlx-lm llama with a ChatML template), run greedily on CPU.

Each run is a separate process (this file run as a script): a cold run fills the cache
directory, a "restarted" run in a new process with the same directory must restore the
shared prefix from disk and produce exactly the tokens of a run without any cache.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from tests.support.children import child_env

SYSTEM = "You are a careful assistant who answers briefly and exactly. " * 30
MAX_TOKENS = 12


def chat(*users_and_replies: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(users_and_replies):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return msgs


# --------------------------------------------------------------------------- child process


def _child(args: dict[str, Any]) -> dict[str, Any]:
    """One engine lifetime per request list; returns tokens and cache counters per request."""
    import asyncio

    import mlx_lm

    tokens: list[int] = []
    original = mlx_lm.stream_generate

    def recording(*a: Any, **k: Any) -> Any:  # both of vllm-mlx's paths import it lazily
        gen = original(*a, **k)
        try:
            for resp in gen:
                tokens.append(int(resp.token))
                yield resp
        finally:  # on the generation thread, like an unwrapped generator
            gen.close()

    mlx_lm.stream_generate = recording
    from vllm_mlx.engine.simple import SimpleEngine

    from kvstore.adapters import vllm_mlx as kv_vllm

    async def run() -> list[dict[str, Any]]:
        out = []
        for engine_run in args["engines"]:
            if args["mode"] == "kvstore":
                kv_vllm.install(cache_dir=args["cache_dir"])
            engine = SimpleEngine(args["model"], prefix_trie_cache=args["mode"] != "none")
            await engine.start()
            for msgs in engine_run:
                tokens.clear()
                last = None
                async for o in engine.stream_chat(msgs, max_tokens=MAX_TOKENS, temperature=0.0):
                    last = o
                cache = kv_vllm.engine_cache(engine)
                out.append({
                    "tokens": list(tokens),
                    "text": last.text if last else None,
                    "prompt_tokens": last.prompt_tokens if last else None,
                    "trie": dict(engine._prefix_trie_cache_stats),
                    "store": cache.stats() if cache is not None else None,
                    "cache_class": type(engine._prefix_trie_cache).__name__,
                })
            await engine.stop()
        return out

    return {"runs": asyncio.run(run())}


def run_child(mode: str, model: str, cache_dir: pathlib.Path, *engines: list[list[dict]]) -> list[dict]:
    """Run ``engines`` (each a list of chats, one engine after the other) in a new process."""
    args = {"mode": mode, "model": model, "cache_dir": str(cache_dir), "engines": list(engines)}
    env = child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    p = subprocess.run([sys.executable, __file__, json.dumps(args)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, f"child failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])["runs"]


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
    # Every engine has stopped (kvstore's caches are closed and flushed by then). Skip the
    # interpreter teardown: with vllm-mlx's detached generation threads it can abort in
    # C++ ("terminate called without an active exception"), which is not under test here.
    os._exit(0)

# --------------------------------------------------------------------------- tests

vllm_mlx = pytest.importorskip("vllm_mlx")


@pytest.fixture(scope="module")
def model() -> str:
    from tools.testing.model_builds import model_path

    return str(model_path("tiny-llama"))


def test_mlx_lm_cache_never_stores_in_vllm_mlx(model: str, tmp_path: pathlib.Path) -> None:
    """Upstream behaviour this adapter works around: vllm-mlx keys mlx-lm's LRUPromptCache
    with the model object, which is unhashable, so every lookup and insert is skipped."""
    (run,) = run_child("mlx_lm", model, tmp_path, [chat("hello")])
    assert run["cache_class"] == "LRUPromptCache"
    assert run["trie"]["inserts"] == 0 and run["trie"]["skips"] >= 1


def test_restart_restores_the_shared_prefix_from_disk(model: str, tmp_path: pathlib.Path) -> None:
    cache_dir = tmp_path / "kv"
    first, second = chat("Tell me about rivers."), chat("Tell me about mountains.")

    (cold,) = run_child("kvstore", model, cache_dir, [first])
    assert cold["cache_class"] == "EnginePromptCache"
    assert cold["trie"]["misses"] == 1 and cold["trie"]["inserts"] == 1
    assert cold["store"]["misses"] == 1

    (warm,) = run_child("kvstore", model, cache_dir, [second])        # a new process
    assert warm["store"]["hits_disk"] == 1, warm
    assert warm["trie"]["hits"] == 1 and warm["trie"]["tokens_saved"] > 500, warm
    (plain,) = run_child("none", model, tmp_path / "unused", [second])  # no cache at all
    assert warm["tokens"] == plain["tokens"]
    assert warm["text"] == plain["text"]
    assert len(plain["tokens"]) == MAX_TOKENS

    (again,) = run_child("kvstore", model, cache_dir, [first])        # the cold request again
    assert again["store"]["hits_disk"] == 1
    assert again["tokens"] == cold["tokens"]


def test_engine_restart_in_one_process(model: str, tmp_path: pathlib.Path) -> None:
    """A second engine in the same process, same directory: ``stop()`` closed the first
    engine's store (flushed, index released), the second restores from disk."""
    turn1 = chat("Tell me about rivers.")
    first, second = run_child("kvstore", model, tmp_path / "kv", [turn1], [turn1])
    assert first["store"]["misses"] == 1
    assert second["store"]["hits_disk"] == 1 and second["tokens"] == first["tokens"]


def test_follow_up_beats_the_system_prompt_snapshot(model: str, tmp_path: pathlib.Path) -> None:
    """After a miss, vllm-mlx keeps a snapshot of the system prompt; later requests then size
    the trie hit first (through mlx-lm's private ``_trie``, which kvstore's cache answers)
    and take it when it is longer: here the whole first turn of the conversation."""
    turn1 = chat("Tell me about rivers.")
    turn2 = chat("Tell me about rivers.", "x", "And lakes?")  # shares all of turn1's prompt
    first, follow = run_child("kvstore", model, tmp_path / "kv", [turn1, turn2])
    assert first["trie"]["misses"] == 1                   # (engine counters accumulate)
    assert follow["trie"]["hits"] == 1 and follow["trie"]["skips"] == 0, follow
    assert follow["trie"]["tokens_saved"] >= first["prompt_tokens"]
    assert follow["store"]["hits_memory"] == 1
    (plain,) = run_child("none", model, tmp_path / "unused", [turn2])
    assert follow["tokens"] == plain["tokens"]


def test_install_on_one_engine_then_uninstall(model: str, tmp_path: pathlib.Path) -> None:
    """``install(engine)`` changes that engine only; ``uninstall`` restores vllm-mlx."""
    import asyncio

    from vllm_mlx.engine.simple import SimpleEngine

    from kvstore.adapters import vllm_mlx as kv_vllm

    original_stop = SimpleEngine.stop

    async def go() -> None:
        ours = SimpleEngine(model, prefix_trie_cache=True)
        theirs = SimpleEngine(model, prefix_trie_cache=True)
        kv_vllm.install(ours, cache_dir=tmp_path / "kv")
        for engine in (ours, theirs):
            await engine.start()
            async for _ in engine.stream_chat(chat("hello"), max_tokens=4, temperature=0.0):
                pass
        cache = kv_vllm.engine_cache(ours)
        assert cache is not None and ours._prefix_trie_cache_stats["inserts"] == 1
        assert cache.model_key == (model, None, None)
        assert kv_vllm.engine_cache(theirs) is None
        assert type(theirs._prefix_trie_cache).__module__ == "mlx_lm.models.cache"
        await ours.stop()
        await theirs.stop()
        assert cache.store.disk is None            # closed by stop(): flushed, index released
        assert cache.stats()["writes"] == 1

    try:
        asyncio.run(go())
    finally:
        kv_vllm.uninstall()
    assert SimpleEngine.stop is original_stop
    assert not hasattr(SimpleEngine, "_kvstore_options")
