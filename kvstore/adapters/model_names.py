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
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, cast

from . import anthropic, tenants
from .http import body_of, send_json

ALIAS = "default_model"  # mlx_lm.server's own name for the --model it was started with
NAMES: list[str] = []  # --served-model-name, in order
STRICT = False  # --strict-model-names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model names")
    g.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="a model id GET /v1/models lists (repeatable; default: the --model value). Requests "
                        "naming any model are served by the one model loaded, unless --strict-model-names")
    g.add_argument("--strict-model-names", action="store_true",
                   help="answer a request whose model is not a served name (nor default_model) with a 404 "
                        "that lists the served names, instead of serving it with the loaded model")


def configure(ours: argparse.Namespace) -> None:
    global STRICT
    NAMES[:] = [n for n in ours.served_model_name if n]
    STRICT = bool(ours.strict_model_names)


def served(cli_args: Any) -> list[str]:
    """The ids ``GET /v1/models`` lists: ``--served-model-name``s, else the ``--model`` value."""
    if NAMES:
        return list(NAMES)
    model = getattr(cli_args, "model", None)
    return [model] if model else []


def refusal(name: Any, cli_args: Any) -> str | None:
    """Why a request naming ``name`` is refused (None: it is served). Only under
    ``--strict-model-names``; a request without a ``model`` is always served."""
    if not STRICT or name is None or name == ALIAS:
        return None
    names = served(cli_args)
    if name in names:
        return None
    return (f"model {name!r} is not served here (--strict-model-names); the served models are: "
            f"{', '.join(repr(n) for n in names)} (GET /v1/models)")


def not_found(path: str, message: str) -> dict[str, Any]:
    """A 404 body for an unknown model, in the shape of ``path``'s API."""
    if tenants.is_anthropic(path):
        return anthropic.error_body(404, message)
    return {"error": {"message": message, "type": "invalid_request_error", "param": "model",
                      "code": "model_not_found"}}


def install(server_mod: Any) -> None:
    """Serve every request of ``server_mod`` (mlx_lm.server) with the loaded model (its
    generation arguments name ``default_model`` whatever the request said) and, under
    ``STRICT``, refuse other names before anything runs. Idempotent."""
    handler, generator = server_mod.APIHandler, server_mod.ResponseGenerator
    if getattr(generator, "_kvstore_model_names", False):
        return
    generate = generator.generate

    def generate_served(self: Any, request: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        cli_args = getattr(getattr(self, "model_provider", None), "cli_args", None)
        return generate(self, request, _on_served_model(args, cli_args), *rest, **kwargs)

    post = handler.do_POST

    def do_POST(self: Any) -> None:
        if STRICT:
            body = body_of(self)  # the body admitted once (kvstore.adapters.http)
            why = refusal(body.get("model") if isinstance(body, dict) else None, self.response_generator.cli_args)
            if why is not None:
                send_json(self, 404, not_found(self.path.split("?")[0], why))
                return
        post(self)

    generator.generate = generate_served
    handler.do_POST = do_POST
    generator._kvstore_model_names = True


def _on_served_model(args: Any, cli_args: Any) -> Any:
    """``args`` (mlx_lm.server's GenerationArguments) with the model ``default_model``,
    which mlx_lm.server maps to the loaded ``--model``: the model key stays the loaded one,
    so nothing is loaded, and requests under different names batch together."""
    described = getattr(args, "model", None)
    if getattr(cli_args, "model", None) is None or getattr(described, "model", ALIAS) == ALIAS:
        return args  # no --model: mlx_lm.server's own behaviour (it loads what is named)
    if not dataclasses.is_dataclass(args) or not dataclasses.is_dataclass(described):
        return args
    return dataclasses.replace(cast(Any, args), model=dataclasses.replace(cast(Any, described), model=ALIAS))
