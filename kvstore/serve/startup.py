"""Warm start for ``kvstore serve``: a warm-up pass and a preload before the server is ready.

mlx_lm.server loads its model on its generation thread while the HTTP socket already
listens. ``provider_class`` is the ``ModelProvider`` kvstore serve gives it, whose ``load_default`` (run on that
thread before it takes any request) then

0. resolves the model's identity (``KVStore.identity``: file digests from the memo, the
   code digest, the cache layout probed on the model just loaded rather than a second
   one), so the first request does not pay it; ``identity_seconds`` says what it cost;
1. runs one forward pass of a few tokens on a scratch cache (``kvstore.generate.warm_up``),
   so the first request does not pay the first call's cost (weights read in, kernels and
   BLAS set up), then what a request does the first time (``warm_up_request``: the chat
   template compiled, a one-token generation through mlx-lm's batched path on a scratch
   cache), touching no store; ``warmup_seconds`` and ``warmup_request_seconds`` say what
   each cost; ``--no-warmup`` skips both;
2. restores this model's pinned entries, then the most valuable others, into the memory
   tier (``--preload pinned | auto | N``: ``KVStore.preload``); ``--preload-background``
   runs it on its own thread once the server is ready, beside live traffic (a live insert
   always wins: the preload never evicts, and stops at the first entry that does not fit);
3. marks the server ready and logs ``kvstore: ready: ...`` (with the identity's time).

Readiness: until step 3, ``GET /health`` and ``GET /v1/models`` answer 503, /health with
``{"status": "starting"}``; ``GET /v1/cache/stats`` says where the start is under
``"startup"`` (``phase``: "loading model" | "warming up" | "preloading" | "ready", and the
timings). Once ready /health is exactly mlx_lm.server's. The socket accepts requests meanwhile, but a chat or completion request sent early waits in
mlx-lm's queue behind the start and is served once the server is ready: never cold.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..hoststate import releasing
from ..units import whole
from ..escape import logger

log = logger("kvstore")

ProgressFactory = Callable[..., Any]
"""``factory(label, total=, unit=, since=)`` -> an object with ``update_to(done)`` and
``close(label=None, note="")`` returning the step's seconds: ``kvstore.cli.progress.Progress``."""


@dataclass
class Options:
    """What the warm-start flags asked for."""

    preload: int | str | None = None  # "pinned", "auto", N entries, or None (off)
    background: bool = False
    warmup: bool = True
    said: tuple[str, ...] = ()  # what else the ready line says (the stable prefix's choice)


@dataclass
class State:
    """Where this process is in its start. ``ready`` is set once; ``stop`` ends a
    background preload (shutdown)."""

    phase: str = "loading model"
    started: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    info: dict[str, Any] = field(default_factory=dict)
    thread: threading.Thread | None = None
    installed: bool = False  # ``provider_class`` ran: this process has a start to wait for


STATE = State()


def preload_how(text: str) -> int | str:
    """``--preload``'s value: "pinned", "auto" or a number of entries."""
    if text in ("pinned", "auto"):
        return text
    try:
        return whole(text, "number of entries")
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected pinned, auto or a number of entries >= 0, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("kvstore warm start")
    g.add_argument("--preload", type=preload_how, nargs="?", const="auto", default=None, metavar="N|pinned|auto",
                   help="before reporting ready, restore this model's stored entries into memory: pinned ones "
                        "first (`kvstore pin`), then (auto, or up to N) the most valuable others while they "
                        "fit --prompt-cache-size / --prompt-cache-bytes (default: off; alone: auto)")
    g.add_argument("--preload-background", action="store_true",
                   help="report ready first and preload beside live traffic (a live insert always wins)")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the one short forward pass that takes the first request's first-call cost")


def options(ns: argparse.Namespace) -> Options:
    return Options(preload=ns.preload, background=ns.preload_background, warmup=not ns.no_warmup)


def provider_class(base: type, opts: Options, stores: list[Any], progress: ProgressFactory | None = None) -> type:
    """A subclass of ``base`` (mlx_lm.server's ModelProvider) whose ``load_default`` warms
    up and preloads after loading its default model, then marks this process ready (what
    ``kvstore serve`` names ``ModelProvider`` in mlx_lm.server). ``stores``: the server's
    prompt caches (filled as mlx_lm.server creates them)."""
    STATE.started = time.monotonic()
    STATE.installed = True

    class WarmStartProvider(base):
        def load_default(self) -> None:
            t0 = time.perf_counter()
            super().load_default()
            STATE.info["load_seconds"] = round(time.perf_counter() - t0, 3)
            start(self, opts, stores[0] if stores else None, progress)

    WarmStartProvider.__name__ = WarmStartProvider.__qualname__ = "ModelProvider"
    return WarmStartProvider


