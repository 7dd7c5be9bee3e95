"""A coding-agent session over the Anthropic Messages API (or, ``--api responses``, the OpenAI
Responses API as Codex CLI sends it), with a server restart midway.

    python -m benchmarks.agent_session                        # smollm2, 8k-token system, 12 turns
    python -m benchmarks.agent_session --system-tokens 2048   # a smaller run
    python -m benchmarks.agent_session --vary uuid,date,tools --restart-after 0   # why turns miss
    python -m benchmarks.agent_session --vary tools --sort-tools --restart-after 0 # the order fixed
    python -m benchmarks.agent_session --other 'vllm-mlx-simple=/venv/bin/vllm-mlx serve {model} --port {port}'
    python -m benchmarks.agent_session --stop term --kvstore-args '--preload auto'
    python -m benchmarks.agent_session --api responses          # Codex-shaped (benchmarks/responses_trace.py)
    python -m benchmarks.agent_session --api responses --chain  # store + previous_response_id across the restart

What Claude Code sends, reduced: a system prompt with tool definitions (the tools rendered by
the model's chat template, ``TOOL_TEMPLATE``: Hermes/Qwen style, so mlx-lm's ``json_tools``
parser reads the calls) whose first system block is a billing header that changes on every
request (``x-anthropic-billing-header: ...; cch=...;``), then turns that mix text, tool_use
answered by tool_result, and text; the client sends back each reply it got. The server is
killed (SIGKILL by default, ``--stop term`` for SIGTERM) once the write-behind queue is empty
after turn ``--restart-after`` and started again on the same cache directory.

Per turn, through the official ``anthropic`` SDK, streamed: time to the first content delta
(TTFT), the prompt tokens (input + cache read + cache creation) and the share of them read
from the cache. ``--other NAME=COMMAND`` runs the same trace against another server command
(``{model}``, ``{port}``, ``{work}`` substituted; e.g. vllm-mlx's ``/v1/messages`` from its own env),
restarted the same way. ``--vary``: every ``--vary-every`` turns the agent's client process
starts again and changes the prompt as real ones do (a session UUID in a path in the system
prompt, the date at its end, the tools' order); the run then reports the misses kvstore
counted by reason (``/v1/cache/stats``). Results: ``<out>/agent_session.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.testing.procs import die_with_parent  # noqa: E402

HOST = "127.0.0.1"

# A Hermes/Qwen2.5-style ChatML template that renders tools, tool calls and tool responses
# (tools.testing.templates: the tiny-qwen-tools test model renders with it too)
from tools.testing.templates import TOOL_TEMPLATE  # noqa: E402  (re-exported: tests and benchmarks import it from here)

from benchmarks.agent_trace import VARY, Session, system_prompt, tools  # noqa: E402  (the trace; tests import it from here)


def run_turn(client: Any, req: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: TTFT (to the first content delta), usage, the content blocks."""
    extra = req.pop("extra_body", None)
    t0 = time.perf_counter()
    ttft = None
    with client.messages.stream(**req, extra_body=extra) as stream:
        for event in stream:
            if ttft is None and event.type == "content_block_delta":
                ttft = time.perf_counter() - t0
        final = stream.get_final_message()
    total = time.perf_counter() - t0
    u = final.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "prompt_tokens": prompt,
            "input_tokens": u.input_tokens, "cache_read_input_tokens": u.cache_read_input_tokens or 0,
            "cache_creation_input_tokens": u.cache_creation_input_tokens or 0, "output_tokens": u.output_tokens,
            "stop_reason": final.stop_reason, "read_share": (u.cache_read_input_tokens or 0) / max(prompt, 1),
            "content": [b.model_dump(exclude_none=True) for b in final.content]}


