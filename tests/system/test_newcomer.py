"""What a newcomer meets first (issue 37), on real ``kvstore serve`` processes.

- a server that cannot listen (its port held by another socket) exits non-zero at once,
  naming the port, instead of hanging on mlx-lm's generation thread;
- ``kvstore serve`` without ``--model`` is a usage error (exit 2 naming the flag), not a
  server that says it is ready and serves nothing;
- after a restart, the server's log has one line per request restored from disk;
- a never-seen prompt that shares only a chat template's few header tokens with a stored
  one is a miss (``cached_tokens`` 0), not a tiny disk hit;
- the test suite says, under ``-q``, how many tests it runs and about how long, names each
  test model it builds on first use, and any test still running after a minute (a machine
  with its models built and quick tests sees the one summary line).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.children import child_env
from tests.support.servers import HOST, Server, cached_tokens, serve_command
from tools.testing.procs import end_group, start_group

HANG_S = 600.0  # a refused start that waits on mlx-lm's generation thread never ends: this bounds that hang only


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def run_serve(args: list[str], timeout: float = HANG_S) -> tuple[int, str]:
    """(exit code, stderr) of ``kvstore serve ARGS``; killed with its process group (and
    failed) if it is still running after ``timeout`` seconds."""
    proc = start_group(serve_command() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       stdin=subprocess.DEVNULL, text=True, env=child_env(PYTHONUNBUFFERED="1"))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_group(proc, grace=0)
        out, err = proc.communicate(10)
        pytest.fail(f"`kvstore serve {' '.join(args)}` still running after {timeout} s\n"
                    f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    finally:
        end_group(proc, grace=0)
    return proc.returncode, err


def test_a_taken_port_ends_the_server_at_once(model_dir: Path, tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind((HOST, 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, err = run_serve(["--model", str(model_dir), "--cache-dir", str(tmp_path / "c"),
                               "--host", HOST, "--port", str(port)])
    assert code != 0, err
    assert f"{HOST}:{port}" in err and "--port" in err, err


def test_serve_without_model_is_a_usage_error(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    code, err = run_serve(["--cache-dir", str(tmp_path / "c"), "--host", HOST, "--port", str(port)])
    assert code == 2, err
    assert "--model is required" in err, err


# -- after a restart -----------------------------------------------------------------------

SYSTEM = " ".join(f"Rule {i}: answer like a careful archivist and cite section {i * 7 % 31}." for i in range(12))
OTHER_SYSTEM = "Be brief. " + " ".join(f"Point {i}: never guess; say so." for i in range(8))


def chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@pytest.fixture(scope="module")
def restarted(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server that stored SYSTEM's chat on disk and stopped, then a new one on the same
    directory (memory tier empty): the restart every test below starts from."""
    root = tmp_path_factory.mktemp("restart")
    with Server(model_dir, root / "cache", root / "first.log") as first:
        first.chat(chat(SYSTEM, "Summarise the rules in one sentence."))
        first.wait_flushed()
        assert first.stop() == 0
    with Server(model_dir, root / "cache", root / "second.log") as second:
        second.cache_dir = root / "cache"  # type: ignore[attr-defined]
        yield second


def test_a_few_shared_header_tokens_are_no_disk_hit(restarted: Server, model_dir: Path) -> None:
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model_dir)
    a = tok.apply_chat_template(chat(SYSTEM, "x"), add_generation_prompt=True, tokenize=True)
    b = tok.apply_chat_template(chat(OTHER_SYSTEM, "What is rule 1?"), add_generation_prompt=True, tokenize=True)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert 0 < shared < 64, shared  # the template's system header and a little more: what this test is about
    resp = restarted.chat(chat(OTHER_SYSTEM, "What is rule 1?"))  # the first request: memory is empty
    assert cached_tokens(resp) == 0, resp
    assert restarted.stats().get("hits_disk", 0) == 0
    assert "kvstore: restored" not in restarted.log(1 << 20)


def test_a_restore_is_logged(restarted: Server) -> None:
    def restores() -> list[str]:
        return [ln for ln in restarted.log(1 << 20).splitlines() if "kvstore: restored" in ln]

    before = restores()
    resp = restarted.chat(chat(SYSTEM, "Which section does rule 3 cite?"))
    n = cached_tokens(resp)
    assert n > 0, resp
    lines = restores()[len(before):]
    assert len(lines) == 1, restarted.log()
    assert f"restored {n:,} of {resp['usage']['prompt_tokens']:,} prompt tokens from disk in " in lines[0], lines