def start(provider: Any, opts: Options, cache: Any, progress: ProgressFactory | None) -> None:
    """Steps 0-3 of the module docstring, on the generation thread."""
    from ..generate import warm_cache, warm_up

    model = provider.model
    store = getattr(cache, "store", None)
    if store is not None and model is not None:
        STATE.info["identity_seconds"] = identify(store, provider.model_key, model)
    if opts.warmup and model is not None:
        STATE.phase = "warming up"
        t0 = time.perf_counter()
        held = warm_cache(model, WARM_HELD)  # warm_up's pass, its cache kept for the request path's
        seconds = time.perf_counter() - t0
        if provider.draft_model is not None:
            seconds += warm_up(provider.draft_model)
        STATE.info["warmup_seconds"] = round(seconds, 3)
        STATE.info["warmup_request_seconds"] = warm_up_request(provider, held)
    later: Callable[[], None] | None = None  # a preload that runs once the server is ready
    if opts.preload is not None and cache is not None and model is not None:
        budget = getattr(provider.cli_args, "prompt_cache_bytes", None)

        def run() -> None:
            preload(cache, provider.model_key, opts, budget, progress)

        if opts.background:
            later = run
        else:
            STATE.phase = "preloading"
            run()
    if STATE.stop.is_set():  # SIGTERM during the start: shutting down, never ready
        return
    mark_ready(opts)
    if later is not None:
        STATE.thread = threading.Thread(target=releasing(later), name="kvstore-preload", daemon=True)
        STATE.thread.start()


WARM_TEXT = "kvstore warm-up"
WARM_HELD = 16  # tokens of the warm-up's throwaway cache (passed to kvstore.generate.warm_cache)


def warm_up_request(provider: Any, held: list[Any]) -> float | None:
    """Seconds of doing once, on scratch state, what a request would otherwise do first:
    the chat template rendered (its Jinja compile; ``--stable-prefix``'s placement probe),
    then, when mlx-lm batches this model, its batched generation of one token after a
    three-token prompt on ``held`` (``warm_up``'s throwaway cache of ``WARM_HELD`` tokens:
    what a hit hands it; the batch caches merged, prefill on top, decode, extract) and the
    detokenizer's first use. A few tokens' forward passes: the start pays little more. No
    store is touched (nothing counted, inserted or learned) and decoding is greedy (MLX's
    random key is not drawn). None when it failed (logged: the server starts without it)."""
    from mlx_lm import server as mlx_server

    from .stable_prefix import inline_for

    t0 = time.perf_counter()
    model, tokenizer, cli = provider.model, provider.tokenizer, provider.cli_args
    try:
        prompt = rendered(tokenizer, dict(getattr(cli, "chat_template_args", None) or {}))
        inline_for(tokenizer)
        if getattr(provider, "is_batchable", False) and getattr(cli, "kv_bits", None) is None:
            batch = mlx_server.BatchGenerator(model, prefill_step_size=getattr(cli, "prefill_step_size", 2048),
                                              stream=mx_default_stream())
            try:
                batch.insert_segments(segments=[[prompt[-3:]]], max_tokens=[1], caches=[held],
                                      all_tokens=[list(range(1, WARM_HELD + 1))])
                detok, done = tokenizer.detokenizer, False
                for _ in range(8):  # prefill, then the token: a few steps (bounded all the same)
                    for r in batch.next()[1]:
                        detok.add_token(r.token)
                        done = done or r.finish_reason is not None
                    if done:
                        break
                detok.finalize()
            finally:
                batch.close()
    except Exception:  # a defect: the server still starts, its first request pays this
        log.exception("kvstore: the request path's warm-up failed (a kvstore bug: please report); going on")
        return None
    return round(time.perf_counter() - t0, 3)


def rendered(tokenizer: Any, template_args: dict[str, Any]) -> list[int]:
    """A two-message chat rendered as a request is (its template compiled on the way), or
    ``WARM_HELD`` token ids when the tokenizer has no template or its template refuses the chat (a
    request's own render then fails the same way, as it did before)."""
    if getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "system", "content": WARM_TEXT}, {"role": "user", "content": WARM_TEXT}]
        try:
            got = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_args)
            return list(getattr(got, "input_ids", got))
        except Exception:  # the template's own refusal (a system role it does not take): compiled all the same
            pass
    return list(range(1, WARM_HELD + 1))


def mx_default_stream() -> Any:
    """This thread's default MLX stream: the one mlx_lm.server's generation loop runs on."""
    import mlx.core as mx

    return mx.default_stream(mx.default_device())


def identify(store: Any, model_key: Any, model: Any) -> float:
    """Seconds ``store.identity(model_key)`` took, derived with the loaded ``model`` (its
    layout is not built again); the store keeps it, so no request derives it. A failure
    is the store's to say (memory only, logged once): the start goes on."""
    t0 = time.perf_counter()
    store.identity(model_key, built=model)
    return round(time.perf_counter() - t0, 3)