def run_chat_turn(client: Any, req: dict[str, Any]) -> dict[str, Any]:
    """``run_turn`` over ``/v1/chat/completions`` (``--api chat``, what mlx_lm.server
    serves): the Messages request translated as kvstore serve's ``/v1/messages`` route
    translates it (``anthropic.chat_request``), streamed through the openai SDK; TTFT to the
    first content or tool-call delta, usage from ``prompt_tokens_details.cached_tokens``,
    the reply as Messages content blocks (text, tool_use) for the session."""
    from kvstore.serve.anthropic import chat_request

    extra = req.pop("extra_body", None) or {}
    chat = chat_request({**req, **extra, "stream": True}, False)
    chat["model"] = req["model"]
    if not chat.get("stop"):
        chat.pop("stop", None)
    t0 = time.perf_counter()
    ttft = None
    text, usage = "", None
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(**chat):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            if ttft is None and (d.content or d.tool_calls):
                ttft = time.perf_counter() - t0
            text += d.content or ""
            for tc in d.tool_calls or []:
                got = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                got["id"] = tc.id or got["id"]
                got["name"] += (tc.function.name or "") if tc.function else ""
                got["arguments"] += (tc.function.arguments or "") if tc.function else ""
    total = time.perf_counter() - t0
    prompt = usage.prompt_tokens if usage is not None else 0
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for i, c in sorted(calls.items()):
        try:
            args = json.loads(c["arguments"] or "{}")
        except ValueError:
            args = {"raw": c["arguments"]}
        content.append({"type": "tool_use", "id": c["id"] or f"call_{i}", "name": c["name"], "input": args})
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "prompt_tokens": prompt,
            "input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": usage.completion_tokens if usage is not None else 0,
            "stop_reason": None, "read_share": cached / max(prompt, 1), "content": content}


def play(session: Session, turns: int, restart_after: int, client: Callable[[], Any],
         restart: Callable[[], None], log: Callable[[str], None] = print,
         run: Callable[[Any, dict[str, Any]], dict[str, Any]] = run_turn) -> list[dict[str, Any]]:
    """Run ``turns`` turns of ``session`` (each by ``run``); ``restart()`` after turn ``restart_after``."""
    rows = []
    for turn in range(1, turns + 1):
        row = run(client(), session.request())
        session.record(row)
        row["turn"] = turn
        row["epoch"] = session.epoch
        row["after_restart"] = 0 < restart_after and turn == restart_after + 1
        rows.append(row)
        log(f"  turn {turn:2d}: prompt {row['prompt_tokens']:6d}  read {row['cache_read_input_tokens']:6d} "
            f"({100 * row['read_share']:5.1f}%)  ttft {row['ttft_s']:.3f} s"
            + (f"  {row['error']}" if row.get("error") else ""))
        if turn == restart_after:
            restart()
    return rows


