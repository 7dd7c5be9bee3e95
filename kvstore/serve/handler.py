"""kvstore serve's HTTP handler: a subclass of mlx_lm.server's ``APIHandler`` with one route
table (``GET_ROUTES``, ``POST_ROUTES``, ``DELETE_ROUTES``; HEAD: every GET route).

mlx_lm.server builds it by name (``APIHandler(response_generator, *args, ...)``, in its
HTTP server or a test), so it takes mlx-lm's constructor arguments; ``config`` (the
server's ``ServeConfig``) and ``served`` (what the server holds: its prompt caches, stored
responses, metrics) are class attributes of the subclass ``server.patch`` names (defaults:
every option off, nothing held). Every request
- is admitted once its headers are read (``parse_request``: its key, its body read and
  parsed once, at most ``--max-body-bytes``, its salt: ``tenants.admit``), and gets a
  ``RequestContext`` that rides with it to the generation thread (``context``);
- a POST: its pinned fields and model name checked first (``model_names.check``), then
  its route: kvstore's (``/v1/messages[/count_tokens]``, ``/v1/responses``) or
  mlx-lm's own, whose generation fields are checked first (``gen_args``: a 400 naming the
  field) and whose exception before a byte of its answer is a 500 with a JSON body;
- a GET: ``/health`` (503 ``starting`` while the start runs: ``startup``),
  ``/v1/cache/stats``, ``/metrics``, ``/openapi.json``, ``/v1/models[/ID]`` (the served
  names: ``model_names``), ``/v1/responses/{id}``, else mlx-lm's own; HEAD answers every GET
  route without its body (unknown paths: 404, where mlx-lm answers 501);
- a DELETE: ``/v1/responses/{id}``, else a 404.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, cast
from urllib.parse import parse_qs, unquote, urlsplit

from mlx_lm.server import APIHandler as MlxAPIHandler

from .. import metrics
from ..escape import logger
from . import anthropic, gen_args, http, model_names, openapi, responses, startup, tenants
from .config import ServeConfig
from .context import RequestContext, RequestView
from .http import HeadersOnly, send_json

log = logger("kvstore")
MLX_LM_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions"})  # its do_POST's
Route = Callable[[Any], None]


@dataclass
class Served:
    """What one server holds beside its config: its prompt caches (appended as mlx_lm.server
    makes them: ``server.bind_prompt_cache``), its stored responses (beside the first one's
    disk tier) and its metrics registry (read from the first one's stats)."""

    stores: list[Any] = field(default_factory=list)
    responses: responses.Stored = field(default_factory=responses.Stored)
    metrics: Any = None

    @classmethod
    def of(cls, config: ServeConfig, stores: list[Any] | None = None) -> Served:
        held: list[Any] = [] if stores is None else stores
        return cls(held, responses.Stored(lambda: held[0].store.disk if held else None,
                                          max_count=config.responses_max_count,
                                          max_bytes=config.responses_max_bytes),
                   metrics.registry(lambda: held[0].stats() if held else None))


class Handler(MlxAPIHandler):
    """mlx_lm.server's ``APIHandler`` with kvstore's routes (module docstring)."""

    config: ServeConfig = ServeConfig()
    served: Served = Served()

    def __init__(self, response_generator: Any, *args: Any, **kwargs: Any) -> None:
        self.generator = response_generator  # the server's; each request sees it through a RequestView
        self.context = RequestContext()
        super().__init__(response_generator, *args, **kwargs)

    def parse_request(self) -> bool:
        self.context = RequestContext()
        self.response_generator = cast(Any, RequestView(self.generator, self.context))
        if not super().parse_request():
            return False
        ok, self.context.salt = tenants.admit(self, self.config.policy, self.config.max_body_bytes)
        return ok

    def do_GET(self) -> None:
        _route(GET_ROUTES, self, MlxAPIHandler.do_GET)

    def do_HEAD(self) -> None:  # every GET route, headers only (Claude Code sends HEAD / first)
        real = self.wfile
        self.wfile = cast(Any, HeadersOnly(real))
        try:
            self.do_GET()
        finally:
            self.wfile = real

    def do_DELETE(self) -> None:
        _route(DELETE_ROUTES, self, _no_route)

    def do_POST(self) -> None:
        if model_names.check(self, self.config.served_names, self.config.strict_model_names):
            _route(POST_ROUTES, self, mlx_post)


def _route(table: dict[str, Route], handler: Any, otherwise: Route) -> None:
    """``table``'s route for the request's path (an exact path, else the longest key ending
    in "/" that the path starts with), else ``otherwise``."""
    path = handler.path.split("?")[0]
    got = table.get(path)
    if got is None:
        got = next((r for p, r in sorted(table.items(), key=lambda pr: -len(pr[0]))
                    if p.endswith("/") and path.startswith(p)), None)
    (got or otherwise)(handler)


def mlx_post(handler: Any) -> None:
    """mlx_lm.server's ``do_POST``, its body's generation fields checked first (``gen_args``:
    a 400 in the route's shape), and what it raises before a byte of its answer is sent (a
    non-streamed completion whose generation failed: mlx-lm let the exception end the
    connection with no answer) answered as a 500 with a JSON error body. Once its answer
    began (a stream), the exception goes on: the connection ends there. What kvstore's
    translated routes run their chat body through (``chat_route.run_chat``)."""
    path = handler.path.split("?")[0]
    if path in MLX_LM_ROUTES:
        try:
            gen_args.check(path, http.route_body(handler), gen_args.vocab_size(handler.response_generator.model_provider))
        except http.BodyError as e:
            send_json(handler, e.status, tenants.error_body(path, e.status, str(e), param=e.param, code=e.code))
            return
    real = handler.wfile
    handler.wfile = written = http.Written(real)
    try:
        MlxAPIHandler.do_POST(handler)
    except Exception as e:
        if written.count:
            raise
        log.exception("kvstore: %s failed before answering", path)
        handler._headers_buffer = []  # the status line mlx-lm buffered, never sent
        handler.wfile = real
        send_json(handler, 500, tenants.error_body(handler.path, 500, f"generation failed: {type(e).__name__}: {e}"))
    finally:
        handler.wfile = real


# -- the routes ---------------------------------------------------------------------------


def health(handler: Any) -> None:
    """``GET /health``: mlx_lm.server's; 503 while kvstore serve starts (``startup``)."""
    send_json(handler, *startup.health(handler.response_generator))


def caller_salt(handler: Any) -> Any:
    """The salt whose lookups a ``GET /v1/cache/stats`` counts (``kvstore.callers``): the
    caller's key's under ``--isolate-keys``, with the query's ``?cache_salt=`` (as a body's
    would be); None reads the unsalted lookups. SaltError for a bad ``cache_salt``."""
    query = parse_qs(urlsplit(handler.path).query)
    body = {"cache_salt": query["cache_salt"][0]} if "cache_salt" in query else {}
    return tenants.request_salt(body, tenants.presented_key(handler.headers), handler.config.policy)


def cache_stats(served: Served, salt: Any = None) -> dict[str, Any]:
    """``GET /v1/cache/stats``: the prompt cache's counters (``KVStore.stats``: with
    ``salt``, its lookups' counts) and, under ``"startup"``, where ``kvstore serve``'s start
    is (``startup.startup_stats``), and under ``"responses"`` the stored responses'
    counters (``responses.Stored.stats``): only to an unsalted caller, since they count
    every tenant's responses (a salted caller sees its own lookups and nothing of others')."""
    out: dict[str, Any] = served.stores[0].stats(salt) if served.stores else {}
    if salt is None:
        out["responses"] = served.responses.stats()  # stored /v1/responses: invalid records, not stored, evicted
    start = startup.startup_stats()
    if start:
        out["startup"] = start
    return out


def stats(handler: Any) -> None:
    """``GET /v1/cache/stats`` (``cache_stats``), 400 for a bad ``?cache_salt=``."""
    try:
        salt = caller_salt(handler)
    except ValueError as e:  # salt.SaltError: a bad ?cache_salt=
        send_json(handler, 400, {"error": {"message": str(e), "type": "invalid_request_error",
                                           "param": "cache_salt", "code": "invalid_cache_salt"}})
        return
    out = cache_stats(handler.served, salt)
    learned = getattr(handler.response_generator, "learned_spans", None)
    if callable(learned):  # the caller's salt's learned spans only: a tenant sees its own
        out["stable_prefix"] = {"learned_spans": learned(salt)}
    send_json(handler, 200, out)


def prometheus(handler: Any) -> None:
    """``GET /metrics``: Prometheus text format, read from the same stats (``kvstore.metrics``)."""
    body, ctype = metrics.exposition(handler.served.metrics)
    handler.send_response(200)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def openapi_document(handler: Any) -> None:
    """``GET /openapi.json``: every route's description (``kvstore.serve.openapi``)."""
    send_json(handler, 200, openapi.document())


def models(handler: Any) -> None:
    """``GET /v1/models`` (a list) or ``GET /v1/models/ID`` (one model, 404 if not served):
    503 while the start runs; mlx_lm.server's own when nothing names a served model."""
    if startup.STATE.installed and not startup.STATE.ready.is_set():
        send_json(handler, 503, startup.not_ready_error())
        return
    ids = model_names.served(handler.response_generator.cli_args, handler.config.served_names)
    if not ids:
        MlxAPIHandler.do_GET(handler)
        return
    path = handler.path.split("?")[0]
    card = {i: {"id": i, "object": "model", "created": handler.created, "owned_by": "kvstore"} for i in ids}
    wanted = unquote(path[len("/v1/models"):].lstrip("/"))
    if not wanted:
        send_json(handler, 200, {"object": "list", "data": list(card.values())})
    elif wanted in card or "/" + wanted in card:
        send_json(handler, 200, card.get(wanted) or card["/" + wanted])
    else:
        send_json(handler, 404, model_names.not_found(
            path, f"model {wanted!r} is not served here; GET /v1/models lists the models that are"))


def stored_response(handler: Any) -> None:
    """``GET`` / ``DELETE /v1/responses/{id}`` (``responses.handle_get_or_delete``)."""
    responses.handle_get_or_delete(handler, handler.served.responses, handler.config.policy)


def messages(handler: Any) -> None:
    """``POST /v1/messages[/count_tokens]``: the Anthropic Messages API (``anthropic``)."""
    anthropic.handle(handler, mlx_post, handler.config.keep_billing_header)


def responses_post(handler: Any) -> None:
    """``POST /v1/responses``: the OpenAI Responses API (``responses``)."""
    responses.handle_post(handler, mlx_post, handler.served.responses, handler.context.salt)


def _no_route(handler: Any) -> None:
    send_json(handler, 404, responses.error_body(f"no route {handler.command} {handler.path.split('?')[0]}"))


GET_ROUTES: dict[str, Route] = {
    "/health": health,
    "/v1/cache/stats": stats,
    "/metrics": prometheus,
    "/openapi.json": openapi_document,
    "/v1/models": models,
    "/v1/models/": models,
    responses.PATH + "/": stored_response,
}
POST_ROUTES: dict[str, Route] = {
    anthropic.MESSAGES: messages,
    anthropic.COUNT: messages,
    responses.PATH: responses_post,
}
DELETE_ROUTES: dict[str, Route] = {responses.PATH + "/": stored_response}