def preload(cache: Any, model_key: Any, opts: Options, max_bytes: int | None,
            progress: ProgressFactory | None) -> Any:
    """``cache.preload`` with a progress bar (when a factory is given) and a summary line;
    None if it failed (logged: the server then starts without it)."""
    bars: list[Any] = []
    t0 = time.perf_counter()  # the bar and the summary both measure from here: one duration

    def step(done: int, total: int) -> None:
        if progress is not None and not bars:
            bars.append(progress(f"preload {entries(total)} ({opts.preload})", total=total, unit="entry", since=t0))
        if bars:
            bars[0].update_to(done)

    STATE.info["preload"] = {"how": opts.preload, "running": True}
    try:
        report = cache.preload(model_key, opts.preload, max_bytes=max_bytes, progress=step, stop=STATE.stop)
    except Exception as e:  # a defect: the server still starts, from disk as before
        log.exception("kvstore: preload failed (a kvstore bug: please report); serving without it")
        STATE.info["preload"] = {"how": opts.preload, "running": False, "error": f"{type(e).__name__}: {e}"}
        return None
    seconds = time.perf_counter() - t0
    for bar in bars:
        seconds = bar.close(f"preload: {entries(report.entries)}, {report.tokens:,} tokens")
    summary = (f"preloaded {report.entries} of {entries(report.candidates)} ({report.tokens:,} tokens, "
               f"{report.nbytes / 1e9:.2f} GB) in {seconds:.2f} s")
    STATE.info["preload"] = {"how": opts.preload, **report.as_stats(), "stopped": report.stopped}
    log.info("kvstore: %s (--preload %s%s; stopped: %s, %d skipped)", summary, opts.preload,
             " in the background" if opts.background else "", report.stopped, report.skipped)
    return report


def entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def since_process_start() -> float:
    """Seconds since this process was created (psutil: the kernel's start time, so Python's
    start, the imports and a re-execution for OpenBLAS count too); since ``provider_class`` when
    the kernel's time cannot be read."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # psutil without /proc: what this process can see itself
        return time.monotonic() - STATE.started


def mark_ready(opts: Options) -> None:
    STATE.info["ready_seconds"] = round(since_process_start(), 3)
    STATE.phase = "ready"
    STATE.ready.set()
    parts = [f"model loaded in {STATE.info.get('load_seconds', 0):.1f} s"]
    ident = STATE.info.get("identity_seconds")
    if ident is not None:
        parts.append(f"identity {ident:.2f} s")
    warm = STATE.info.get("warmup_seconds")
    path = STATE.info.get("warmup_request_seconds")
    parts.append((f"warm-up {warm:.2f} s" + (f" + request path {path:.2f} s" if path is not None else ""))
                 if warm is not None else "no warm-up")
    pre = STATE.info.get("preload")
    if pre and "preloaded_entries" in pre:
        parts.append(f"{entries(pre['preloaded_entries'])} ({pre['preloaded_tokens']:,} tokens) preloaded")
    elif opts.preload is not None:
        parts.append(f"preload ({opts.preload}) continues in the background")
    parts.extend(opts.said)
    log.info("kvstore: ready: %s; %.1f s after the process started", ", ".join(parts), STATE.info["ready_seconds"])


def health(generator: Any) -> tuple[int, dict[str, Any]]:
    """``GET /health``, with mlx_lm.server's bodies and status codes: 200 ``{"status": "ok"}``,
    503 ``{"status": "unavailable"}`` when the generation thread died; and, only while
    ``kvstore serve`` loads, warms up and preloads (``provider_class`` was called, not ready yet),
    503 ``{"status": "starting"}``. Details (phase, timings) are in ``startup_stats``."""
    alive = generator is None or _generation_alive(generator)
    if not alive:
        return 503, {"status": "unavailable"}
    if STATE.installed and not STATE.ready.is_set():
        return 503, {"status": "starting"}
    return 200, {"status": "ok"}


def _generation_alive(generator: Any) -> bool:
    """mlx-lm 0.32's ``generation_available()``; 0.31 has none (its ``/health`` always says
    ok), so there the generation thread's own liveness stands in."""
    available = getattr(generator, "generation_available", None)
    if available is not None:
        return bool(available())
    thread = getattr(generator, "_generation_thread", None)
    return thread is None or thread.is_alive()


def startup_stats() -> dict[str, Any]:
    """What ``GET /v1/cache/stats`` says of the start under ``"startup"``: ``ready``,
    ``phase`` and the timings (``load_seconds``, ``identity_seconds``, ``warmup_seconds``,
    ``warmup_request_seconds``, ``ready_seconds``,
    ``preload``: how, entries, stopped...)."""
    if not STATE.installed:  # mlx_lm.server's own start: no kvstore phases
        return {}
    return {"ready": STATE.ready.is_set(), "phase": STATE.phase, **STATE.info}


def not_ready_error() -> dict[str, Any]:
    """The body of a 503 for a route that waits for readiness (``GET /v1/models``)."""
    return {"error": {"message": f"kvstore serve is starting ({STATE.phase}); GET /health says when it is ready",
                      "type": "server_starting", "param": None, "code": "starting"}}


def shutdown(timeout: float = 60.0) -> None:
    """Stop a background preload between two entries and wait for it."""
    STATE.stop.set()
    if STATE.thread is not None:
        STATE.thread.join(timeout)
