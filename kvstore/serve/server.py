"""``kvstore serve``: mlx-lm's own OpenAI-compatible server with kvstore as its prompt cache.

No mlx-lm file is edited. Before ``mlx_lm.server.main()`` runs, this module
- replaces ``mlx_lm.server.LRUPromptCache`` (which ``run()`` instantiates) with a subclass
  of kvstore's drop-in bound to the cache directory and budgets given here, told the KV
  quantisation by mlx_lm.server's own ``ResponseGenerator`` (``patch``),
- wraps ``APIHandler.do_GET`` to answer ``GET /health`` exactly as mlx_lm.server does once
  ready (503 ``{"status": "starting"}`` before: ``kvstore.serve.startup``),
  ``GET /v1/cache/stats`` with the store's counters and the start's progress, and
  ``GET /v1/models[/ID]`` with the model it serves, named as in its responses (the
  ``--model`` value, or ``--served-model-name``s; any name is served: ``model_names``). mlx_lm.server lists the Hugging Face hub cache there instead, and
  answers 200 with an empty body when that cache does not exist (the status line is sent
  before the scan raises); requesting the resolved path it lists would also reload the model,
- leaves ``usage.prompt_tokens_details.cached_tokens`` to mlx_lm.server (0.31 and 0.32
  report it, streamed usage included: the prompt tokens the prompt cache restored),
- turns SIGTERM into the KeyboardInterrupt mlx-lm already handles (``httpd.shutdown()``),
  then closes the store, which flushes the write-behind queue before the process exits,
- answers ``HEAD`` for every GET route as GET does, without the body (unknown paths: 404;
  mlx_lm.server answers 501), and ``GET /openapi.json`` with every route's description
  (``kvstore.serve.openapi``),
- checks what mlx_lm.server's generation thread would run unchecked before its chat and
  text completions run (``kvstore.serve.gen_args``: a 400 naming the field), and answers
  an exception its handler raises before a byte of the answer as a 500 with a JSON body,
- routes ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (the Anthropic Messages
  API) through mlx_lm.server's own chat handler (``kvstore.serve.anthropic``), and
  ``POST /v1/responses`` (the OpenAI Responses API) with its stored responses
  (``GET`` / ``DELETE /v1/responses/{id}``) the same way (``kvstore.serve.responses``),
- makes SIGUSR1 print every thread's Python stack to stderr, so a server that stops
  answering can be looked into without stopping it; SIGUSR2 does the same from the
  signal itself, for a process whose Python no longer runs at all (see ``_dump_stacks``).
Every other flag is mlx_lm.server's own and passed through unchanged.
"""

from __future__ import annotations

import argparse
import errno
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from .. import metrics
from ..floors import MIN_DISK_HIT
from ..pressure import DEFAULT_MEMORY_FLOOR
from ..units import count, memory_floor, milliseconds, parse_size, positive_seconds
from . import (anthropic, gen_args, http, model_names, openapi, prompts, rendered, responses, stable_prefix, startup,
               system_render, tenants)
from .http import HeadersOnly, send_json
from ..escape import logger

if TYPE_CHECKING:  # imported when used: MLX and mlx-lm take seconds, --help and a refused start need neither
    from ..adapters.mlx_lm import LRUPromptCache

log = logger("kvstore")
_STORES: list[LRUPromptCache] = []
MLX_LM_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions"})  # its do_POST's
_METRICS = metrics.registry(lambda: _STORES[0].stats() if _STORES else None)


def bind_prompt_cache(**options: Any) -> type[LRUPromptCache]:
    """A ``LRUPromptCache`` class whose constructor takes mlx-lm's arguments only and adds
    ``options`` (cache_dir, max_disk_bytes, ...): what an engine instantiates itself."""
    from ..adapters.mlx_lm import LRUPromptCache

    class BoundPromptCache(LRUPromptCache):
        def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63) -> None:
            super().__init__(max_size, max_bytes, **options)
            _STORES.append(self)

    return BoundPromptCache


def served_models(cli_args: Any) -> list[str]:
    """Model ids ``GET /v1/models`` lists: ``--served-model-name``s, else the ``--model`` value
    as given (``kvstore.serve.model_names``: any other name is served by the same model)."""
    return model_names.served(cli_args)


