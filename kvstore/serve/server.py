"""``kvstore serve``: mlx-lm's own OpenAI-compatible server with kvstore as its prompt cache.

No mlx-lm file is edited, and no attribute of its classes is set. ``main`` reads kvstore's
flags once into a ``ServeConfig`` (``kvstore.serve.config``), then ``patch`` points a few
module names of ``mlx_lm.server`` at kvstore's subclasses, bound to that config
(``PATCHED_NAMES``): mlx_lm.server's ``main()`` and ``run()`` build them by name.
- ``APIHandler``: ``kvstore.serve.handler``, one route table: ``GET /health`` as
  mlx_lm.server answers it once ready (503 ``{"status": "starting"}`` before:
  ``kvstore.serve.startup``), ``GET /v1/cache/stats``, ``/metrics``, ``/openapi.json``,
  ``GET /v1/models[/ID]`` with the model it serves (``model_names``), HEAD for every GET
  route, ``POST /v1/messages[/count_tokens]`` (``anthropic``), ``POST /v1/responses`` and
  ``GET`` / ``DELETE /v1/responses/{id}`` (``responses``), mlx-lm's own routes with their
  generation fields checked first (``gen_args``) and a 500 with a JSON body for what they
  raise before answering; keys, body limit and salt checked for every request
  (``tenants``), whose facts ride to the generation thread in a ``RequestContext``.
- ``ResponseGenerator``: ``kvstore.serve.generator``, one ``_tokenize`` running the prompt
  steps in order (``--stable-prefix``, ``--sort-tools``, the system probe, the render kept
  for a miss's line, the salt), the KV quantisation told to the cache.
- ``LRUPromptCache``: kvstore's drop-in bound to the cache directory and budgets given here;
  ``BatchGenerator``: each sequence's salt kept; ``json``: a body parsed once;
  ``run``: kvstore's (``httpd``), a ThreadingHTTPServer serving the handler named here; ``ModelProvider``: the warm
  start (``startup``).
- SIGTERM becomes the KeyboardInterrupt ``run`` handles (``httpd.serve``: the HTTP server shut down),
  then the store is closed, which flushes the write-behind queue before the process exits;
  SIGUSR1 prints every thread's Python stack to stderr, so a server that stops answering
  can be looked into without stopping it; SIGUSR2 does the same from the signal itself,
  for a process whose Python no longer runs at all (see ``_dump_stacks``).
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

from ..floors import MIN_DISK_HIT
from ..options import StoreOptions
from ..pressure import DEFAULT_MEMORY_FLOOR
from ..units import count, memory_floor, milliseconds, parse_size, positive_seconds, tokens
from . import http, httpd, model_names, prompts, responses, stable_prefix, startup, tenants
from .config import ServeConfig, shared_config  # noqa: F401  (shared_config: the --shared flags, read here)
from ..escape import logger

if TYPE_CHECKING:  # imported when used: MLX and mlx-lm take seconds, --help and a refused start need neither
    from ..adapters.mlx_lm import LRUPromptCache
    from .handler import Served

log = logger("kvstore")
# the names of mlx_lm.server that ``patch`` points at kvstore's (nothing else of it is touched)
PATCHED_NAMES = ("APIHandler", "ResponseGenerator", "LRUPromptCache", "BatchGenerator", "json", "run", "ModelProvider")


def bind_prompt_cache(stores: list[Any], options: StoreOptions) -> type[LRUPromptCache]:
    """A ``LRUPromptCache`` class whose constructor takes mlx-lm's arguments only and runs
    on ``options`` (mlx-lm's limits, when given, over theirs): what an engine instantiates
    itself. Each instance is appended to ``stores`` (the server's: ``Served.stores``)."""
    from ..adapters.mlx_lm import LRUPromptCache

    class BoundPromptCache(LRUPromptCache):
        def __init__(self, max_size: int | None = None, max_bytes: int | None = None) -> None:
            super().__init__(max_size, max_bytes, options=options)
            stores.append(self)

    return BoundPromptCache


def served_models(cli_args: Any, config: ServeConfig | None = None) -> list[str]:
    """Model ids ``GET /v1/models`` lists: ``--served-model-name``s, else the ``--model`` value
    as given (``kvstore.serve.model_names``: any other name is served by the same model)."""
    return model_names.served(cli_args, config.served_names if config is not None else ())


def patch(server_mod: Any, config: ServeConfig | None = None, *, progress: startup.ProgressFactory | None = None,
          warm_start: bool = False, **options: Any) -> Served:
    """Make ``server_mod`` (mlx_lm.server) kvstore's server, by pointing at most seven of its
    module names at kvstore's classes (``PATCHED_NAMES``) and setting nothing else of it:
    ``APIHandler`` (``kvstore.serve.handler``: kvstore's routes), ``ResponseGenerator``
    (``kvstore.serve.generator``: the prompt steps, the KV quantisation told to the cache),
    both bound to ``config`` (default: every option off); ``LRUPromptCache`` bound to
    ``config``'s store options with ``options`` (``StoreOptions`` names: cache_dir,
    ...); ``BatchGenerator`` keeping each sequence's salt; ``json`` (a body admitted once is
    parsed once: ``http.ParsedOnce``); ``run`` (``httpd.runner``: kvstore's HTTP server with
    kvstore's handler; mlx-lm's own hands its server the class it was defined with); with ``warm_start`` (``kvstore serve``), ``ModelProvider``
    (``startup``: warm-up, preload, readiness). Returns what the server holds (``Served``).
    What ``main`` does before running it; an engine running mlx_lm.server in-process calls it."""
    from mlx_lm.generate import BatchGenerator

    from .handler import Handler, Served
    from .generator import Generator

    config = config if config is not None else ServeConfig()
    served = Served.of(config)
    bound = {"config": config, "__module__": __name__}
    server_mod.LRUPromptCache = bind_prompt_cache(served.stores, config.store.but(**options))
    server_mod.ResponseGenerator = type("ResponseGenerator", (Generator,), bound)
    server_mod.APIHandler = type("APIHandler", (Handler,), {**bound, "served": served})
    server_mod.BatchGenerator = tenants.salted_batches(BatchGenerator)
    server_mod.json = http.ParsedOnce()  # its json.loads of an admitted body returns the object admitted
    server_mod.run = httpd.runner(server_mod)  # kvstore's run(): mlx-lm's hands its server its own handler
    if warm_start:
        server_mod.ModelProvider = startup.provider_class(_mlx_own(server_mod, "ModelProvider"), config.start,
                                                          served.stores, progress)
    return served


def _mlx_own(server_mod: Any, name: str) -> Any:
    """mlx_lm.server's own class ``name`` (``server_mod``'s, or the one kvstore's subclass of it there derives from)."""
    return prompts.mlx_own(getattr(server_mod, name), server_mod)


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
    g.add_argument("--min-disk-hit", type=tokens, default=MIN_DISK_HIT, metavar="TOKENS",
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
                   help="on by default (kept for old command lines): a conversation's volatile spans (Claude "
                        "Code's date and git status, OpenCode's date, Codex's date, and spans learned from the "
                        "requests seen) move to the end of its first user turn with the values it began with, "
                        "and changed values come as an update before the user turn that first saw them: system "
                        "prompt and tools render the same for every session and day, and the model reads every "
                        "current value")
    g.add_argument("--no-stable-prefix", action="store_true",
                   help="render every request as sent: no span is moved, learned or recorded")
    g.add_argument("--no-learned-spans", action="store_true",
                   help="use the built-in and --volatile spans only: learn none from the requests seen")
    g.add_argument("--volatile", action="append", default=[], metavar="REGEX",
                   help="another volatile span (a regular expression in RE2 syntax: Python's without "
                        "backreferences or lookaround, searched in linear time in the system and user messages "
                        "before the first assistant turn); repeatable")
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
        if ours.no_stable_prefix and ours.volatile:
            parser.error("--volatile needs the stable prefix: drop --no-stable-prefix or the --volatile patterns")
        stable = stable_prefix.Config.from_flags(not ours.no_stable_prefix, ours.volatile)
    except ValueError as e:  # a bad --volatile pattern
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
    config = ServeConfig.from_args(ours, policy, stable.rules)  # one frozen value: every flag of ours, read once
    import mlx_lm.server as server_mod

    served = _install(server_mod, config, rest, progress)
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
        for s in served.stores:
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


def _install(server_mod: Any, config: ServeConfig, rest: list[str],
             progress: startup.ProgressFactory | None) -> Served:
    """Everything kvstore adds to ``mlx_lm.server`` before its ``main()`` runs: its module
    names pointed at kvstore's classes bound to ``config`` (``patch``, with the warm start),
    the warning for an exposed address, and the signals (this process is the server's: the
    handlers are ours to set). Returns what the server holds (its stores: closed at the end)."""
    served = patch(server_mod, config, progress=progress, warm_start=True)
    tenants.warn_if_exposed(tenants.host_of(rest), config.policy)
    signal.signal(signal.SIGTERM, _sigterm)
    if hasattr(signal, "SIGUSR1"):  # POSIX (Linux, macOS)
        signal.signal(signal.SIGUSR1, _dump_stacks)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    return served


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
