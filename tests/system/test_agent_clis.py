"""The real coding-agent CLIs against a real ``kvstore serve``: the ``agents`` tier.

Claude Code (2.1.332, and 2.1.197 one minor version back), OpenCode and Codex CLI (pinned npm releases, tools/gates/agent_clis.py; `.ci/run`
installs them, ``python -m tools.gates.agent_clis --install`` anywhere npm's registry is
reachable; where they are missing the tests skip, naming that command, except under CI,
where they fail) each run three non-interactive turns of one conversation against
``kvstore serve`` on tiny-qwen-tools (the real Qwen BPE tokenizer, a template that renders tools), the server
SIGKILLed and restarted on the same cache directory before the third, configured with the
model id ``tiny``. Every request passes a recording proxy. Asserted: every request answered
2xx, every turn's CLI exits 0, and the conversation's requests of turns 2 and 3 read >= 95%
of their prompt from the cache (the usage the server answered). The next-day scenario
(issue 54.5; libfaketime moves Claude Code's and OpenCode's clock, a time zone Codex's,
``faketime`` installed by `.ci/run`, missing: a skip here, a failure under CI) asserts the
same of each day-2 request, a continue and a new session, with the server's default settings. The gate runs in a network
namespace with only loopback (``unshare -n``, as root) so no traffic can leave 127.0.0.1;
where that is unavailable, each CLI's proxies point at a dead loopback port instead.
Run alone with ``pytest -m agents``; about 1-3 minutes per CLI on 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tools.gates import agent_clis

pytestmark = [pytest.mark.slow, pytest.mark.agents]


def isolated(command: list[str]) -> tuple[list[str], str]:
    """``command`` in a new network namespace whose only interface is loopback, when this
    process may make one; else ``command`` as it is (its CLIs' proxies lead nowhere)."""
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip") and \
            subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command], "netns"
    return command, "dead proxies"


def conversation(requests: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
    """Turn ``turn``'s requests of the conversation itself: the ones carrying its longest
    prompt (a title or summary request of the same turn is shorter)."""
    mine = [r for r in requests if r["turn"] == turn and r["usage"]]
    longest = max((r["usage"]["prompt"] for r in mine), default=0)
    return [r for r in mine if r["usage"]["prompt"] >= longest * 0.9]


@pytest.mark.parametrize("cli", sorted(agent_clis.PINS))
def test_three_turns_and_a_sigkill_read_the_prompt_from_the_cache(cli: str, tmp_path: Path) -> None:
    why = agent_clis.missing(cli)
    if why and agent_clis.in_ci():  # CI must run the gate: a skip there would pass unseen
        pytest.fail(f"CI is set and {why}")
    if why:
        pytest.skip(why)
    command, isolation = isolated([sys.executable, "-m", "tools.gates.agent_clis", "run", cli, "--work", str(tmp_path)])
    done = subprocess.run(command, cwd=agent_clis.REPO_ROOT, capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    report = json.loads((tmp_path / "report.json").read_text())
    requests, turns = report["requests"], report["turns"]
    shown = json.dumps({"isolation": isolation, "turns": turns,
                        "requests": [{k: r[k] for k in ("turn", "method", "path", "status", "usage")} for r in requests]},
                       indent=1)
    assert [t["exit"] for t in turns] == [0, 0, 0], shown
    assert requests and all(200 <= r["status"] < 300 for r in requests), shown
    # each CLI names the model by its configured id, not the served path: any name answers
    assert {r["body"].get("model") for r in requests if isinstance(r["body"], dict)} == {agent_clis.MODEL_ID}, shown
    for turn in (1, 2):  # the second turn, and the third (after the SIGKILL and restart)
        convo = conversation(requests, turn)
        assert convo, shown
        for r in convo:
            assert r["usage"]["cached"] >= 0.95 * r["usage"]["prompt"], shown
    print(f"{cli} {report['version']} ({isolation}): {report['seconds']} s; cached share per turn: " + ", ".join(
        f"turn {t + 1}: " + "/".join(f"{r['usage']['cached'] / r['usage']['prompt']:.1%}" for r in conversation(requests, t))
        for t in range(3)))


@pytest.mark.parametrize("cli", sorted(agent_clis.PINS))
def test_next_day_continue_and_new_session_read_the_prompt_from_the_cache(cli: str, tmp_path: Path) -> None:
    """Issue 54.5: day 1 a first turn and a continue in a git tree; the server stopped
    (SIGTERM, its queue empty), the tree changed, the CLI's clock a day on (the scenario
    fails when a day-2 request carries no new date); day 2, the server restarted on the same
    cache dir with its default settings, a continue and a new session asking day 1's first
    question: each day-2 conversation request reads >= 95% of its prompt from the cache."""
    why = agent_clis.nextday_missing(cli)
    if why and agent_clis.in_ci():  # CI must run the gate: a skip there would pass unseen
        pytest.fail(f"CI is set and {why}")
    if why:
        pytest.skip(why)
    command, isolation = isolated([sys.executable, "-m", "tools.gates.agent_clis", "run", cli, "--work", str(tmp_path),
                                   "--scenario", "nextday"])
    done = subprocess.run(command, cwd=agent_clis.REPO_ROOT, capture_output=True, text=True, timeout=3600)
    report = json.loads((tmp_path / "report.json").read_text())
    requests, turns = report["requests"], report["turns"]
    shown = json.dumps({"isolation": isolation, "turns": turns, "shares": report["shares"],
                        "requests": [{k: r[k] for k in ("step", "method", "path", "status", "usage", "dates")}
                                     for r in requests]}, indent=1)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{shown}"
    assert [t["exit"] for t in turns] == [0, 0, 0, 0], shown
    assert report["server_exit"] == 0, shown  # SIGTERM: a clean stop, everything stored
    assert requests and all(200 <= r["status"] < 300 for r in requests), shown
    for step in ("day2_continue", "day2_new"):
        convo = agent_clis.conversation(requests, step)
        assert convo, shown
        for r in convo:
            assert r["usage"]["cached"] >= 0.95 * r["usage"]["prompt"], shown
    print(f"{cli} {report['version']} next day ({isolation}): {report['seconds']} s; cached share per step: "
          + json.dumps(report["shares"]))