# -- servers ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class Proc:
    """A server subprocess from a command line, ready when ``ready_path`` answers 200."""

    def __init__(self, command: list[str], port: int, log: Path, ready_path: str = "/health",
                 root: Path = ROOT) -> None:
        self.command, self.port, self.log, self.ready_path = command, port, log, ready_path
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        env.update(same_blas())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float = 600) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited with {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not ready after {timeout} s; see {self.log}")

    def stop(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


def same_blas() -> dict[str, str]:
    """The environment that gives any server the BLAS ``kvstore serve`` preloads."""
    from kvstore import blas

    return blas.preload_environment()


def wait_flushed(url: str, timeout: float = 300) -> None:
    """kvstore serve: until the write-behind queue is empty and the counters stay put."""
    last = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/v1/cache/stats", timeout=10) as r:
            s = json.loads(r.read())
        now = (s.get("queue_depth"), s.get("writes"), s.get("bytes_written"))
        if s.get("queue_depth") == 0 and now == last:
            return
        last = now
        time.sleep(0.5)
    raise RuntimeError("kvstore's write-behind queue did not drain")


def miss_stats(url: str) -> dict[str, Any]:
    """The miss counters of ``/v1/cache/stats`` (``miss_*``) and its recent misses (the
    server of this run only: a restart starts them again)."""
    with urllib.request.urlopen(url + "/v1/cache/stats", timeout=10) as r:
        s = json.loads(r.read())
    return {k: v for k, v in s.items() if k.startswith("miss_") and k != "miss_lost_tokens_histogram"} | {
        "recent_misses": s.get("recent_misses", [])}


def with_tool_template(src: Path, dst: Path) -> Path:
    """``src``'s model with ``TOOL_TEMPLATE`` as its chat template, in ``dst`` (the other
    files linked): one model directory every server on the trace loads as it is."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "tokenizer_config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return dst


def kvstore_command(model: Path, cache_dir: Path, extra: Sequence[str] = (),
                    parts: Path | None = None, base: bool = False) -> Callable[[int], list[str]]:
    """``kvstore serve`` on ``port``; with ``parts``, its request-path parts timed into that
    file (``benchmarks.turn_parts``). ``base``: the kvstore of another checkout, first on
    the server's PYTHONPATH (``Server(root=)``), timed by this checkout's turn_parts (run as
    a script, so that only the package ``kvstore`` comes from the checkout)."""
    def command(port: int) -> list[str]:
        timed = ([str(ROOT / "benchmarks" / "turn_parts.py")] if base else ["-m", "benchmarks.turn_parts"])
        head = ([sys.executable, *timed, str(parts), "kvstore"] if parts is not None
                else [sys.executable, "-m", "kvstore.cli"])
        return [*head, "serve", "--model", str(model), "--cache-dir", str(cache_dir),
                "--host", HOST, "--port", str(port), *extra]
    return command


class Server:
    """One server of the run: started once, its rounds played (``play_round``), restarted
    after turn ``--restart-after`` of each round, stopped by ``stop``; ``result`` is its part
    of the JSON. ``root``: the checkout first on its PYTHONPATH (``--base``)."""

    def __init__(self, name: str, command: Callable[[int], list[str]], args: argparse.Namespace, work: Path,
                 is_kvstore: bool, ready_path: str = "/health", root: Path = ROOT) -> None:
        self.name, self.command, self.args, self.work = name, command, args, work
        self.is_kvstore, self.ready_path, self.root = is_kvstore, ready_path, root
        self.proc: Proc | None = None
        self.rows: list[dict[str, Any]] = []
        self.restart_ready_s: float | None = None
        self.misses: dict[str, Any] = {}

    def start(self) -> None:
        port = free_port()
        self.proc = Proc(self.command(port), port, self.work / f"{self.name}.log", self.ready_path, self.root)
        self.proc.wait_ready()

    def restart(self) -> None:
        assert self.proc is not None
        if self.is_kvstore:
            wait_flushed(self.proc.url)
        self.proc.stop(signal.SIGKILL if self.args.stop == "kill" else signal.SIGTERM)
        t0 = time.perf_counter()
        self.start()
        self.restart_ready_s = time.perf_counter() - t0

    def play_round(self, index: int) -> None:
        """Round ``index`` (0-based): the trace with the session seed of that round (the same
        for every server), its rows kept with ``round`` set (1-based)."""
        session, client, run = api_session(self.args, seed=3 + index)
        rows = play(session, self.args.turns, self.args.restart_after,
                    lambda: client(self.proc.url),  # type: ignore[union-attr]
                    self.restart, log=lambda s: print(f"[{self.name} r{index + 1}]{s}", flush=True), run=run)
        self.rows += [{**r, "round": index + 1} for r in rows]

    def stop(self) -> None:
        if self.proc is not None:
            if self.is_kvstore and not self.misses:  # why the turns missed, as the server counted them
                try:
                    self.misses = miss_stats(self.proc.url)
                except OSError:
                    pass
            self.proc.stop(signal.SIGTERM)
            self.proc = None

    def result(self) -> dict[str, Any]:
        rows, restart_after = self.rows, self.args.restart_after
        later = [r for r in rows if r["turn"] > 1]
        first_after = [r for r in rows if r["turn"] == restart_after + 1 and 0 < restart_after]
        return {"name": self.name, "rows": rows, "restart_ready_s": self.restart_ready_s, "misses": self.misses,
                "read_share_after_turn_1": sum(r["cache_read_input_tokens"] for r in later)
                / max(1, sum(r["prompt_tokens"] for r in later)),
                "min_read_share_after_turn_1": min(r["read_share"] for r in later) if later else None,
                "ttft_after_restart_s": first_after[0]["ttft_s"] if first_after else None,
                "errors": sum(1 for r in rows if r.get("error"))}


def play_rounds(servers: list[Server], rounds: int) -> list[dict[str, Any]]:
    """Every server plays ``rounds`` rounds of the trace, interleaved: round 1 in the
    servers' order, round 2 in reverse, and so on (ABBA...), so that a load that changes
    during the run reaches every server alike; each server keeps running between its
    rounds (a new session each round: ``play_round``). Their results."""
    try:
        for srv in servers:
            srv.start()
        for index in range(rounds):
            for srv in (servers if index % 2 == 0 else servers[::-1]):
                srv.play_round(index)
    finally:
        for srv in servers:
            srv.stop()
    return [srv.result() for srv in servers]


def api_session(args: argparse.Namespace,
                seed: int = 3) -> tuple[Session, Callable[[str], Any], Callable[..., dict[str, Any]]]:
    """(the session, a client for a server URL, the turn runner) of ``--api``; ``seed``: the
    session's (its user messages and tool results)."""
    common = (system_prompt(args.paragraphs), tools(args.tools), args.max_tokens)
    options = {"model": str(args.model_dir), "vary": args.vary, "vary_every": args.vary_every,
               "result_lines": args.result_lines, "seed": seed}
    if args.api == "chat":
        import openai

        return (Session(*common, **options),
                lambda url: openai.OpenAI(base_url=url + "/v1", api_key="local", max_retries=0, timeout=3600),
                run_chat_turn)
    if args.api == "responses":
        import openai

        from benchmarks import responses_trace

        return (responses_trace.ResponsesSession(*common, chain=args.chain, **options),
                lambda url: openai.OpenAI(base_url=url + "/v1", api_key="local", max_retries=0, timeout=3600),
                responses_trace.run_turn)
    import anthropic

    return (Session(*common, **options),
            lambda url: anthropic.Anthropic(base_url=url, api_key="local", max_retries=0, timeout=3600), run_turn)


def size_system(model: Path, target: int, work: Path, n_tools: int = 8) -> int:
    """Paragraphs of ``system_prompt`` for a first request of >= ``target`` prompt tokens,
    measured by kvstore serve's own ``count_tokens``."""
    import anthropic

    port = free_port()
    p = Proc(kvstore_command(model, work / "count-cache")(port), port, work / "count.log")
    try:
        p.wait_ready()
        c = anthropic.Anthropic(base_url=p.url, api_key="local", max_retries=0)
        msgs = [{"role": "user", "content": "x"}]

        def count(n: int) -> int:
            return c.messages.count_tokens(model="local", system=system_prompt(n),
                                           tools=tools(n_tools), messages=msgs).input_tokens  # type: ignore[arg-type]

        base, one = count(0), count(10)
        n = max(0, -(-(target - base) * 10 // max(one - base, 1)))
        while count(n) < target:
            n += 1
        return n
    finally:
        p.stop(signal.SIGTERM)


def report(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    restarts = 0 < s["restart_after"] < s["turns"]
    how = (f"{'SIGKILL' if s['stop'] == 'kill' else 'SIGTERM'} + restart after turn {s['restart_after']}"
           if restarts else "no restart")
    if s.get("vary"):
        how += (f"; every {s['vary_every']} turns a new client process changes {', '.join(s['vary'])}"
                f"{'; kvstore serve --sort-tools' if s.get('sort_tools') else ''}")
    if s.get("api") == "responses":
        route = "/v1/responses (Codex-shaped" + (", store + previous_response_id)" if s.get("chain") else ")")
        shape = "developer messages, client_metadata changing every request"
        read = "input_tokens_details.cached_tokens / input_tokens"
    elif s.get("api") == "chat":
        route, shape, read = "/v1/chat/completions (the Messages trace translated as kvstore's route does)", \
            "billing header dropped", "prompt_tokens_details.cached_tokens / prompt_tokens"
    else:
        route, shape, read = "/v1/messages", "billing header changing every request", \
            "cache_read_input_tokens / prompt tokens"
    lines = [f"# Coding-agent session over {route} ({s['model']}, {s['turns']} turns, {how})", "",
             f"First prompt: {doc['servers'][0]['rows'][0]['prompt_tokens']} tokens (system prompt with "
             f"{s['tools']} tools, {shape}). TTFT in seconds; read = {read}.", ""]
    names = [r["name"] for r in doc["servers"]]
    rounds = s.get("rounds") or 1
    if rounds > 1:
        lines += [f"Each server played {rounds} rounds (new sessions), interleaved: each cell is the median over "
                  "the rounds.", ""]
    lines.append(f"| turn | prompt tokens ({names[0]}) | " + " | ".join(f"{n} TTFT | {n} read" for n in names) + " |")
    lines.append("|---:|---:|" + "---:|---:|" * len(names))
    for turn in sorted({r["turn"] for r in doc["servers"][0]["rows"]}):
        of = [[r for r in srv["rows"] if r["turn"] == turn] for srv in doc["servers"]]
        mark = " (after restart)" if any(r["after_restart"] for r in of[0]) else ""
        cells = []
        for got in of:
            ok = [r for r in got if not r.get("error")]
            share = "error" if not ok and got else \
                f"{100 * _median([r['read_share'] for r in ok]):.1f}%" if ok and ok[0]["prompt_tokens"] else "n/a"
            cells += [f"{_median([r['ttft_s'] for r in ok]):.3f}" if ok else "-", share] if got else ["-", "-"]
        prompt = _median([r["prompt_tokens"] for r in of[0]])
        lines.append(f"| {turn}{mark} | {prompt:.0f} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += steady_lines(doc)
    for srv in doc["servers"]:
        restart = (f", TTFT of the first turn after the restart {srv['ttft_after_restart_s']:.3f} s, "
                   f"restart to ready {srv['restart_ready_s']:.1f} s" if restarts else "")
        after = srv["rows"][s["restart_after"]:] if restarts else []
        if after and after[0].get("error"):
            answered = next((r for r in after if not r.get("error")), None)
            restart = (f", the first turn after the restart failed ({after[0]['error'][:80]})"
                       + (f"; the first answered one (turn {answered['turn']}) had TTFT {answered['ttft_s']:.3f} s"
                          if answered else "") + f", restart to ready {srv['restart_ready_s']:.1f} s")
        errors = f"; {srv['errors']} turns answered with an error" if srv.get("errors") else ""
        lines.append(f"- {srv['name']}: lowest read share after turn 1 {100 * (srv['min_read_share_after_turn_1'] or 0):.1f}%"
                     f"{' (no usage reported)' if not srv['rows'][0]['prompt_tokens'] else ''}{restart}{errors}")
    for srv in doc["servers"]:
        m = srv.get("misses") or {}
        counted = {k[len("miss_"):]: v for k, v in m.items() if k.startswith("miss_") and isinstance(v, int)
                   and v and k not in ("miss_lost_tokens", "miss_log_threshold")}
        logged: dict[str, int] = {}
        for r in m.get("recent_misses") or []:
            logged[r["reason"]] = logged.get(r["reason"], 0) + 1
        if m:
            lines.append(f"- {srv['name']}: misses by reason {counted or 'none'} ({m.get('miss_lost_tokens', 0)} "
                         f"tokens recomputed that a stored prefix held), of which logged (>= "
                         f"{m.get('miss_log_threshold')} tokens) {logged or 'none'}"
                         + (": " if logged else "") + ", ".join(f"a {r['prompt_tokens']}-token prompt parted at token {r['diverged_at']} "
                                     f"({r['reason']}, {r['lost_tokens']} lost)" for r in m.get("recent_misses") or [])
                         + f"; prompt tokens read from the cache after turn 1: "
                         f"{100 * srv['read_share_after_turn_1']:.1f}%")
    flags = " ".join(s.get("kvstore_args") or []) or "none"
    lines.append(f"- kvstore ran `kvstore serve --model {{model}} --cache-dir ... --port {{port}}` with extra flags: {flags}")
    for spec in s.get("others", []):
        name, _, cmd = spec.partition("=")
        lines.append(f"- {name} ran `{cmd}`")
    lines += [f"- {n}" for n in doc.get("notes", [])]
    if doc.get("loadavg"):
        lines.append(f"- 1-minute load average {doc['loadavg']['start']} at start, {doc['loadavg']['end']} at end "
                     f"({doc['machine'].get('cores')} cores): TTFTs scale with it.")
    return "\n".join(lines) + "\n"


def _median(values: Sequence[float]) -> float:
    import statistics

    return statistics.median(values) if values else float("nan")


def _steady(srv: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """A server's steady turns by (round, turn): after the first, not the first after a
    restart, answered without an error."""
    return {(r.get("round", 1), r["turn"]): r for r in srv["rows"]
            if r["turn"] > 1 and not r.get("error") and not r["after_restart"]}


def paired(servers: list[dict[str, Any]]) -> dict[str, Any]:
    """Every pair of servers (A before B in the run's order) compared turn by turn: for TTFT
    and the whole turn, A's time over B's in each steady turn both played (same round, same
    turn: the same prompt), the median of those ratios, how many, and each round's median
    (its min and max: the spread a changing load leaves). Keyed "A / B"."""
    out: dict[str, Any] = {}
    for i, a in enumerate(servers):
        for b in servers[i + 1:]:
            mine, theirs = _steady(a), _steady(b)
            keys = sorted(mine.keys() & theirs.keys())
            if not keys:
                continue
            got: dict[str, Any] = {}
            for metric in ("ttft_s", "total_s"):
                ratios = [mine[k][metric] / theirs[k][metric] for k in keys if theirs[k][metric] > 0]
                by_round: dict[int, list[float]] = {}
                for k, ratio in zip(keys, ratios):
                    by_round.setdefault(k[0], []).append(ratio)
                per_round = [_median(v) for _, v in sorted(by_round.items())]
                got[metric] = {"median": _median(ratios), "pairs": len(ratios), "per_round": per_round,
                               "min_round": min(per_round), "max_round": max(per_round)}
            out[f"{a['name']} / {b['name']}"] = got
    return out


PART_ORDER = ["render", "lookup", "lookup: memory", "lookup: disk", "insert", "snapshot", "hand-off", "persist"]


def steady_lines(doc: dict[str, Any]) -> list[str]:
    """Each server's median TTFT over its steady turns; the paired ratios (``paired``);
    then, with ``--parts``, each part's median per call, per turn, and what the first
    server spends per turn more than the last ``--other`` that was timed."""
    out = []
    for srv in doc["servers"]:
        got = [r["ttft_s"] for r in _steady(srv).values()]
        if got:
            out.append(f"- {srv['name']}: median TTFT after turn 1 {_median(got):.3f} s ({len(got)} turns)")
    for pair, got in (doc.get("ratios") or {}).items():
        t, w = got["ttft_s"], got["total_s"]
        out.append(f"- {pair}: TTFT ratio {t['median']:.3f}x (median of {t['pairs']} turn pairs; per round "
                   f"{t['min_round']:.3f}x-{t['max_round']:.3f}x over {len(t['per_round'])}); whole turn "
                   f"{w['median']:.3f}x ({w['min_round']:.3f}x-{w['max_round']:.3f}x)")
    parts = doc.get("parts") or {}
    if parts:
        names = list(parts)
        turns = {srv["name"]: len(srv["rows"]) for srv in doc["servers"]}
        ref = names[-1] if len(names) > 1 else None
        every = sorted({p for v in parts.values() for p in v}, key=PART_ORDER.index)
        out += ["", "Request-path parts (`--parts`, benchmarks/turn_parts.py): median ms per call after the first "
                "(the calling thread's CPU ms: the rest was waiting; calls per turn); insert is the end of a turn (the next request waits for it), snapshot is inside "
                "insert, hand-off is the rest of it, persist runs on kvstore's writer thread (off the request path, "
                "on the same cores)." + (f" Per turn = median x calls per turn; last column: {names[0]} minus {ref}."
                                         if ref else ""), "",
                "| part | " + " | ".join(names) + (f" | {names[0]} - {ref} per turn |" if ref else " |"),
                "|---|" + "---:|" * (len(names) + (1 if ref else 0))]

        def per_turn(name: str, part: str) -> float:
            p = parts[name].get(part)
            return 1000 * p["steady_median_s"] * p["calls"] / max(1, turns.get(name, 1)) if p else 0.0

        for part in every:
            cells = [f"{1000 * parts[n][part]['steady_median_s']:.1f} "
                     f"(cpu {1000 * parts[n][part].get('steady_median_cpu_s', float('nan')):.1f}; "
                     f"{parts[n][part]['calls'] / max(1, turns.get(n, 1)):.1f}/turn)"
                     if part in parts[n] else "-" for n in names]
            diff = [f"{per_turn(names[0], part) - per_turn(ref, part):+.1f}"] if ref else []
            out.append(f"| {part} | " + " | ".join(cells + diff) + " |")
        out.append("")
    return out


def _vary(text: str) -> tuple[str, ...]:
    got = tuple(v for v in text.split(",") if v)
    bad = [v for v in got if v not in VARY]
    if bad:
        raise argparse.ArgumentTypeError(f"--vary takes {', '.join(VARY)}; got {', '.join(bad)}")
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agent_session", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="a tools.testing.model_builds name or a model directory (default smollm2)")
    p.add_argument("--system-tokens", type=int, default=8192, help="first prompt at least this long (default 8192)")
    p.add_argument("--tools", type=int, default=8, help="tool definitions in the system prompt (default 8)")
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--restart-after", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--result-lines", type=int, default=8,
                   help="lines of each tool result the client sends back (default 8): what a turn adds to the prompt")
    p.add_argument("--stop", choices=("kill", "term"), default="kill", help="SIGKILL (default) or SIGTERM at the restart")
    p.add_argument("--other", action="append", default=[], metavar="NAME=COMMAND",
                   help="another server on the same trace: a command line with {model} (the model directory "
                        "with the tool template) and {port}, e.g. 'vllm-mlx-cb=/opt/vllm-env/bin/vllm-mlx serve "
                        "{model} --port {port} --continuous-batching'")
    p.add_argument("--kvstore-args", default="", metavar="FLAGS",
                   help="extra `kvstore serve` flags, one shell-quoted string, e.g. '--preload auto' "
                        "(a restarted server then restores its entries into memory before it says ready)")
    p.add_argument("--no-kvstore", action="store_true", help="run only the --other servers")
    p.add_argument("--vary", type=_vary, default=(), metavar="uuid,date,tools",
                   help="what a new client process changes in the prompt every --vary-every turns: a session UUID "
                        "in the system prompt, the date at its end, the order of the tools")
    p.add_argument("--vary-every", type=int, default=3, help="turns per client process with --vary (default 3)")
    p.add_argument("--sort-tools", action="store_true", help="run kvstore serve with --sort-tools")
    p.add_argument("--note", action="append", default=[], metavar="TEXT",
                   help="a line for the results' notes (e.g. why this model), repeatable")
    p.add_argument("--api", choices=("messages", "responses", "chat"), default="messages",
                   help="the API the trace speaks: Anthropic Messages as Claude Code (default), the OpenAI "
                        "Responses API as Codex CLI (benchmarks/responses_trace.py), or the same Messages trace "
                        "as /v1/chat/completions (chat: what mlx_lm.server serves, e.g. --other "
                        "'mlx_lm.server=mlx_lm.server --model {model} --port {port}')")
    p.add_argument("--parts", action="store_true",
                   help="time each server's request-path parts (render, lookup, insert, snapshot: "
                        "benchmarks/turn_parts.py; kvstore serve, and an --other command starting with mlx_lm.server)")
    p.add_argument("--chain", action="store_true",
                   help="--api responses: store: true and previous_response_id with only the new items, "
                        "instead of the whole history every turn")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of the trace per server, interleaved (ABBA...: every server plays round 1, then "
                        "round 2 in reverse order...), each a new session; the steady turns are compared in pairs "
                        "(same round and turn) and the ratio's median and per-round spread reported (default 1)")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="also run the kvstore of another checkout (e.g. `git archive main | tar -x -C DIR`) in the "
                        "same rounds, as kvstore@NAME: before/after in one run")
    p.add_argument("--base-name", default="", help="NAME of --base's server (default: DIR's name)")
    p.add_argument("--tag", default="", help="results go to agent_session[_TAG].json / .md")
    p.add_argument("--ready-path", default="/health", help="the other servers' readiness URL path (default /health)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--work", default=None, help="scratch directory (default: a new temp dir)")
    args = p.parse_args(argv)
    import tempfile

    from benchmarks import common as C

    work = Path(args.work or tempfile.mkdtemp(prefix="agent-session-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _session(args, work, C)
    finally:
        if not args.work:  # a temp dir of our own: its stores and logs go with the run
            shutil.rmtree(work, ignore_errors=True)


def _session(args: argparse.Namespace, work: Path, C: Any) -> int:
    from benchmarks import turn_parts
    from tools.testing.model_builds import model_path

    model = with_tool_template(Path(args.model) if Path(args.model).is_dir() else model_path(args.model), work / "model")
    args.model_dir = model
    load_start = C.loadavg1()
    args.paragraphs = size_system(model, args.system_tokens, work, args.tools)
    kv_extra = shlex.split(args.kvstore_args) + (["--sort-tools"] if args.sort_tools else [])
    parts = work / "parts-kvstore.jsonl" if args.parts else None
    servers = [] if args.no_kvstore else [
        Server("kvstore", kvstore_command(model, work / "cache", kv_extra, parts), args, work, True)]
    if args.base:  # another checkout's kvstore, same flags, in the same rounds
        base = Path(args.base).resolve()
        name = f"kvstore@{args.base_name or base.name}"
        servers.append(Server(name, kvstore_command(model, work / "cache-base", kv_extra,
                                                    work / f"parts-{name}.jsonl" if args.parts else None, base=True),
                              args, work, True, root=base))
    for spec in args.other:
        name, _, cmd = spec.partition("=")

        def other(port: int, cmd: str = cmd, name: str = name) -> list[str]:
            got = shlex.split(cmd.format(model=model, port=port, work=work))
            if args.parts and got[:1] == ["mlx_lm.server"]:  # in this Python, timed as kvstore is
                return [sys.executable, "-m", "benchmarks.turn_parts", str(work / f"parts-{name}.jsonl"), *got]
            return got

        servers.append(Server(name, other, args, work, False, args.ready_path))
    results = play_rounds(servers, args.rounds)
    doc = {"benchmark": "agent_session", "machine": C.machine(work),
           "settings": {"model": str(args.model), "system_tokens": args.system_tokens, "paragraphs": args.paragraphs, "tools": args.tools,
                        "turns": args.turns, "restart_after": args.restart_after, "max_tokens": args.max_tokens,
                        "stop": args.stop, "kvstore_args": kv_extra, "others": args.other, "vary": list(args.vary),
                        "vary_every": args.vary_every, "sort_tools": args.sort_tools, "api": args.api,
                        "result_lines": args.result_lines,
                        "chain": args.chain, "parts": args.parts, "rounds": args.rounds,
                        "base": str(args.base) if args.base else None},
           "loadavg": {"start": load_start, "end": C.loadavg1()},
           "servers": results,
           "ratios": paired(results),
           "parts": {srv["name"]: turn_parts.summary(str(work / f"parts-{srv['name']}.jsonl")) for srv in results
                     if (work / f"parts-{srv['name']}.jsonl").exists()},
           "notes": ["TTFT: request sent -> first content_block_delta, through the anthropic SDK's stream."
                     if args.api == "messages" else "TTFT: request sent -> first output delta (text or function "
                     "call arguments), through the openai SDK's stream.",
                     "kvstore's write-behind queue is drained before the restart (an agent idles between turns).",
                     "The servers' BLAS is in their logs (kvstore serve preloads OpenBLAS when installed); "
                     "machine.blas describes the client process.", *args.note]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "agent_session" + (f"_{args.tag}" if args.tag else "")
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{name}.md").write_text(report(doc))
    print(report(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
