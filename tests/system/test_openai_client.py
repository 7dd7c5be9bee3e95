"""``kvstore serve`` as the official ``openai`` Python client meets it.

A real server subprocess (tiny-llama), the real client over HTTP: the model list, a chat
completion, a restart, a streamed completion with ``include_usage`` and another restart,
each restarted server answering from the disk tier. ``cached_tokens`` is read where the
client exposes it (``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import signal
from pathlib import Path

import openai
import pytest

from tests.support.servers import Server

SYSTEM = " ".join(f"Clause {i}: the archive keeps every ledger for {i + 3} years and lists it by shelf {i * 5 % 17}."
                  for i in range(14))  # ~1,200 characters: ~1,200 tokens for the byte-level tokenizer
MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Which shelf holds the ledgers kept for five years?"}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def client(server: Server) -> openai.OpenAI:
    """What README tells a user to write: base_url ends in /v1, any api_key."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0, timeout=120)


def fake_hub_cache(root: Path) -> Path:
    """A Hugging Face hub cache holding one repo that mlx_lm.server would list as a model."""
    repo = root / "models--mlx-community--Fake-4bit"
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json"):
        (snap / name).write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return root


def test_models_list_names_the_served_model(model_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The list holds exactly the ``--model`` value, whatever the hub cache holds (here a
    repo mlx_lm.server itself would list); ``retrieve`` finds it and nothing else."""
    monkeypatch.setenv("HF_HUB_CACHE", str(fake_hub_cache(tmp_path / "hub")))
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log") as s:
        c = client(s)
        models = c.models.list()
        assert [m.id for m in models.data] == [str(model_dir)], models
        assert models.data[0].object == "model" and models.data[0].created > 0
        assert c.models.retrieve(str(model_dir)).id == str(model_dir)
        with pytest.raises(openai.NotFoundError):
            c.models.retrieve("mlx-community/Fake-4bit")
        assert s.stop(signal.SIGTERM) == 0, s.log()


def chat(c: openai.OpenAI, model: str, **extra):
    return c.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24, **extra)


def test_chat_and_stream_report_cached_tokens_from_disk(model_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Cold chat completion; restart; the same request streamed (``include_usage``) is
    served from disk with the same text; restart; non-streamed again, from disk. No hub
    cache exists (mlx_lm.server answered ``/v1/models`` with an empty body then)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub-cache"))
    cache_dir = tmp_path / "cache"

    with Server(model_dir, cache_dir, tmp_path / "server1.log") as s:
        c = client(s)
        model = c.models.list().data[0].id
        assert model == str(model_dir)
        cold = chat(c, model)
        assert cold.model == model
        text = cold.choices[0].message.content
        assert text and cold.usage.completion_tokens > 0
        assert cold.usage.prompt_tokens > 1000, cold.usage
        assert cold.usage.prompt_tokens_details.cached_tokens == 0, cold.usage
        assert s.stop(signal.SIGTERM) == 0, s.log()

    with Server(model_dir, cache_dir, tmp_path / "server2.log") as s:
        chunks = list(chat(client(s), model, stream=True, stream_options={"include_usage": True}))
        st = s.stats()
        assert s.stop(signal.SIGTERM) == 0, s.log()
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert streamed == text
    assert len(usage) == 1 and chunks[-1].usage is not None, chunks[-3:]
    u = usage[0]
    assert u.prompt_tokens == cold.usage.prompt_tokens and u.completion_tokens == cold.usage.completion_tokens
    cached = u.prompt_tokens_details.cached_tokens
    assert 1000 < cached < u.prompt_tokens, u
    # the number is what the store restored from disk for this one request
    assert st["hits_disk"] == 1 and st["hits_memory"] == 0 and st["tokens_saved"] == cached, st

    with Server(model_dir, cache_dir, tmp_path / "server3.log") as s:
        again = chat(client(s), model)
        st = s.stats()
        assert s.stop(signal.SIGTERM) == 0, s.log()
    assert again.choices[0].message.content == text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 1000 < cached < again.usage.prompt_tokens, again.usage
    assert st["hits_disk"] == 1 and st["tokens_saved"] == cached, st
    print(f"\nprompt_tokens={cold.usage.prompt_tokens} cached: streamed={u.prompt_tokens_details.cached_tokens} "
          f"non-streamed={cached} text={text!r}")
