"""Any ``model`` name answers on ``kvstore serve``, never with a hub lookup; what
``--served-model-name`` and ``--strict-model-names`` change.

Real ``kvstore serve`` subprocesses on tiny-llama, the official ``openai`` and ``anthropic``
SDKs over HTTP. mlx_lm.server loads a request's ``model`` when it is not the served path
or ``default_model``: a short id such as ``tiny`` (OpenCode's) was a 404 whose body was a
Hugging Face Hub lookup error (``HF_HUB_OFFLINE`` is set for every test server, so here the
lookup fails offline instead of reaching the network).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

from tests.support.servers import Server

QUESTION = [{"role": "user", "content": "Which shelf holds the ledgers kept for five years?"}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def clients(s: Server) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (openai.OpenAI(base_url=s.url + "/v1", api_key="local", max_retries=0, timeout=300),
            anthropic.Anthropic(base_url=s.url, api_key="local", max_retries=0, timeout=300))


def test_any_model_name_is_served_by_the_loaded_model(model_dir: Path, tmp_path: Path) -> None:
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log") as s:
        oa, an = clients(s)
        assert [m.id for m in oa.models.list().data] == [str(model_dir)]
        answers = []
        for name in ("tiny", "gpt-4o", "some-org/some-repo", str(model_dir), "default_model"):
            r = oa.chat.completions.create(model=name, messages=QUESTION, max_tokens=4, temperature=0)
            assert r.model == name  # echoed as sent
            answers.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        # one model and one cache: the same greedy answer under every name, and every
        # request after the first restores the prompt the first one stored
        assert len({text for text, _ in answers}) == 1, answers
        assert all(cached > 0 for _, cached in answers[1:]), answers
        text = oa.completions.create(model="anything", prompt="The archive", max_tokens=4, temperature=0)
        assert text.model == "anything" and text.choices[0].text
        msg = an.messages.create(model="claude-local", max_tokens=4, messages=QUESTION)
        assert msg.model == "claude-local" and msg.usage.cache_read_input_tokens > 0
        reply = oa.responses.create(model="codex-local", input=QUESTION[0]["content"], max_output_tokens=4)
        assert reply.model == "codex-local" and reply.usage is not None and reply.usage.input_tokens_details.cached_tokens > 0
        log = s.log(tail=10**6)
        assert "Hub" not in log and "huggingface" not in log.lower() and "Traceback" not in log, log


def test_served_model_names_and_strict_model_names(model_dir: Path, tmp_path: Path) -> None:
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log",
                ["--served-model-name", "tiny", "--served-model-name", "coder", "--strict-model-names"]) as s:
        oa, an = clients(s)
        assert [m.id for m in oa.models.list().data] == ["tiny", "coder"]
        assert oa.models.retrieve("coder").id == "coder"
        with pytest.raises(openai.NotFoundError):
            oa.models.retrieve(str(model_dir))  # not listed: --served-model-name replaces it
        for name in ("tiny", "default_model"):
            assert oa.chat.completions.create(model=name, messages=QUESTION, max_tokens=2).model == name
        with pytest.raises(openai.NotFoundError) as e:
            oa.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
        err = e.value.body
        assert isinstance(err, dict) and err["code"] == "model_not_found" and err["param"] == "model"
        assert "'gpt-4o'" in err["message"] and "'tiny', 'coder'" in err["message"]
        with pytest.raises(openai.NotFoundError, match="'tiny'"):
            oa.completions.create(model="other", prompt="The archive", max_tokens=2)
        with pytest.raises(anthropic.NotFoundError) as a:
            an.messages.count_tokens(model="claude-local", messages=QUESTION)
        assert a.value.body["error"]["type"] == "not_found_error" and "'tiny'" in a.value.message
        assert an.messages.create(model="tiny", max_tokens=2, messages=QUESTION).model == "tiny"
        assert oa.responses.create(model="coder", input="Hi", max_output_tokens=2).model == "coder"
        with pytest.raises(openai.NotFoundError, match="'tiny', 'coder'"):
            oa.responses.create(model="gpt-4o", input="Hi", max_output_tokens=2)
        with pytest.raises(urllib.error.HTTPError) as h:
            urllib.request.urlopen(s.url + "/v1/models/gpt-4o", timeout=30)
        assert h.value.code == 404 and json.load(h.value)["error"]["code"] == "model_not_found"


def _post(s: Server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(s.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_a_body_never_loads_a_draft_model_or_adapters(model_dir: Path, tmp_path: Path) -> None:
    """issue 52 item 1: ``draft_model`` naming a local model directory was loaded (and the
    server then died of SIGSEGV), a repo id was looked up on the hub; ``adapters`` too.
    Each is pinned to the started value: anything else is a 400 naming the field, in the
    route's shape; null / ``default_model`` are served with what was started."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    planted = tmp_path / "planted-model"  # a complete, loadable model directory
    shutil.copytree(model_dir, planted)
    chat = {"messages": QUESTION, "max_tokens": 4, "temperature": 0}
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log") as s:
        status, good = _post(s, "/v1/chat/completions", chat)
        assert status == 200, good
        answer = good["choices"][0]["message"]["content"]
        refused = [("/v1/chat/completions", {**chat, "draft_model": str(planted)}, "draft_model"),
                   ("/v1/chat/completions", {**chat, "draft_model": "org/some-repo"}, "draft_model"),
                   ("/v1/chat/completions", {**chat, "draft_model": str(model_dir)}, "draft_model"),
                   ("/v1/chat/completions", {**chat, "draft_model": ["x"] * 1000}, "draft_model"),
                   ("/v1/chat/completions", {**chat, "adapters": str(planted)}, "adapters"),
                   ("/v1/chat/completions", {**chat, "adapters": {"a": 1}}, "adapters"),
                   ("/v1/completions", {"prompt": "The archive", "max_tokens": 2, "draft_model": str(planted)},
                    "draft_model"),
                   ("/v1/responses", {"input": "Hi", "max_output_tokens": 2, "adapters": "org/lora"}, "adapters")]
        for path, body, field in refused:
            status, err = _post(s, path, body)
            assert status == 400, (path, field, status, err)
            assert err["error"]["param"] == field and err["error"]["code"] == "unsupported_parameter", err
            assert err["error"]["message"].startswith(f"{field} ") and "not served here" in err["error"]["message"]
        status, err = _post(s, "/v1/messages", {"model": "claude-local", "max_tokens": 4, "messages": QUESTION,
                                                "draft_model": str(planted)})
        assert status == 400 and err["type"] == "error", err
        assert err["error"]["type"] == "invalid_request_error" and "draft_model" in err["error"]["message"], err
        with ThreadPoolExecutor(4) as pool:  # concurrent, replayed: every one refused, none loads
            got = list(pool.map(lambda _: _post(s, "/v1/chat/completions", {**chat, "draft_model": str(planted)}),
                                range(8)))
        assert {status for status, _ in got} == {400}, got
        # absent, null and mlx-lm's own name for the started value: served by the started model
        for extra in ({"draft_model": None}, {"draft_model": "default_model"}, {"adapters": None},
                      {"draft_model": None, "adapters": None}):
            status, resp = _post(s, "/v1/chat/completions", {**chat, **extra})
            assert status == 200 and resp["choices"][0]["message"]["content"] == answer, (extra, resp)
        assert s.proc.poll() is None and s.get("/health") == {"status": "ok"}
        log = s.log(tail=10**6)
        assert "Draft model" not in log and "Traceback" not in log and "huggingface" not in log.lower(), log
