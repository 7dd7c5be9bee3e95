"""The agent CLIs' gate cannot pass unseen (issue 52.14): ``python -m tools.gates.agent_clis
--install`` exits non-zero, saying why, when it cannot install the CLIs (no npm on PATH, npm
failing, npm "succeeding" without installing them), and tests/system/test_agent_clis.py fails
under CI (``CI=true``) where the CLIs are missing, while a developer's run without them skips
with the install hint. Real child processes: the install tool, and pytest on that module,
each with an empty user cache dir (``XDG_CACHE_HOME``), so nothing installed here counts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.children import child_env
from tools.gates import agent_clis

INSTALL = "python -m tools.gates.agent_clis --install"


def install(tmp_path: Path, npm: str | None) -> subprocess.CompletedProcess[str]:
    """The install tool run with PATH holding only ``tmp/bin`` (``npm``: that script there)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if npm is not None:
        (bin_dir / "npm").write_text("#!/bin/sh\n" + npm)
        (bin_dir / "npm").chmod(0o755)
    env = child_env(PATH=str(bin_dir), XDG_CACHE_HOME=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "tools.gates.agent_clis", "--install"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_install_without_npm_exits_non_zero_saying_so(tmp_path: Path) -> None:
    done = install(tmp_path, None)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "could not be installed" in done.stderr and "npm is not on PATH" in done.stderr, done.stderr
    assert INSTALL in done.stderr and done.stdout == "", (done.stdout, done.stderr)


def test_install_with_npm_failing_exits_non_zero_with_npms_status(tmp_path: Path) -> None:
    done = install(tmp_path, 'echo "npm ERR! code ENOTFOUND registry.npmjs.org" >&2\nexit 7\n')
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "npm ERR! code ENOTFOUND" in done.stderr and "exited with 7" in done.stderr, done.stderr
    assert done.stdout == "", done.stdout


def test_install_with_npm_exiting_0_but_installing_nothing_exits_non_zero(tmp_path: Path) -> None:
    done = install(tmp_path, 'echo "$@" > "${0%/*}/called"\nexit 0\n')
    assert (tmp_path / "bin" / "called").read_text().startswith("install --prefix"), done.stderr  # npm was run
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "the CLIs are not there" in done.stderr and agent_clis.PINS["claude"][0] in done.stderr, done.stderr


@pytest.mark.parametrize("ci", ["true", None])
def test_missing_clis_fail_the_tier_under_ci_and_skip_outside_it(ci: str | None, tmp_path: Path) -> None:
    env = child_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider",
                           "tests/system/test_agent_clis.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = done.stdout + done.stderr
    n = 2 * len(agent_clis.PINS)  # per pin: the three turns and the next day
    if ci is None:  # a developer's machine: skipped, naming the command
        assert done.returncode == 0 and f"{n} skipped" in out and "failed" not in out, out[-3000:]
        assert INSTALL in out, out[-3000:]
    else:
        assert done.returncode == 1 and f"{n} failed" in out and "skipped" not in out, out[-3000:]
        assert "CI is set and" in out and INSTALL in out, out[-3000:]


def test_ci_is_read_as_ci_services_set_it() -> None:
    assert all(agent_clis.in_ci({"CI": v}) for v in ("true", "True", "1", "yes"))
    assert not any(agent_clis.in_ci(e) for e in ({}, {"CI": ""}, {"CI": "0"}, {"CI": "false"}, {"CI": "no"}))



def test_missing_libfaketime_fails_the_next_day_tests_under_ci(tmp_path: Path) -> None:
    """Claude Code's and OpenCode's next-day tests need libfaketime (their clock): under CI
    its absence (``KVSTORE_LIBFAKETIME`` naming no file) fails them, naming the package;
    Codex's (a time zone moves its clock) do not name it."""
    env = child_env(XDG_CACHE_HOME=str(tmp_path / "cache"), KVSTORE_LIBFAKETIME=str(tmp_path / "none.so.1"), CI="true")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-k", "next_day",
                           "tests/system/test_agent_clis.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and f"{len(agent_clis.PINS)} failed" in out and "skipped" not in out, out[-3000:]
    for cli in agent_clis.PINS:
        line = next(x for x in out.splitlines() if x.startswith("FAILED") and f"[{cli}]" in x)
        assert ("libfaketime is not installed" in line) == (agent_clis.family(cli) != "codex"), line