def test_hints_name_the_cache_dir_given(tmp_path: Path) -> None:
    """A hint to run another command carries the --cache-dir the user gave, so it can be
    pasted as it is (it said `run kvstore ls`, which looks at the default directory)."""
    import sys

    from kvstore import KVStore

    KVStore(tmp_path / "c").close()
    for args, hint in ((["inspect", "abcdef"], "ls"), (["gc", "--identity", "abcdef"], "ls")):
        p = subprocess.run([sys.executable, "-m", "kvstore.cli", *args, "--cache-dir", str(tmp_path / "c")],
                           capture_output=True, text=True, env=child_env(), timeout=120)
        assert p.returncode == 1, p.stderr
        assert f"run `kvstore {hint} --cache-dir {tmp_path / 'c'}`" in p.stderr, p.stderr


def test_inspect_decodes_the_prompt_without_transformers(model_dir: Path, tmp_path: Path) -> None:
    """``kvstore inspect`` decodes the prompt from the model's tokenizer.json with the
    ``tokenizers`` library, not by importing transformers (seconds of start-up)."""
    import json
    import sys

    system = "You keep the storage team's runbook short and exact. " * 4
    (tmp_path / "system.txt").write_text(system)
    env = child_env()
    cache = str(tmp_path / "c")
    p = subprocess.run([sys.executable, "-m", "kvstore.cli", "warm", "--model", str(model_dir), "--system-file",
                        str(tmp_path / "system.txt"), "--cache-dir", cache], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    entry = json.loads(subprocess.run([sys.executable, "-m", "kvstore.cli", "ls", "--json", "--cache-dir", cache],
                                      capture_output=True, text=True, env=env, timeout=120).stdout
                       )["identities"][0]["entries"][0]["id"]
    script = ("import json, sys\nfrom kvstore.cli.main import main\nrc = main(sys.argv[1:])\n"
              "print(json.dumps({'rc': rc, 'transformers': 'transformers' in sys.modules}), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", script, "inspect", entry, "--prompt", "--cache-dir", cache],
                       capture_output=True, text=True, env=env, timeout=120)
    got = json.loads(p.stderr.strip().splitlines()[-1])
    assert got == {"rc": 0, "transformers": False}, p.stderr
    assert system.strip() in p.stdout, p.stdout


def test_the_upstream_suite_says_what_it_needs_when_pypi_is_out_of_reach(tmp_path: Path) -> None:
    """With no cached copy and no registry, fetching mlx-lm's server suite stops with a
    message saying what to run, and where (README's test command fetches it at install)."""
    import sys

    script = ("from tools.gates import upstream_mlx_lm\n"
              "try:\n    upstream_mlx_lm.suite_path()\n"
              "except upstream_mlx_lm.SuiteMissing as e:\n    print('MISSING', e)\n")
    env = child_env(XDG_CACHE_HOME=str(tmp_path / "xdg"), PIP_INDEX_URL="http://127.0.0.1:9/simple",
                    PIP_RETRIES="0", PIP_TIMEOUT="2", PIP_NO_CACHE_DIR="1", PIP_CONFIG_FILE=os.devnull)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert p.stdout.startswith("MISSING"), p.stdout + p.stderr
    assert "python -m tools.gates.upstream_mlx_lm --fetch" in p.stdout and "PyPI" in p.stdout, p.stdout


def test_export_says_what_the_file_holds_and_warns_on_a_conversation(restarted: Server, tmp_path: Path) -> None:
    """`kvstore export` says the file holds the whole prompt's KV that mlx-lm continues
    after, and warns when the entry is a conversation (it ends inside a chat)."""
    import json
    import sys

    cache = str(restarted.cache_dir)  # type: ignore[attr-defined]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvstore.cli", *args, "--cache-dir", cache],
                              capture_output=True, text=True, env=child_env(), timeout=300)

    entries = [e for i in json.loads(cli("ls", "--json").stdout)["identities"] for e in i["entries"]]
    kinds = {e["cache_type"]: e["id"] for e in entries}
    assert "system" in kinds and "assistant" in kinds, entries
    for kind, entry in kinds.items():
        p = cli("export", entry, str(tmp_path / f"{kind}.safetensors"))
        assert p.returncode == 0, p.stderr
        assert f"holds the KV of this entry's whole prompt ({kind} entry)" in p.stdout, p.stdout
        assert ("ends inside a conversation" in p.stderr) == (kind != "system"), (kind, p.stderr)