def _models(handler: Any, path: str) -> None:
    """``GET /v1/models`` (a list) or ``GET /v1/models/ID`` (one model, 404 if not served)."""
    ids = served_models(handler.response_generator.cli_args)
    card = {i: {"id": i, "object": "model", "created": handler.created, "owned_by": "kvstore"} for i in ids}
    wanted = unquote(path[len("/v1/models"):].lstrip("/"))
    if not wanted:
        send_json(handler, 200, {"object": "list", "data": list(card.values())})
    elif wanted in card or "/" + wanted in card:
        send_json(handler, 200, card.get(wanted) or card["/" + wanted])
    else:
        send_json(handler, 404, model_names.not_found(
            path, f"model {wanted!r} is not served here; GET /v1/models lists the models that are"))


def _install_routes(server_mod: Any) -> None:
    handler = server_mod.APIHandler
    if getattr(handler, "_kvstore_patched", False):
        return
    original = handler.do_GET

    def do_GET(self: Any) -> None:
        path = self.path.split("?")[0]
        models = path == "/v1/models" or path.startswith("/v1/models/")
        if path == "/health":  # mlx_lm.server's; 503 while kvstore serve starts (kvstore.serve.startup)
            send_json(self, *startup.health(self.response_generator))
        elif models and startup.STATE.installed and not startup.STATE.ready.is_set():
            send_json(self, 503, startup.not_ready_error())
        elif path == "/v1/cache/stats":
            try:
                salt = caller_salt(self)
            except ValueError as e:  # salt.SaltError: a bad ?cache_salt=
                send_json(self, 400, {"error": {"message": str(e), "type": "invalid_request_error",
                                                "param": "cache_salt", "code": "invalid_cache_salt"}})
                return
            send_json(self, 200, cache_stats(salt))
        elif path == "/metrics":  # Prometheus text format, read from the same stats (kvstore.metrics)
            body, ctype = metrics.exposition(_METRICS)
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif path == "/openapi.json":  # every route's description (kvstore.serve.openapi)
            send_json(self, 200, openapi.document())
        elif models and served_models(self.response_generator.cli_args):
            _models(self, path)
        else:
            original(self)

    def do_HEAD(self: Any) -> None:  # every GET route, headers only (Claude Code sends HEAD / first)
        real = self.wfile
        self.wfile = HeadersOnly(real)
        try:
            self.do_GET()
        finally:
            self.wfile = real

    handler.do_GET = do_GET
    handler.do_HEAD = do_HEAD
    handler.do_POST = _answered(handler.do_POST)
    handler._kvstore_patched = True
    anthropic.install(server_mod)  # POST /v1/messages[/count_tokens]
    responses.install(server_mod)  # POST /v1/responses, GET / DELETE /v1/responses/{id}


def _answered(post: Any) -> Any:
    """mlx_lm.server's ``do_POST``, its body's generation fields checked first
    (``gen_args``: a 400 in the route's shape), and what it raises before a byte of its
    answer is sent (a non-streamed completion whose generation failed: mlx-lm let the
    exception end the connection with no answer) answered as a 500 with a JSON error body.
    Once its answer began (a stream), the exception goes on: the connection ends there."""

    def do_POST(self: Any) -> None:
        path = self.path.split("?")[0]
        if path in MLX_LM_ROUTES:
            try:
                gen_args.check(path, http.route_body(self), gen_args.vocab_size(self.response_generator.model_provider))
            except http.BodyError as e:
                send_json(self, e.status, tenants.error_body(path, e.status, str(e), param=e.param, code=e.code))
                return
        real = self.wfile
        self.wfile = written = http.Written(real)
        try:
            post(self)
        except Exception as e:
            if written.count:
                raise
            log.exception("kvstore: %s failed before answering", self.path.split("?")[0])
            self._headers_buffer = []  # the status line mlx-lm buffered, never sent
            self.wfile = real
            send_json(self, 500, tenants.error_body(self.path, 500, f"generation failed: {type(e).__name__}: {e}"))
        finally:
            self.wfile = real

    return do_POST


