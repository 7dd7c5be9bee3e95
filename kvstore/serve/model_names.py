"""Which ``model`` names ``kvstore serve`` answers, and what ``GET /v1/models`` lists.

mlx_lm.server loads whatever a request's ``model`` names: a name that is not the served
path (nor its alias ``default_model``) is looked up as a local directory, then on the
Hugging Face hub, so a client configured with a short id (``tiny``, ``gpt-4o``) gets a 404
whose body is a hub connection error, after a network call made on the user's behalf.
kvstore serve serves one model: every request runs on it whatever its ``model`` says
(the name is echoed back in the answer, as the client sent it) and nothing is ever looked
up on a hub or the network for a request. ``--served-model-name NAME`` (repeatable) sets
the ids ``GET /v1/models`` lists (default: the ``--model`` value); ``--strict-model-names``
answers a request naming another model with a 404 listing the served ones.

The other body fields mlx_lm.server hands to ``ModelProvider.load`` (``PINNED``:
``draft_model``, ``adapters``) would load a model too: a hub repo id was looked up, a local
directory was loaded as a draft model and the server then died of SIGSEGV. Each is pinned
to the value the server was started with (``--draft-model``, ``--adapter-path``): a body
may leave it out, send null, or name that value (or ``default_model``, draft_model only)
and is served with what was started; any other value is a 400 naming the field
(``pinned_refusal``), before anything runs. Whatever a body says, the generation arguments
name the started model, draft model and adapters only (``on_served_model``), so nothing in
a body loads a model.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence, cast

from . import anthropic, tenants
from .http import body_of, send_json
from ..escape import visible

ALIAS = "default_model"  # mlx_lm.server's own name for the --model it was started with
# body field mlx_lm.server passes to ModelProvider.load -> (its cli_args attribute, the flag)
PINNED = {"draft_model": ("draft_model", "--draft-model"), "adapters": ("adapter_path", "--adapter-path")}
_SHOWN = 120  # characters of a refused value the error message repeats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model names")
    g.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="a model id GET /v1/models lists (repeatable; default: the --model value). Requests "
                        "naming any model are served by the one model loaded, unless --strict-model-names")
    g.add_argument("--strict-model-names", action="store_true",
                   help="answer a request whose model is not a served name (nor default_model) with a 404 "
                        "that lists the served names, instead of serving it with the loaded model")


def served(cli_args: Any, names: Sequence[str] = ()) -> list[str]:
    """The ids ``GET /v1/models`` lists: ``names`` (``--served-model-name``s), else the
    ``--model`` value."""
    if names:
        return list(names)
    model = getattr(cli_args, "model", None)
    return [model] if model else []


def refusal(name: Any, cli_args: Any, names: Sequence[str] = (), strict: bool = False) -> str | None:
    """Why a request naming ``name`` is refused (None: it is served). Only when ``strict``
    (``--strict-model-names``); a request without a ``model`` is always served."""
    if not strict or name is None or name == ALIAS:
        return None
    served_names = served(cli_args, names)
    if name in served_names:
        return None
    return (f"model {name!r} is not served here (--strict-model-names); the served models are: "
            f"{', '.join(repr(n) for n in served_names)} (GET /v1/models)")


def pinned_refusal(body: Any, cli_args: Any) -> tuple[str, str] | None:
    """(the field, why) for the first ``PINNED`` field of ``body`` that names something
    other than what the server was started with; None when every one is absent, null,
    ``default_model`` (draft_model only: mlx_lm.server's name for the started one) or the
    started value itself."""
    if not isinstance(body, dict):
        return None
    for name, (attr, flag) in PINNED.items():
        value = body.get(name)
        started = getattr(cli_args, attr, None)
        if value is None or (name == "draft_model" and value == ALIAS) or (started is not None and value == started):
            continue
        text = repr(value)
        shown = visible(text[:_SHOWN] + ("..." if len(text) > _SHOWN else ""), newlines=False)
        serves = f"{started!r} ({flag})" if started is not None else f"none (it was started without {flag})"
        return name, (f"{name} {shown} is not served here: kvstore serve never loads a model a request names; "
                      f"its {name} is {serves}. Leave {name} out (or null)")
    return None


def refused(path: str, name: str, message: str) -> dict[str, Any]:
    """A 400 body for a refused ``PINNED`` field ``name``, in the shape of ``path``'s API."""
    return tenants.error_body(path, 400, message, param=name, code="unsupported_parameter")


def not_found(path: str, message: str) -> dict[str, Any]:
    """A 404 body for an unknown model, in the shape of ``path``'s API."""
    if tenants.is_anthropic(path):
        return anthropic.error_body(404, message)
    return {"error": {"message": message, "type": "invalid_request_error", "param": "model",
                      "code": "model_not_found"}}


def check(handler: Any, names: Sequence[str], strict: bool) -> bool:
    """A POST's pinned fields and (``strict``) its model name, checked before any route
    runs: False when it was answered here (400 for a ``PINNED`` field naming something
    else, 404 for a name not served)."""
    body = body_of(handler)  # the body admitted once (kvstore.serve.http)
    cli_args = handler.response_generator.cli_args
    path = handler.path.split("?")[0]
    pinned = pinned_refusal(body, cli_args)
    if pinned is not None:  # a draft model or adapters other than the started ones
        send_json(handler, 400, refused(path, *pinned))
        return False
    why = refusal(body.get("model") if isinstance(body, dict) else None, cli_args, names, strict)
    if why is not None:
        send_json(handler, 404, not_found(path, why))
        return False
    return True


def on_served_model(args: Any, cli_args: Any) -> Any:
    """``args`` (mlx_lm.server's GenerationArguments) with the model ``default_model``,
    which mlx_lm.server maps to the loaded ``--model``: the model key stays the loaded one,
    so nothing is loaded, and requests under different names batch together. The draft
    model is always ``default_model`` (the started ``--draft-model``, or none) and the
    adapters the started ``--adapter-path``, whatever the body said (``PINNED``)."""
    described = getattr(args, "model", None)
    if not dataclasses.is_dataclass(args) or not dataclasses.is_dataclass(described):
        return args
    pinned: dict[str, Any] = {"draft": ALIAS, "adapter": getattr(cli_args, "adapter_path", None)}
    if getattr(cli_args, "model", None) is not None:  # no --model: mlx_lm.server loads the model named
        pinned["model"] = ALIAS
    if all(getattr(described, k, None) == v for k, v in pinned.items()):
        return args
    return dataclasses.replace(cast(Any, args), model=dataclasses.replace(cast(Any, described), **pinned))