def test_a_first_run_of_the_suite_says_what_it_builds_and_what_runs_long(tmp_path: Path) -> None:
    """A real pytest run under -q (this suite's conftest as a plugin) on a test that loads a
    model and one that runs past the still-running threshold (1 s here), into an empty models
    dir and then again into the same one."""
    (tmp_path / "test_one.py").write_text("import time\n\n\ndef test_model(load_named):\n"
                                          "    load_named('tiny-llama')\n\n\ndef test_long():\n    time.sleep(3)\n")
    env = child_env(KVSTORE_MODELS_DIR=str(tmp_path / "models"), KVSTORE_TEST_STILL_RUNNING_S="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
           "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")]

    def run() -> list[str]:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=str(ROOT), env=env)
        assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout + p.stderr
        return [line for line in p.stdout.splitlines() if line.startswith("kvstore:")]

    first = run()
    from tools.measured import pytest_estimate

    assert first[0].startswith(f"kvstore: 2 tests, {pytest_estimate(2, 0)}; "), first  # README's runs, scaled
    assert f"test models to build on first use, seconds each, once per machine, into {tmp_path / 'models'}" in first[0]
    assert first[1] == "kvstore: building test model tiny-llama (once per machine) ...", first
    # test_long says so after 1 s, again after 2 s (test_model may take over 1 s too, when busy)
    long = [f"kvstore: still running test_one.py::test_long after {n} s (a few tests take minutes)" for n in (1, 2)]
    assert [line for line in first if "test_long" in line] == long, first
    again = run()  # tiny-llama is built now: no build line, one model fewer to build
    assert again[0].startswith(f"kvstore: 2 tests, {pytest_estimate(2, 0)}; ") and again[-2:] == long, again
    assert not any("building" in line for line in again), again
    missing = [int(line.split("; ")[1].split()[0]) for line in (first[0], again[0])]
    assert missing[1] == missing[0] - 1, (first, again)


def test_readme_states_the_measured_runs_the_estimates_use() -> None:
    """README's figures are tools/measured.py's (`python -m tools.measured` prints the
    paragraph), the same runs pytest's first line and the demo's estimate scale."""
    import re

    from tools.measured import readme_paragraph

    readme = " ".join((ROOT / "README.md").read_text().split())
    assert readme_paragraph() in readme, "README's figures differ from tools/measured.py: paste `python -m tools.measured`"
    for stale in ("704 tests in 19 min", "not slowed by load", "slows all but the install"):
        assert stale not in readme, stale
    assert not re.search(r"\b(?:SECONDS_PER_TOKEN|OTHER_SECONDS|FAST_S_PER_TEST)\b",
                         (ROOT / "tools" / "demo.py").read_text() + (ROOT / "tests" / "conftest.py").read_text())


def test_two_workers_say_the_same_as_one_process(tmp_path: Path) -> None:
    """README's `-n 2` (pytest-xdist): the workers have no terminal, so the controller says
    the first line (scaled to two workers), builds a missing test model before the workers
    start (saying so) and says which test is still running."""
    import os
    import shutil

    from tools.testing import model_builds

    for name in model_builds.MODELS:  # what this machine has built, linked, but for tiny-llama
        if not model_builds.MODELS[name].on_demand:
            model_builds.model_path(name)
    models = tmp_path / "models"
    models.mkdir()
    built = model_builds.models_dir()
    for d in built.iterdir():
        if d.is_dir() and not d.name.startswith("tiny-llama-v"):
            shutil.copytree(d, models / d.name, copy_function=os.link)  # linked, not copied
    (tmp_path / "test_one.py").write_text("import time\n\n\ndef test_model(load_named):\n"
                                          "    load_named('tiny-llama')\n\n\ndef test_long():\n    time.sleep(3)\n")
    env = child_env(KVSTORE_MODELS_DIR=str(models), KVSTORE_TEST_STILL_RUNNING_S="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-p", "tests.conftest",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")],
                       capture_output=True, text=True, timeout=600, cwd=str(ROOT), env=env)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout + p.stderr
    said = [line for line in p.stdout.splitlines() if line.startswith("kvstore:")]
    from tools.measured import pytest_estimate

    assert said[0].startswith(f"kvstore: 2 tests, {pytest_estimate(2, 0, workers=2)}; 1 test models to build"), said
    assert said[1].startswith("kvstore: building test model tiny-llama") and said[1].endswith(
        " (once per machine) ..."), said  # the build's first name (tiny-llama and tiny-llama-q share it)
    assert "kvstore: still running test_one.py::test_long after 1 s (a few tests take minutes)" in said, said
    assert any(d.name.startswith("tiny-llama-v") for d in models.iterdir()) and os.listdir(built)