def caller_salt(handler: Any) -> Any:
    """The salt whose lookups a ``GET /v1/cache/stats`` counts (``kvstore.callers``): the
    caller's key's under ``--isolate-keys``, with the query's ``?cache_salt=`` (as a body's
    would be); None reads the unsalted lookups. SaltError for a bad ``cache_salt``."""
    query = parse_qs(urlsplit(handler.path).query)
    body = {"cache_salt": query["cache_salt"][0]} if "cache_salt" in query else {}
    return tenants.request_salt(body, tenants.presented_key(handler.headers))


def cache_stats(salt: Any = None) -> dict[str, Any]:
    """``GET /v1/cache/stats``: the prompt cache's counters (``KVStore.stats``: with
    ``salt``, its lookups' counts) and, under ``"startup"``, where ``kvstore serve``'s start
    is (``startup.startup_stats``), and under ``"responses"`` the stored responses'
    counters (``responses.stats``): only to an unsalted caller, since they count every
    tenant's responses (a salted caller sees its own lookups and nothing of others')."""
    out: dict[str, Any] = _STORES[0].stats(salt) if _STORES else {}
    if salt is None:
        out["responses"] = responses.stats()  # stored /v1/responses: invalid records, not stored, evicted
    start = startup.startup_stats()
    if start:
        out["startup"] = start
    return out


def patch(server_mod: Any, **options: Any) -> None:
    """Make ``server_mod`` (mlx_lm.server) kvstore's server: its ``LRUPromptCache`` bound to
    ``options`` (``LRUPromptCache``'s keywords: cache_dir, ...), kvstore's routes, and a
    ``ResponseGenerator`` that tells a kvstore prompt cache the server's KV quantisation
    (``--kv-bits`` / ``--kv-group-size``: entries of a quantising server get their own
    identity, so a plain cache is never handed to it, nor the reverse). What ``main`` does
    before running it; an engine running mlx_lm.server in-process calls it."""
    server_mod.LRUPromptCache = bind_prompt_cache(**options)
    _install_routes(server_mod)
    model_names.install(server_mod)  # any model name answers, never a hub lookup (--strict-model-names)
    _learn_kv_quant(server_mod)
    system_render.install(server_mod)  # innermost: mlx-lm's system-prompt probe rendered once per system prompt
    rendered.install(server_mod)  # names a miss's part of the request (kvstore.parts)
    tenants.install(server_mod)  # keys and cache_salt, for every route (kvstore.serve.tenants)
    prompts.install_tool_sorting(server_mod)  # --sort-tools (kvstore.serve.prompts)
    stable_prefix.install(server_mod)  # outermost: --stable-prefix (kvstore.serve.stable_prefix)


def _learn_kv_quant(server_mod: Any) -> None:
    """Also hands the prompt cache the server's tokenizer (``LRUPromptCache.decode``): the
    text of a miss's log line (``kvstore.misses.log_line``)."""
    generator = server_mod.ResponseGenerator
    if getattr(generator, "_kvstore_patched", False):
        return
    original = generator.__init__
    from ..adapters.mlx_lm import LRUPromptCache

    def __init__(self: Any, model_provider: Any, prompt_cache: Any, *args: Any, **kwargs: Any) -> None:
        cli = getattr(model_provider, "cli_args", None)
        if isinstance(prompt_cache, LRUPromptCache) and cli is not None:  # before its thread starts
            prompt_cache.store.set_kv_quant(getattr(cli, "kv_bits", None), getattr(cli, "kv_group_size", 64))
        if isinstance(prompt_cache, LRUPromptCache):
            prompt_cache.decode = _decoder(model_provider)
            prompt_cache.name_part = rendered.namer
            prompt_cache.miss_note = stable_prefix.note  # what --stable-prefix moved
        original(self, model_provider, prompt_cache, *args, **kwargs)

    generator.__init__ = __init__
    generator._kvstore_patched = True


def _decoder(model_provider: Any) -> Any:
    """Token ids to text with the tokenizer ``model_provider`` has loaded (it loads the
    model before the first request: a miss is only ever decoded after)."""
    def decode(ids: list[int]) -> str:
        return str(model_provider.tokenizer.decode(ids))
    return decode


def _sigterm(signum: int, frame: Any) -> None:
    # once: a second SIGTERM must not interrupt the flush the first one started
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    startup.STATE.stop.set()  # a preload under way stops after its current entry
    raise KeyboardInterrupt


