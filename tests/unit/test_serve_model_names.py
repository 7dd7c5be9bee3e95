"""kvstore.serve.model_names: the body fields that would load a model (issue 52 item 1)
are pinned to the started values or refused, and the generation arguments always name the
started model, draft model and adapters."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from hypothesis import given, strategies as st

from kvstore.serve import model_names

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                    max_leaves=6)


def cli(draft: str | None = None, adapter: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(model="/models/served", draft_model=draft, adapter_path=adapter)


def test_pinned_fields_pass_only_the_started_values() -> None:
    plain, drafted = cli(), cli(draft="/models/draft", adapter="/adapters/a")
    for body in ({}, {"draft_model": None}, {"draft_model": "default_model"}, {"adapters": None}, []):
        assert model_names.pinned_refusal(body, plain) is None, body
    assert model_names.pinned_refusal({"draft_model": "/models/draft", "adapters": "/adapters/a"}, drafted) is None
    for body, field in (({"draft_model": "/models/draft"}, "draft_model"), ({"draft_model": "org/repo"}, "draft_model"),
                        ({"adapters": "/adapters/a"}, "adapters"), ({"adapters": "default_model"}, "adapters"),
                        ({"draft_model": 3}, "draft_model"), ({"draft_model": ["x"]}, "draft_model")):
        got = model_names.pinned_refusal(body, plain)
        assert got is not None and got[0] == field and "not served here" in got[1], (body, got)
    got = model_names.pinned_refusal({"draft_model": "x" * 10_000 + "\x1b[2J"}, drafted)
    assert got is not None and len(got[1]) < 400 and "\x1b" not in got[1] and "'/models/draft' (--draft-model)" in got[1]
    openai_shape = model_names.refused("/v1/chat/completions", "adapters", "why")["error"]
    assert openai_shape["param"] == "adapters" and openai_shape["code"] == "unsupported_parameter"
    assert model_names.refused("/v1/messages", "adapters", "why")["type"] == "error"


@given(st.dictionaries(st.sampled_from(["draft_model", "adapters", "model", "messages"]), JSON, max_size=4),
       st.sampled_from([None, "/models/draft"]))
def test_pinned_refusal_never_raises_and_passes_only_what_was_started(body: dict[str, Any], draft: str | None) -> None:
    args = cli(draft=draft)
    got = model_names.pinned_refusal(body, args)
    passes = {"draft_model": [v for v in ("default_model", draft) if v is not None], "adapters": []}
    bad = [k for k, ok in passes.items() if body.get(k) is not None and body[k] not in ok]
    assert (got is None) == (not bad), (body, got)
    if got is not None:
        assert got[0] == bad[0] and got[0] in got[1]


@dataclasses.dataclass(frozen=True)
class Described:  # the fields of mlx_lm.server's ModelDescription
    model: str
    draft: Any
    adapter: Any


@dataclasses.dataclass(frozen=True)
class Arguments:  # GenerationArguments' model field (the rest does not matter here)
    model: Described
    max_tokens: int = 4


def test_generation_arguments_always_name_the_started_models() -> None:
    asked = Arguments(Described("org/other", "/planted/model", "/planted/adapter"))
    got = model_names.on_served_model(asked, cli(adapter="/adapters/a"))
    assert got.model == Described("default_model", "default_model", "/adapters/a") and got.max_tokens == 4
    same = Arguments(Described("default_model", "default_model", None))
    assert model_names.on_served_model(same, cli()) is same
    no_model = argparse.Namespace(model=None, draft_model=None, adapter_path=None)  # in-process engine
    assert model_names.on_served_model(asked, no_model).model == Described("org/other", "default_model", None)
