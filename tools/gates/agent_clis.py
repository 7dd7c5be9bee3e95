"""A standing gate: the real coding-agent CLIs against ``kvstore serve``.

    python -m tools.gates.agent_clis --install           # npm-install the pinned CLIs (once; needs npm; 1 if it cannot)
    python -m tools.gates.agent_clis run CLI --work DIR   # one CLI's three turns; DIR/report.json
    python -m tools.gates.agent_clis run CLI --work DIR --scenario nextday [--server-arg=--stable-prefix]

Claude Code, OpenCode and Codex CLI, pinned (``PINS``), are installed from npm into a
private prefix per pin in the user cache dir (``.../kvstore/agent-clis/<package>@<version>/``), as
tools/gates/upstream_mlx_lm.py fetches mlx-lm's suite: ``.ci/run`` installs them, and
``--install`` exits non-zero, saying why, when it cannot (no npm, npm failing), so CI stops
there. tests/system/test_agent_clis.py skips, naming the command, where they are missing on a
developer's machine, and fails instead under CI (``CI`` set, as every CI service sets it), so
a green CI run always ran them. ``run`` drives one CLI non-interactively, as a user would, against a real
``kvstore serve`` on 127.0.0.1 serving tiny-qwen-tools (the real Qwen BPE tokenizer, a
template that renders tools; tools/testing/model_builds.py), through a recording proxy:

1. a first turn (``claude -p``, ``opencode run``, ``codex exec``);
2. a second turn continuing that conversation (``--continue``, ``exec resume --last``);
3. the server SIGKILLed, restarted on the same cache directory, a third turn.

``--scenario nextday`` (``nextday()``) drives two days instead: day 1 a first turn and a
continue in a git work tree, the server stopped (SIGTERM, its queue empty), the tree changed
and the CLI's clock moved a day on (libfaketime; a time zone for Codex); day 2 the server
restarted on the same cache dir, a continue and a new session. Each request is marked with
its step (``day1_first``, ``day1_continue``, ``day2_continue``, ``day2_new``) and the date
texts it carries.

Every request the CLI made is written to the report with its status, its body and, when
the answer carried one, its usage (prompt tokens, tokens read from the cache). HOME is a
temp dir holding the CLI's config only; telemetry, update checks and error reports are
off by each CLI's own switches. The caller runs ``run`` in a network namespace with only
loopback (tests/system/test_agent_clis.py: ``unshare -n`` as root) so nothing can leave
127.0.0.1; where that is unavailable the proxies point at a dead loopback port.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
MODEL = "tiny-qwen-tools"  # tools/testing/model_builds.py
MODEL_ID = "tiny"  # the model id every CLI is configured with (not the served path)
MAX_TOKENS = 16  # the server's own output bound (Codex sends none)
# cli -> (npm package, pinned version, executable)
PINS: dict[str, tuple[str, str, str]] = {
    "claude": ("@anthropic-ai/claude-code", "2.1.332", "claude"),
    "claude-2.1.197": ("@anthropic-ai/claude-code", "2.1.197", "claude"),  # one minor version back
    "opencode": ("opencode-ai", "1.18.33", "opencode"),
    "codex": ("@openai/codex", "0.171.0", "codex"),
}
PROMPTS = ("Say hello in five words.", "Now say it in French.", "And in German.")
# each CLI's own switches for telemetry, update checks, error reports and other traffic
QUIET_ENV: dict[str, dict[str, str]] = {
    "claude": {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
               "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1",
               "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_TOKENS)},
    "opencode": {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                 "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
                 "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1"},
    "codex": {"CODEX_DISABLE_TELEMETRY": "1", "NO_UPDATE_NOTIFIER": "1"},
}


def install_command() -> str:
    return "python -m tools.gates.agent_clis --install"


def family(cli: str) -> str:
    """The CLI a pin is a release of (``claude-2.1.197`` -> ``claude``): what its
    environment, command lines and config are chosen by."""
    return cli.split("-", 1)[0]


def prefix(cli: str) -> Path:
    """Where ``cli``'s pin is installed: one npm prefix per package and version
    (``<user cache>/kvstore/agent-clis/<package>@<version>/``), so adding or moving one pin
    leaves the others installed."""
    import platformdirs

    package, version, _ = PINS[cli]
    return Path(platformdirs.user_cache_dir("kvstore")) / "agent-clis" / f"{package}@{version}"


def executable(cli: str) -> Path:
    return prefix(cli) / "node_modules" / ".bin" / PINS[cli][2]


def missing(cli: str) -> str | None:
    """Why ``cli`` cannot be driven here (None: it can), naming what to run."""
    if executable(cli).exists():
        return None
    if shutil.which("npm") is None:
        return (f"{PINS[cli][0]}@{PINS[cli][1]} is not installed and npm is missing: install Node.js with npm, "
                f"then run `{install_command()}`")
    return f"{PINS[cli][0]}@{PINS[cli][1]} is not installed: run `{install_command()}` (needs the npm registry)"


class InstallError(Exception):
    """The pinned CLIs could not be installed; the message says why and what to do."""


def in_ci(env: dict[str, str] | None = None) -> bool:
    """True under CI: ``CI`` set to anything but empty, 0, false or no (GitHub Actions,
    GitLab, Buildkite, CircleCI and Travis all set ``CI``)."""
    value = (os.environ if env is None else env).get("CI", "")
    return value.strip().lower() not in ("", "0", "false", "no")


def install() -> list[Path]:
    """npm-install every pinned CLI into its own ``prefix(cli)`` (a no-op for those already
    there) and return the prefixes. Raises InstallError when that cannot be done: npm
    missing, npm failing or hanging, or a CLI still missing after it."""
    todo = [cli for cli in PINS if missing(cli) is not None]
    npm = shutil.which("npm")
    if todo and npm is None:
        raise InstallError("npm is not on PATH: install Node.js with npm, then run "
                           f"`{install_command()}` again")
    for cli in todo:
        assert npm is not None
        package = f"{PINS[cli][0]}@{PINS[cli][1]}"
        prefix(cli).mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([npm, "install", "--prefix", str(prefix(cli)), "--no-audit", "--no-fund",
                            "--loglevel=error", package], check=True, timeout=1800)
        except subprocess.CalledProcessError as e:
            raise InstallError(f"`npm install {package}` exited with {e.returncode} (its output is above; "
                               "is the npm registry reachable?)") from None
        except subprocess.TimeoutExpired:
            raise InstallError(f"`npm install {package}` did not finish in 30 minutes") from None
        except OSError as e:
            raise InstallError(f"could not run {npm}: {e}") from None
    still = [why for cli in PINS if (why := missing(cli)) is not None]
    if still:
        raise InstallError("npm install exited 0 but the CLIs are not there: " + "; ".join(still))
    return sorted({prefix(cli) for cli in PINS})


# -- the recording proxy ----------------------------------------------------------------------


def usage_of(answer: bytes) -> dict[str, int] | None:
    """``{"prompt", "cached"}`` from the last usage an answer carries (a JSON body or
    server-sent events; OpenAI chat, Responses or Anthropic Messages shapes), else None."""
    found = None
    text = answer.decode(errors="replace")
    lines = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")] or [text]
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        u = obj.get("usage") or (obj.get("message") or {}).get("usage") or (obj.get("response") or {}).get("usage")
        if not isinstance(u, dict):
            continue
        if "prompt_tokens" in u:
            found = {"prompt": u["prompt_tokens"], "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
        elif "cache_read_input_tokens" in u:
            found = {"prompt": u["input_tokens"] + u["cache_read_input_tokens"], "cached": u["cache_read_input_tokens"]}
        elif "input_tokens" in u:
            found = {"prompt": u["input_tokens"], "cached": (u.get("input_tokens_details") or {}).get("cached_tokens", 0)}
    return found


class Recorder:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream_port`` that streams every answer
    through unchanged and records each request: method, path, status, JSON body, usage."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.records: list[dict[str, Any]] = []
        self.turn = 0
        self.step = ""  # the scenario's step the CLI is in (nextday: day1_first, ...)
        lock = threading.Lock()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection, as mlx_lm.server answers

            def log_message(self, *args: Any) -> None:
                pass

            def relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                answer, status = b"", 502
                try:
                    conn = http.client.HTTPConnection(HOST, recorder.upstream_port, timeout=900)
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    status = resp.status
                    self.send_response(status)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("connection", "transfer-encoding", "server", "date"):
                            self.send_header(k, v)
                    self.end_headers()
                    while chunk := resp.read1(65536):
                        answer += chunk
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except OSError as e:  # the server is down (killed): the CLI sees a 502
                    if status == 502:
                        self.send_error(502, f"kvstore serve unreachable: {e}")
                try:
                    parsed = json.loads(body) if body else None
                except ValueError:
                    parsed = body.decode(errors="replace")
                with lock:
                    recorder.records.append({"turn": recorder.turn, "step": recorder.step, "method": self.command, "path": self.path,
                                             "status": status, "body": parsed, "usage": usage_of(answer)})

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = relay

        self.httpd = http.server.ThreadingHTTPServer((HOST, 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# -- the CLIs ---------------------------------------------------------------------------------


def cli_env(cli: str, home: Path, base_url: str) -> dict[str, str]:
    """The CLI's environment: HOME (and XDG dirs) in ``home``, quiet switches, proxies that
    lead nowhere (a dead loopback port) and no proxy for 127.0.0.1."""
    dead = f"http://{HOST}:9"
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR", "USER")}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"),
               HTTP_PROXY=dead, HTTPS_PROXY=dead, http_proxy=dead, https_proxy=dead,
               NO_PROXY=HOST, no_proxy=HOST, CI="1", **QUIET_ENV[family(cli)])
    if family(cli) == "claude":
        env.update(ANTHROPIC_BASE_URL=base_url, ANTHROPIC_AUTH_TOKEN="local", ANTHROPIC_MODEL=MODEL_ID,
                   ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL_ID, ANTHROPIC_DEFAULT_SONNET_MODEL=MODEL_ID,
                   ANTHROPIC_DEFAULT_OPUS_MODEL=MODEL_ID, ANTHROPIC_SMALL_FAST_MODEL=MODEL_ID)
    elif family(cli) == "opencode":
        config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
                  "model": f"kvstore/{MODEL_ID}", "small_model": f"kvstore/{MODEL_ID}",
                  "provider": {"kvstore": {"npm": "@ai-sdk/openai-compatible", "name": "kvstore serve",
                                           "options": {"baseURL": f"{base_url}/v1", "apiKey": "local"},
                                           "models": {MODEL_ID: {"name": MODEL_ID,
                                                                 "limit": {"context": 65536, "output": MAX_TOKENS}}}}}}
        (home / ".config" / "opencode").mkdir(parents=True, exist_ok=True)
        (home / ".config" / "opencode" / "opencode.json").write_text(json.dumps(config, indent=1))
    elif family(cli) == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            f'model = "{MODEL_ID}"\nmodel_provider = "kvstore"\n'
            f'[model_providers.kvstore]\nname = "kvstore serve"\nbase_url = "{base_url}/v1"\n'
            f'wire_api = "responses"\nrequest_max_retries = 0\nstream_max_retries = 0\n'
            f'[analytics]\nenabled = false\n[feedback]\nenabled = false\n')
        env.update(CODEX_HOME=str(codex_home))
    return env


def turn_command(cli: str, turn: int, prompt: str) -> list[str]:
    """The command line of turn ``turn`` (0-based): the first starts a conversation, the
    others continue the last one."""
    exe, cli = str(executable(cli)), family(cli)
    if cli == "claude":
        return [exe, "-p", prompt, "--model", MODEL_ID] + (["--continue"] if turn else [])
    if cli == "opencode":
        return [exe, "run", "--model", f"kvstore/{MODEL_ID}"] + (["--continue"] if turn else []) + [prompt]
    if cli == "codex":
        head = [exe, "exec", "--skip-git-repo-check"]
        return head + (["resume", "--last", prompt] if turn else [prompt])
    raise ValueError(f"unknown CLI {cli!r}; known: {', '.join(PINS)}")


def run(cli: str, work: Path, timeout: float = 900, server_args: list[str] | None = None) -> dict[str, Any]:
    """Drive ``cli`` through its three turns (the server killed and restarted before the
    third) and return the report (also written to ``work/report.json``)."""
    from benchmarks.agent_session import Proc, free_port, kvstore_command, wait_flushed
    from tools.testing.model_builds import model_path

    work.mkdir(parents=True, exist_ok=True)
    home, project = work / "home", work / "project"
    project.mkdir(exist_ok=True)
    (project / "README.md").write_text("A project the agent is asked about.\n")
    port = free_port()
    command = kvstore_command(model_path(MODEL), work / "cache", ["--max-tokens", str(MAX_TOKENS), *(server_args or [])])(port)
    report: dict[str, Any] = {"cli": cli, "version": PINS[cli][1], "turns": [], "requests": [],
                              "server_ready_seconds": []}
    started = time.monotonic()
    recorder = Recorder(port)
    server = Proc(command, port, work / "server.log")
    try:
        report["server_ready_seconds"].append(round(server.wait_ready(), 2))
        env = cli_env(cli, home, f"http://{HOST}:{recorder.port}")
        for turn, prompt in enumerate(PROMPTS):
            if turn == 2:  # the store flushed first: the gate tests restoring, not the queue's crash window
                wait_flushed(server.url)
                server.stop(signal.SIGKILL)
                server = Proc(command, port, work / "server.log")
                report["server_ready_seconds"].append(round(server.wait_ready(), 2))
            recorder.turn = turn
            t0 = time.monotonic()
            done = subprocess.run(turn_command(cli, turn, prompt), cwd=project, env=env, capture_output=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL, start_new_session=True)
            report["turns"].append({"turn": turn + 1, "exit": done.returncode,
                                    "seconds": round(time.monotonic() - t0, 2),
                                    "stdout": done.stdout.decode(errors="replace")[-2000:],
                                    "stderr": done.stderr.decode(errors="replace")[-4000:]})
    finally:
        server.stop(signal.SIGKILL)
        recorder.close()
        report["requests"] = recorder.records
        report["seconds"] = round(time.monotonic() - started, 2)
        (work / "report.json").write_text(json.dumps(report, indent=1))
    return report

# -- the next-day scenario -----------------------------------------------------------------------

NEXTDAY_STEPS = ("day1_first", "day1_continue", "day2_continue", "day2_new")
# the date text each CLI writes into its prompt (Claude Code, OpenCode, Codex's environment context)
DATE_PATTERNS = (r"Today's date is (?:now )?[0-9]{4}-[0-9]{2}-[0-9]{2}", r"Today's date: [A-Z][a-z]{2} [A-Z][a-z]{2} [0-9]{1,2} [0-9]{4}",
                 r"<current_date>[^<]*</current_date>")
FAKETIME_LIBS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1", "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
                 "/usr/lib/faketime/libfaketime.so.1", "/usr/local/lib/faketime/libfaketime.so.1")


class ScenarioError(Exception):
    """The scenario did not do what it is for (the CLI's clock did not move): its report says more."""


def libfaketime() -> Path | None:
    """libfaketime's preload library (Debian's ``faketime`` package), None where missing;
    ``KVSTORE_LIBFAKETIME`` names it instead of the search (a path that is not there: missing)."""
    if "KVSTORE_LIBFAKETIME" in os.environ:
        named = Path(os.environ["KVSTORE_LIBFAKETIME"])
        return named if named.is_file() else None
    for lib in FAKETIME_LIBS:
        if Path(lib).exists():
            return Path(lib)
    try:
        listed = subprocess.run(["dpkg", "-L", "libfaketime"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return next((Path(f) for f in listed.split() if f.endswith("/libfaketime.so.1") and Path(f).exists()), None)


def nextday_missing(cli: str) -> str | None:
    """Why the next-day scenario cannot run ``cli`` here (None: it can), naming what to install:
    the CLI, and for Claude Code and OpenCode libfaketime (Codex's clock moves by its time zone)."""
    why = [w for w in (missing(cli),) if w]
    if family(cli) != "codex" and libfaketime() is None:
        why.append("libfaketime is not installed (the next-day scenario moves the CLI's clock with it): "
                   "`apt-get install -y faketime`")
    return "; ".join(why) or None


def next_day_env(cli: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the CLI's clock a day on, for the CLI process only: libfaketime for
    Claude Code and OpenCode (dynamically linked Bun executables), for Codex (a static
    binary, which libfaketime cannot take) a time zone a day less a second ahead of UTC
    (a full day, ``KVS-24``, panics its chrono)."""
    if family(cli) == "codex":
        return {**env, "TZ": "KVS-23:59:59"}
    lib = libfaketime()
    if lib is None:
        raise ScenarioError(nextday_missing(cli) or "libfaketime is missing")
    return {**env, "LD_PRELOAD": str(lib), "FAKETIME": "+1d", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def dates(body: Any) -> list[str]:
    """The date texts (``DATE_PATTERNS``) a request body carries, in order."""
    import re

    text = json.dumps(body)
    return [m.group(0) for pattern in DATE_PATTERNS for m in re.finditer(pattern, text)]


def git_project(project: Path) -> None:
    """A git work tree with one commit (user ``dev``): what the CLIs snapshot as git status."""
    project.mkdir(parents=True, exist_ok=True)
    (project / "README.md").write_text("A project the agent is asked about.\n")
    (project / "app.py").write_text('def main() -> None:\n    print("hello")\n')
    git = ["git", "-C", str(project), "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(project), "config", "user.name", "dev"], check=True)
    subprocess.run(["git", "-C", str(project), "config", "user.email", "dev@example.invalid"], check=True)
    subprocess.run(["git", "-C", str(project), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(project), "commit", "-q", "-m", "first"], check=True)


def change_tree(project: Path) -> None:
    """Day 2's tree: a tracked file modified, an untracked one added (`` M app.py``, ``?? TODO.md``)."""
    (project / "app.py").write_text('def main() -> None:\n    print("hello, world")\n')
    (project / "TODO.md").write_text("- answer in German\n")


def conversation(requests: list[dict[str, Any]], step: str) -> list[dict[str, Any]]:
    """``step``'s requests of the conversation itself: the answered ones carrying its longest
    prompt (a title or summary request of the same step is shorter)."""
    mine = [r for r in requests if r.get("step") == step and r["usage"]]
    longest = max((r["usage"]["prompt"] for r in mine), default=0)
    return [r for r in mine if r["usage"]["prompt"] >= longest * 0.9]


def nextday(cli: str, work: Path, server_args: list[str], timeout: float = 900) -> dict[str, Any]:
    """Drive ``cli`` through two days (``NEXTDAY_STEPS``) and return the report (also
    written to ``work/report.json``). Day 1: a first turn and a continue in a git work tree;
    the server, its write queue empty, stopped with SIGTERM; the tree changed. Day 2, the
    CLI's clock a day on (``next_day_env``): the server restarted on the same cache dir, a
    continue, then a new session asking day 1's first question. Raises ScenarioError (the
    report written) when a day-2 request carries no date text that day 1's did not: the
    clock did not move for the CLI."""
    from benchmarks.agent_session import Proc, free_port, kvstore_command, wait_flushed
    from tools.testing.model_builds import model_path

    work.mkdir(parents=True, exist_ok=True)
    home, project = work / "home", work / "project"
    git_project(project)
    port = free_port()
    command = kvstore_command(model_path(MODEL), work / "cache", ["--max-tokens", str(MAX_TOKENS), *server_args])(port)
    report: dict[str, Any] = {"cli": cli, "version": PINS[cli][1], "scenario": "nextday", "server_args": server_args,
                              "turns": [], "requests": [], "server_ready_seconds": []}
    plan = [("day1_first", 0, PROMPTS[0]), ("day1_continue", 1, PROMPTS[1]),
            ("day2_continue", 1, PROMPTS[2]), ("day2_new", 0, PROMPTS[0])]
    started = time.monotonic()
    recorder = Recorder(port)
    server = Proc(command, port, work / "server.log")
    try:
        report["server_ready_seconds"].append(round(server.wait_ready(), 2))
        env = cli_env(cli, home, f"http://{HOST}:{recorder.port}")
        for turn, (step, cont, prompt) in enumerate(plan):
            if step == "day2_continue":  # a stopped server stored everything: the queue drained, SIGTERM
                wait_flushed(server.url)
                server.stop(signal.SIGTERM)
                report["server_exit"] = server.proc.returncode
                change_tree(project)
                env = next_day_env(cli, env)
                server = Proc(command, port, work / "server.log")
                report["server_ready_seconds"].append(round(server.wait_ready(), 2))
            recorder.turn, recorder.step = turn, step
            t0 = time.monotonic()
            done = subprocess.run(turn_command(cli, cont, prompt), cwd=project, env=env, capture_output=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL, start_new_session=True)
            report["turns"].append({"turn": turn + 1, "step": step, "exit": done.returncode,
                                    "seconds": round(time.monotonic() - t0, 2),
                                    "stdout": done.stdout.decode(errors="replace")[-2000:],
                                    "stderr": done.stderr.decode(errors="replace")[-4000:]})
    finally:
        server.stop(signal.SIGKILL)
        recorder.close()
        for r in recorder.records:
            r["dates"] = dates(r["body"])
        report["requests"] = recorder.records
        report["seconds"] = round(time.monotonic() - started, 2)
        report["shares"] = {step: [round(r["usage"]["cached"] / r["usage"]["prompt"], 4)
                                   for r in conversation(recorder.records, step) if r["usage"]["prompt"]]
                            for step in NEXTDAY_STEPS}
        (work / "report.json").write_text(json.dumps(report, indent=1))
    day1 = {d for r in recorder.records if r["step"].startswith("day1") for d in r["dates"]}
    for step in ("day2_continue", "day2_new"):
        for r in conversation(recorder.records, step):
            if not set(r["dates"]) - day1:
                raise ScenarioError(f"{step}'s request carries no new date ({r['dates']}; day 1: {sorted(day1)}): "
                                    f"the CLI's clock did not move; see {work / 'report.json'}")
    return report

def save_fixtures(report: dict[str, Any], data: Path) -> list[Path]:
    """Each step's conversation request of a next-day ``report`` (the last of its longest)
    as ``data/nextday_<cli>_<step>.json`` (the body as the CLI sent it, with the usage the
    server answered), for unit tests that replay them."""
    cli = report["cli"]
    name = "".join(c if c.isalnum() else "_" for c in cli)
    written = []
    for step in NEXTDAY_STEPS:
        convo = conversation(report["requests"], step)
        if not convo:
            continue
        r = convo[-1]
        target = data / f"nextday_{name}_{step}.json"
        target.write_text(json.dumps({
            "client": f"{PINS[cli][0]} {report['version']}",
            "captured": f"{time.strftime('%Y-%m-%d')}, tools/gates/agent_clis.py run {cli} --scenario nextday"
                        + "".join(f" --server-arg={a}" for a in report.get("server_args", [])),
            "what": f"the {step} step's conversation request (see nextday())", "path": r["path"],
            "usage": r["usage"], "dates": dates(r["body"]), "body": r["body"]}, indent=1) + "\n")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gates.agent_clis", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--install", action="store_true",
                   help="npm-install the pinned CLIs and print the prefix; exits 1, saying why, when it cannot")
    sub = p.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="drive one CLI through its three turns; writes WORK/report.json")
    r.add_argument("cli", choices=sorted(PINS))
    r.add_argument("--work", required=True, type=Path)
    r.add_argument("--scenario", choices=("turns", "nextday"), default="turns",
                   help="turns: three turns, a SIGKILL before the third; nextday: two days (see nextday())")
    r.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="an extra `kvstore serve` argument (repeatable; --server-arg=--stable-prefix)")
    r.add_argument("--fixtures", type=Path, metavar="DIR",
                   help="nextday: save each step's conversation request as DIR/nextday_<cli>_<step>.json")
    r.add_argument("--fixtures-from", type=Path, metavar="REPORT",
                   help="with --fixtures: save them from this report.json of an earlier run, running nothing")
    args = p.parse_args(argv)
    if args.install:
        try:
            print("\n".join(str(p) for p in install()))
        except InstallError as e:
            print(f"tools.gates.agent_clis: the agent CLIs could not be installed: {e}", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "run":
        why = nextday_missing(args.cli) if args.scenario == "nextday" else missing(args.cli)
        if why:
            print(f"tools.gates.agent_clis: {why}", file=sys.stderr)
            return 2
        if args.fixtures_from:
            for f in save_fixtures(json.loads(args.fixtures_from.read_text()), args.fixtures or Path(".")):
                print(f)
            return 0
        if args.scenario == "nextday":
            try:
                report = nextday(args.cli, args.work, args.server_arg)
            except ScenarioError as e:
                print(f"tools.gates.agent_clis: {e}", file=sys.stderr)
                return 1
            if args.fixtures:
                save_fixtures(report, args.fixtures)
            print(json.dumps({k: report[k] for k in ("cli", "seconds", "server_ready_seconds", "shares")}))
            return 0
        report = run(args.cli, args.work, server_args=args.server_arg)
        print(json.dumps({k: report[k] for k in ("cli", "seconds", "server_ready_seconds")}))
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