def setup_arg_parser(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("kvstore")
    g.add_argument("--cache-dir", help="kvstore cache directory (default: $KVSTORE_DIR or the user cache dir)")
    g.add_argument("--max-disk-bytes", type=parse_size, default=None, help="disk budget, e.g. 20G (LRU eviction)")
    g.add_argument("--chunk-tokens", type=int, default=256, help="tokens per stored chunk (default 256)")
    g.add_argument("--min-disk-hit", type=_tokens, default=MIN_DISK_HIT, metavar="TOKENS",
                   help=f"the fewest tokens a disk or shared hit must restore when memory holds none of the "
                        f"prompt, unless it holds the whole prompt (default {MIN_DISK_HIT}: a prompt sharing "
                        f"only a chat template's header with a stored one is a miss; 0: any shared prefix)")
    g.add_argument("--write-queue", type=int, default=16, help="write-behind queue length (default 16)")
    g.add_argument("--persist", choices=("all", "system", "reused"), default="all",
                   help="what is written to disk: every new prefix (all, the default), system prompts and "
                        "pinned entries only (system), or a prefix seen a second time (reused)")
    g.add_argument("--max-body-bytes", type=parse_size, default=http.MAX_BODY_BYTES, metavar="SIZE",
                   help="refuse request bodies larger than this (413, in the API's own error shape, before any of "
                        "the body is read), e.g. 64M (default 32M, Anthropic's own limit): a body is parsed whole "
                        "and count_tokens holds ~250x its text while tokenizing it")
    g.add_argument("--max-write-bytes-per-day", type=parse_size, default=None, metavar="BYTES",
                   help="stop writing to disk once this many bytes were written today (UTC), e.g. 20G; "
                        "resumes the next day")
    g.add_argument("--memory-floor", type=memory_floor, default=DEFAULT_MEMORY_FLOOR, metavar="FRACTION|SIZE",
                   help="memory the prompt cache's memory tier leaves free, as a fraction of the machine's (or "
                        "container's) memory or a size (default 0.2; 0: a fixed budget). The tier grows while "
                        "memory is free and gives it back, writing entries to disk first, when it is not; "
                        "--prompt-cache-bytes stays a hard cap")
    g.add_argument("--shared", metavar="URL", default=None,
                   help="shared tier behind the disk: redis://[user:pass@]host:port/db, rediss://, "
                        "redis+cluster://h1:p1,h2:p2 (default: $KVSTORE_SHARED)")
    g.add_argument("--shared-prefix", metavar="P", default=None, help="key prefix in the shared tier (default kvstore)")
    g.add_argument("--shared-ttl", metavar="SECONDS", type=positive_seconds, default=None,
                   help="expire shared values after this long (default: never; use maxmemory + allkeys-lru)")
    g.add_argument("--shared-timeout", metavar="MS", type=milliseconds, default=None,
                   help="per-command timeout of the shared tier in milliseconds (default 100)")
    g.add_argument("--shared-secret-file", metavar="FILE", default=None,
                   help="fleet secret (>= 16 bytes) signing every shared value; values without a valid "
                        "signature are rejected (default: $KVSTORE_SHARED_SECRET[_FILE])")
    g.add_argument("--keep-billing-header", action="store_true",
                   help="/v1/messages: keep Claude Code's per-request x-anthropic-billing-header system text "
                        "in the prompt (by default it is left out: it changes every request and would defeat "
                        "every cached prefix)")
    g.add_argument("--responses-max-count", type=count, default=responses.DEFAULT_MAX_COUNT, metavar="N",
                   help=f"/v1/responses: keep at most N stored responses in the cache directory, the oldest "
                        f"removed first (default {responses.DEFAULT_MAX_COUNT})")
    g.add_argument("--responses-max-bytes", type=parse_size, default=responses.DEFAULT_MAX_BYTES, metavar="BYTES",
                   help=f"/v1/responses: keep at most this many bytes of stored responses, e.g. 256M "
                        f"(default {responses.DEFAULT_MAX_BYTES >> 20}M)")
    g.add_argument("--sort-tools", action="store_true",
                   help="sort tool definitions by name before the chat template renders them (/v1/chat/completions "
                        "and /v1/messages): clients listing the same tools in another order then share a cached "
                        "prefix; the model sees them sorted. Off by default")
    g.add_argument("--stable-prefix", action="store_true",
                   help="keep a session's volatile lines (Claude Code's date and git status, OpenCode's date) "
                        "at the values it began with, in place, and give changed values as an update before the "
                        "user turn that first saw them: a session resumed on another day or work tree still "
                        "reads its prompt from the cache; the model reads every current value. Off by default")
    g.add_argument("--volatile", action="append", default=[], metavar="REGEX",
                   help="another volatile span for --stable-prefix (a regular expression in RE2 syntax: Python's "
                        "without backreferences or lookaround, searched in linear time in the system and user "
                        "messages before the first assistant turn); repeatable; implies --stable-prefix")
    g.add_argument("--stable-prefix-max-count", type=count, default=stable_prefix.DEFAULT_MAX_COUNT, metavar="N",
                   help=f"--stable-prefix: keep at most N conversation records in the cache directory, the oldest "
                        f"removed first (default {stable_prefix.DEFAULT_MAX_COUNT})")
    g.add_argument("--stable-prefix-max-bytes", type=parse_size, default=stable_prefix.DEFAULT_MAX_BYTES,
                   metavar="BYTES",
                   help=f"--stable-prefix: keep at most this many bytes of records, e.g. 64M (default "
                        f"{stable_prefix.DEFAULT_MAX_BYTES >> 20}M; at most a quarter of --max-disk-bytes, in "
                        f"which they are counted)")


def main(argv: list[str] | None = None, *, exit_process: bool = True,
         progress: startup.ProgressFactory | None = None) -> int:
    """Run the server until SIGTERM / Ctrl-C, then flush and close the store.

    With ``exit_process`` (the default: this is a process entry point) a server that ran
    ends the process itself once the store is closed (see ``_exit_now``): status 0, or 1
    when it could not start or its HTTP loop failed (said on stderr; without
    ``exit_process`` that exception is raised). ``--help``, usage errors, a missing
    ``--model`` (2) and a port it cannot listen on (1, naming host:port) raise SystemExit
    before anything heavy is imported. ``progress``: the preload's progress-bar factory."""
    parser = argparse.ArgumentParser(
        prog="kvstore serve", add_help=False,  # -h / --help: ours, then mlx_lm.server's
        description="mlx_lm.server with a persistent kvstore prompt cache. --model is required; "
                    "every other mlx_lm.server flag is accepted (e.g. --host, --port).")
    setup_arg_parser(parser)
    startup.add_arguments(parser)
    tenants.add_arguments(parser)
    model_names.add_arguments(parser)
    ours, rest = parser.parse_known_args(argv)
    policy = tenants.policy_from(ours)  # a bad key flag ends the start before anything heavy
    try:
        stable_prefix.user_rules(ours.volatile)
    except ValueError as e:
        parser.error(str(e))
    if ours.stable_prefix_max_count < 1:
        parser.error(f"--stable-prefix-max-count {ours.stable_prefix_max_count}: keep at least 1 record")
    if "-h" in rest or "--help" in rest:
        g = parser.add_argument_group("the model and the address (mlx_lm.server's flags; the model is required)")
        g.add_argument("--model", metavar="DIR|REPO", help="the MLX model to serve: a local directory or a "
                       "Hugging Face repo id; kvstore keeps its prompt cache per model")
        g.add_argument("--host", help="address to listen on (default 127.0.0.1)")
        g.add_argument("--port", type=int, help="port to listen on (default 8080)")
        parser.print_help()
        print("\nmlx_lm.server flags:", flush=True)
        text = mlx_lm_help()
        if text is not None:  # read from its source: seconds of imports saved
            print(text, flush=True)
            return 0
        import mlx_lm.server

        sys.argv = ["mlx_lm.server", *rest]
        mlx_lm.server.main()  # prints its help and exits (SystemExit 0)
        return 0
    where = _listen_args(rest)  # checked before the seconds mlx-lm's import and model load take
    if not where.model:
        parser.error("--model is required: the MLX model to serve (a local directory or a Hugging Face "
                     "repo id), e.g. `kvstore serve --model mlx-community/Qwen3-0.6B-4bit`; kvstore keeps "
                     "its prompt cache per model, and warms up and preloads that model at start")
    problem = listen_problem(where.host, where.port)
    if problem:
        raise SystemExit(f"kvstore serve: error: {problem}")
    import mlx_lm.server as server_mod

    _install(server_mod, ours, rest, policy, progress)
    sys.argv = ["mlx_lm.server", *rest]
    code = 0
    try:
        server_mod.main()
    except KeyboardInterrupt:
        pass
    except Exception as e:  # it could not start (or its HTTP loop died): say why, and end
        code = 1
        why = (listen_problem(where.host, where.port, e)
               if isinstance(e, OSError) and e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)
               else None) or f"{type(e).__name__}: {e}"
        print(f"kvstore serve: error: {why}", file=sys.stderr, flush=True)
        if not exit_process:
            raise
    finally:
        startup.shutdown()
        for s in _STORES:
            s.close()
        log.info("kvstore: store flushed and closed")
    if exit_process:  # also when it failed: mlx-lm's generation thread (not a daemon) would keep it alive
        _exit_now(code)
    return code


