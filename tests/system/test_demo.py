"""``tools/demo.py`` as a newcomer runs it: a real subprocess (two more inside it), twice
in a row on its default directory, then the commands it prints, then ``--clean``.

A short system prompt (``--tokens 100``) keeps it to about a minute on a 2-core CPU.
The default directory is the user cache dir's ``kvstore/demo``; ``XDG_CACHE_HOME`` points
it into the test's tmp dir (Linux), and ``KVSTORE_MODELS_DIR`` keeps the converted model
where it already is.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.models import requires_smollm2
from tools.testing.procs import end_group, start_group

ROOT = Path(__file__).resolve().parents[2]
NUM = r"(\d[\d,]*)"


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def demo_env(tmp_path: Path) -> dict[str, str]:
    from tools.testing.model_builds import models_dir

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "xdg"), KVSTORE_MODELS_DIR=str(models_dir()),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run(args: list[str], env: dict[str, str], timeout: float = 1800) -> subprocess.CompletedProcess:
    """``args`` in a process group of its own (the demo starts a process per step), ended
    with it whatever happens; ``timeout`` bounds a hang, not a busy machine."""
    proc = start_group(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        end_group(proc, grace=0)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def demo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    p = run([sys.executable, "tools/demo.py", *args], env)
    assert p.returncode == 0, p.stdout + p.stderr
    print(p.stdout + p.stderr)
    return p


def check_run(p: subprocess.CompletedProcess) -> dict[str, int]:
    """The counts one run prints, checked against each other and its progress lines."""
    out, err = p.stdout, p.stderr
    steps = re.findall(rf"prompt {NUM} tokens \({NUM}-token system prompt \+ {NUM} for the question\), "
                       rf"restored (.*)\n", out)
    assert len(steps) == 2, out
    (p1, s1, q1, r1), (p2, s2, q2, r2) = steps
    p1, s1, q1, p2, s2, q2 = map(_int, (p1, s1, q1, p2, s2, q2))
    assert s1 == s2 >= 100 and p1 == s1 + q1 and p2 == s2 + q2
    assert r1 == "0 (cold prefill)", r1
    restored = _int(re.fullmatch(rf"{NUM} from disk", r2).group(1))  # type: ignore[union-attr]
    assert s2 <= restored < p2
    # progress: one line per step (not a terminal), exact counts in the labels
    assert "\r" not in err
    assert re.search(rf"^look up {p1:,} prompt tokens: \d+\.\d s \(nothing stored\)$", err, re.M), err
    assert re.search(rf"^prefill {p1:,} of {p1:,} prompt tokens: \d+\.\d s, [\d,]+ tok/s$", err, re.M), err
    assert re.search(rf"^restore {restored:,} of {p2:,} prompt tokens: \d+\.\d s$", err, re.M), err
    assert re.search(rf"^prefill the last {p2 - restored:,} of {p2:,} prompt tokens \(the rest restored\): "
                     rf"\d+\.\d s$", err, re.M), err
    for n in (p1, p2):
        assert f"write {n:,} tokens' KV to disk (write-behind flush): " in err
    assert err.count("load model SmolLM2-135M-Instruct: ") == 2
    # after the prefill bar, the answer's generation is a step of its own (no silent seconds) ...
    assert len(re.findall(r"^first token after \d+\.\d\d s; generate the rest of the answer \(at most 24 "
                          r"tokens\): \d+\.\d s$", err, re.M)) == 2, err
    # ... and each process's whole time is accounted for, phase by phase
    wholes = re.findall(r"whole process (\d+\.\d) s: (.*)\n", out)
    assert len(wholes) == 2, out
    for whole, parts in wholes:
        seconds = [float(x) for x in re.findall(r"(\d+\.\d) s ", parts + " ")]
        assert "start Python, import MLX and mlx-lm" in parts and "generate the rest of the answer" in parts, parts
        assert "look up, restore and prefill (time to first token)" in parts and "load the model" in parts, parts
        assert abs(sum(seconds) - float(whole)) <= 0.1 * len(seconds), (whole, parts)
    assert f"Restored {restored:,} of {p2:,} prompt tokens from disk after a restart" in out
    return {"cold_prompt": p1, "prompt": p2, "restored": restored}


@requires_smollm2
def test_demo_twice_on_its_directory_then_clean(tmp_path: Path) -> None:
    env = demo_env(tmp_path)
    where = tmp_path / "xdg" / "kvstore" / "demo"

    first = demo(env, "--tokens", "100")
    assert f"cache directory: {where}\n" in first.stdout
    assert "earlier run" not in first.stdout
    counts = check_run(first)

    # the commands it prints work as printed, on what it stored
    lines = [line.strip() for line in first.stdout.splitlines() if line.startswith("  ") and " --cache-dir " in line]
    assert len(lines) == 2 and " ls --cache-dir " in lines[0] and " inspect " in lines[1], first.stdout
    commands = [shlex.split(line) for line in lines]
    assert all(c[-2:] == ["--cache-dir", str(where)] for c in commands), commands
    ls, inspect = (run(c, env) for c in commands)
    assert ls.returncode == 0 and "smollm2" in ls.stdout, ls.stdout + ls.stderr
    assert re.search(rf"\b{counts['prompt']}\b", ls.stdout) and re.search(rf"\b{counts['cold_prompt']}\b", ls.stdout)
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    assert f"first 32 of {counts['prompt']} tokens" in inspect.stdout
    assert "Which tool tells me tomorrow's weather" not in inspect.stdout  # beyond the first 32 tokens

    # a second run reuses the directory, says what it removed, and still shows a restore
    second = demo(env, "--tokens", "100")
    assert f"cache directory: {where}\n" in second.stdout
    gone = re.search(rf"^removed 2 entries \({NUM} tokens\) an earlier run stored for SmolLM2-135M-Instruct, "
                     r"so the first process starts cold$", second.stdout, re.M)
    assert gone and _int(gone.group(1)) == counts["cold_prompt"] + counts["prompt"], second.stdout
    assert check_run(second) == counts

    # --clean removes it; a directory the demo did not make is refused
    cleaned = demo(env, "--clean")
    assert f"removed {where} (" in cleaned.stdout and not where.exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    refused = run([sys.executable, "tools/demo.py", "--clean", "--cache-dir", str(other)], env)
    assert refused.returncode != 0 and "not made by the demo" in refused.stderr
    assert (other / "keep.txt").read_text() == "mine"


@pytest.mark.skipif(sys.platform != "linux", reason="XDG_CACHE_HOME places the default directory on Linux")
def test_demo_clean_without_a_directory(tmp_path: Path) -> None:
    p = run([sys.executable, "tools/demo.py", "--clean"], demo_env(tmp_path))
    assert p.returncode == 0 and "nothing to remove" in p.stdout, p.stdout + p.stderr