def mlx_lm_help() -> str | None:
    """mlx_lm.server's ``--help``, rebuilt from the ``add_argument`` calls in its source
    without importing it (importing it loads transformers: seconds, 10+ on a busy machine,
    for a help text); None when its source cannot be read that way (then it is imported).
    Only literal arguments are kept: a help text never needs the types."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("mlx_lm")  # finds the package without running it
        origin = spec.origin if spec is not None else None
        if origin is None:
            return None
        tree = ast.parse(Path(origin).with_name("server.py").read_text())
        help_parser = argparse.ArgumentParser(prog="mlx_lm.server", add_help=False, usage=argparse.SUPPRESS)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags = [ast.literal_eval(a) for a in node.args]
                kw: dict[str, Any] = {}
                for k in node.keywords:
                    if k.arg in ("help", "action", "choices", "default", "metavar", "nargs", "required"):
                        try:
                            kw[k.arg] = ast.literal_eval(k.value)
                        except ValueError:  # a name, or an f-string (its text with the names in braces)
                            if k.arg == "help" and isinstance(k.value, ast.JoinedStr):
                                kw["help"] = "".join(str(v.value) if isinstance(v, ast.Constant) else
                                                     "{" + ast.unparse(getattr(v, "value", v)) + "}"
                                                     for v in k.value.values)
                help_parser.add_argument(*flags, **kw)
    except (OSError, SyntaxError, ValueError, TypeError, argparse.ArgumentError):
        return None
    if not help_parser._actions:
        return None
    return help_parser.format_help().strip("\n")


def _install(server_mod: Any, ours: argparse.Namespace, rest: list[str], policy: Any,
             progress: startup.ProgressFactory | None) -> None:
    """Everything kvstore adds to ``mlx_lm.server`` before its ``main()`` runs: the prompt
    cache with our flags, the callers' policy, the Anthropic routes, the start's phases and
    the signals (this process is the server's: the handlers are ours to set)."""
    options: dict[str, Any] = {
        "cache_dir": ours.cache_dir, "max_disk_bytes": ours.max_disk_bytes,
        "chunk_tokens": ours.chunk_tokens, "queue_size": ours.write_queue,
        "persist": ours.persist, "max_write_bytes_per_day": ours.max_write_bytes_per_day,
        "memory_floor": ours.memory_floor, "min_disk_hit": ours.min_disk_hit,
        "min_memory_hit": ours.min_disk_hit,  # one rule for every tier in the usage it reports
    }
    shared = shared_config(ours)
    if shared is not None:
        options["shared"] = shared
    patch(server_mod, **options)
    tenants.configure(policy)
    tenants.warn_if_exposed(tenants.host_of(rest), policy)
    anthropic.KEEP_BILLING_HEADER = ours.keep_billing_header
    http.MAX_BODY_BYTES = ours.max_body_bytes
    prompts.SORT_TOOLS = ours.sort_tools
    model_names.configure(ours)
    responses.configure(lambda: _STORES[0].store.disk if _STORES else None,
                        max_count=ours.responses_max_count, max_bytes=ours.responses_max_bytes)
    stable_prefix.configure(ours.stable_prefix, ours.volatile, max_count=ours.stable_prefix_max_count,
                            max_bytes=ours.stable_prefix_max_bytes)
    startup.install(server_mod, startup.options(ours), _STORES, progress)
    signal.signal(signal.SIGTERM, _sigterm)
    if hasattr(signal, "SIGUSR1"):  # POSIX (Linux, macOS)
        signal.signal(signal.SIGUSR1, _dump_stacks)
        faulthandler.register(signal.SIGUSR2, all_threads=True)


def _listen_args(rest: list[str]) -> argparse.Namespace:
    """mlx_lm.server's ``--model``, ``--host`` and ``--port`` in ``rest`` (its defaults:
    no model, 127.0.0.1, 8080); ``port`` None when it is not a number (mlx-lm says so)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", default="8080")
    ns, _ = p.parse_known_args(rest)
    ns.port = int(ns.port) if str(ns.port).isdigit() else None
    return ns


def listen_problem(host: str, port: int | None, error: OSError | None = None) -> str | None:
    """Why ``kvstore serve`` cannot listen on ``host:port`` (None: it can), naming both and
    what to do. Without ``error`` it binds a socket there as mlx_lm.server will (the first
    address ``getaddrinfo`` gives, ``SO_REUSEADDR``) and closes it: a port another process
    listens on fails here, before the model loads. The bind mlx_lm.server makes itself
    still decides (another process may take the port in between): its error comes back
    here as ``error``."""
    if port is None:
        return None
    if error is None:
        import socket

        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(address)
        except OSError as e:
            error = e
        else:
            return None
    why = getattr(error, "strerror", None) or str(error)
    hint = ("another process is listening there: stop it, or choose another port with --port"
            if getattr(error, "errno", None) == errno.EADDRINUSE else
            "check --host (an address of this machine, e.g. 127.0.0.1 or 0.0.0.0) and --port")
    return f"cannot listen on {host}:{port}: {why} ({hint})"


def _dump_stacks(signum: int, frame: Any) -> None:
    """SIGUSR1: every thread's Python stack to stderr, written by the main thread between
    two bytecodes, holding the GIL, so no thread starts or ends meanwhile. faulthandler's
    own dump runs inside the signal and walks the threads unlocked: it crashed a serving
    ``kvstore serve`` (SIGSEGV, about 1 signal in 15 under load) when a request thread
    ended during it. That dump stays on SIGUSR2, for when Python itself is stuck (a
    thread holding the GIL forever: this handler never runs then; no thread ends either)."""
    faulthandler.dump_traceback(all_threads=True)


def _exit_now(code: int) -> None:
    """End the process without interpreter finalization, once the stores are closed.

    mlx-lm's generation thread leaves MLX thread-local state (e.g. its ``mx.compile``
    cache) whose destructors take the GIL when the OS thread finally exits; if that
    happens after ``Py_Finalize`` has begun, CPython ends the thread with
    ``pthread_exit`` inside a noexcept C++ destructor and the process dies with
    ``terminate called without an active exception`` (SIGABRT, status 134): seen on about
    1 ``kvstore serve`` shutdown in 4, and on most Ctrl-C shutdowns of plain
    ``mlx_lm.server`` (mlx 0.32.4 / mlx-lm 0.32.2, Linux CPU). Everything
    kvstore owns is already flushed and closed here, so skipping finalization loses
    nothing and makes a SIGTERM exit status 0.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def shared_config(ours: argparse.Namespace) -> Any:
    """The SharedConfig of ``--shared`` and its options (``$KVSTORE_SHARED`` when only the
    options are given), or None: the store then reads ``$KVSTORE_SHARED`` itself."""
    timeout = ours.shared_timeout  # seconds (units.milliseconds)
    secret = getattr(ours, "shared_secret_file", None)
    from ..shared.config import read_secret

    try:
        secret = read_secret(secret) if secret else None
    except ValueError as e:
        raise SystemExit(f"kvstore serve: {e}") from None
    over: dict[str, Any] = {k: v for k, v in (("prefix", ours.shared_prefix), ("ttl", ours.shared_ttl),
                              ("command_timeout", timeout), ("secret", secret)) if v is not None}
    if ours.shared is None and not over:
        return None
    from ..shared import SharedConfig

    config = SharedConfig.from_url(ours.shared, **over) if ours.shared else SharedConfig.from_env(**over)
    if config is None:
        raise SystemExit("kvstore serve: --shared-* options need --shared URL (or $KVSTORE_SHARED)")
    return config



def _tokens(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 0, got {text!r}")
    return n
