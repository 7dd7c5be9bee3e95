"""A standing compatibility gate: mlx-lm's own ``tests/test_server.py`` against kvstore's server.

    python -m tools.gates.upstream_mlx_lm            # run it on both servers; exit 1 on a regression
    python -m tools.gates.upstream_mlx_lm --fetch    # only download the suite (needs PyPI; once)

The suite comes from the sdist of the installed mlx-lm on PyPI (``pip download --no-deps
--no-binary :all: mlx-lm==<version>``), downloaded once into the user cache dir
(``.../kvstore/upstream/mlx_lm-<version>/``) and run from there: no upstream code is
copied into this repository. README's test command and ``.ci/run`` fetch it at install
time (``--fetch``), so the tests need no network; a run that finds it missing and cannot
download it stops with ``SuiteMissing``, saying what to run where PyPI is reachable. It runs twice, each in a fresh pytest process:

- ``mlx_lm``: plain mlx_lm.server, as upstream runs it;
- ``kvstore``: the same suite with kvstore's server named in before the suite imports
  mlx_lm.server's names (``kvstore.serve.server.patch``: its ``APIHandler`` and
  ``ResponseGenerator`` kvstore's subclasses, which the suite constructs itself with
  mlx-lm's arguments; kvstore's ``LRUPromptCache`` with a disk tier in a temp dir), by this
  module loaded as a pytest plugin.

The suite loads ``mlx-community/Qwen1.5-0.5B-Chat-4bit`` from the Hugging Face hub; a
private hub cache (``HF_HUB_CACHE``, offline) holds tiny-llama (tools/testing/model_builds.py) under that
name (tiny-llama-hd64), so both runs load the same local model and kvstore derives its identity from it.

The gate: every test that passes on mlx_lm.server passes on kvstore, except the
deliberate differences in ``DELIBERATE`` (each listed, with its reason, in docs/serve.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HUB_MODEL = "mlx-community/Qwen1.5-0.5B-Chat-4bit"  # what upstream's DummyModelProvider loads
MODEL = "tiny-llama-hd64"  # tools/testing/model_builds.py: head_dim 64 fits the suite's kv_bits=4, group 64
SUITE = "tests/test_server.py"
MODE_ENV = "KVSTORE_UPSTREAM_MODE"  # "kvstore": this module, as a pytest plugin, patches
CACHE_ENV = "KVSTORE_UPSTREAM_CACHE_DIR"
# test id -> why kvstore differs on purpose (also in README.md, "Deliberate differences")
DELIBERATE: dict[str, str] = {}


def mlx_lm_version() -> str:
    import mlx_lm

    return mlx_lm.__version__


def upstream_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstore")) / "upstream"


class SuiteMissing(RuntimeError):
    """mlx-lm's tests/test_server.py is not cached and could not be downloaded."""


def suite_path(version: str | None = None, *, say: bool = False) -> Path:
    """``tests/test_server.py`` of mlx-lm ``version`` (default: the installed one), from its
    sdist on PyPI; downloaded and extracted once per machine (a file lock keeps parallel
    runs from racing), then reused. ``say``: tell stderr what is fetched and why, and let
    pip show its own progress (``--fetch``: a minute or two with no word is a hang to a user)."""
    import time

    from filelock import FileLock

    version = version or mlx_lm_version()
    root = upstream_dir()
    final = root / f"mlx_lm-{version}" / SUITE
    if final.is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"mlx_lm-{version}.lock")):
        if final.is_file():
            return final
        t0 = time.monotonic()
        if say:
            print(f"fetching mlx-lm {version}'s source distribution from PyPI with pip (about 0.5 MB; pip "
                  f"then installs build tools to read its metadata: a minute or two on a busy machine) for its {SUITE}, which "
                  f"tests/system/test_upstream_server.py runs against kvstore; once per machine, into {final.parent}",
                  file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", "-d", tmp, f"mlx-lm=={version}"]
            # said: pip's own lines and progress bar on this terminal; else quiet, its error kept
            got = subprocess.run(cmd if say else [*cmd, "--quiet"], capture_output=not say, text=True,
                                 stdout=sys.stderr if say else None, timeout=1800)
            sdist = next(Path(tmp).glob("mlx_lm-*.tar.gz"), None)
            if got.returncode != 0 or sdist is None:
                why = ((got.stderr or "").strip().splitlines() or ["no sdist downloaded (pip's output is above)"])[-1]
                raise SuiteMissing(
                    f"mlx-lm {version}'s {SUITE} (the upstream server suite) is not in {final.parent} and "
                    f"`pip download mlx-lm=={version}` (its sdist from PyPI) failed: {why}. Fetch it once where "
                    f"PyPI is reachable: `python -m tools.gates.upstream_mlx_lm --fetch` (README's test command and "
                    f".ci/run do this at install time)")
            with tarfile.open(sdist) as tar:
                member = tar.getmember(f"mlx_lm-{version}/{SUITE}")
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
            final.parent.mkdir(parents=True, exist_ok=True)
            part = final.with_suffix(".part")
            part.write_bytes(data)
            part.rename(final)
        if say:
            print(f"fetched {SUITE} of mlx-lm {version} in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return final


def fake_hub(root: Path, model_dir: Path) -> Path:
    """A Hugging Face hub cache under ``root`` holding ``model_dir`` as ``HUB_MODEL`` (its
    files symlinked into one snapshot): what ``HF_HUB_CACHE`` then points at."""
    repo = root / ("models--" + HUB_MODEL.replace("/", "--"))
    rev = "0" * 40
    snap = repo / "snapshots" / rev
    if not snap.is_dir():
        snap.mkdir(parents=True)
        for f in model_dir.iterdir():
            if f.is_file():
                (snap / f.name).symlink_to(f)
        # mlx_lm.server lists a hub model under /v1/models when it has this file too
        (snap / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return root


@dataclass
class Outcome:
    """One suite run: test id -> "passed" | "failed" | "error" | "skipped"."""

    mode: str
    results: dict[str, str] = field(default_factory=dict)

    def count(self, what: str) -> int:
        return sum(1 for r in self.results.values() if r == what)

    @property
    def passed(self) -> set[str]:
        return {t for t, r in self.results.items() if r == "passed"}

    def summary(self) -> str:
        return (f"{self.mode}: {self.count('passed')} passed, {self.count('failed')} failed, "
                f"{self.count('error')} errors, {self.count('skipped')} skipped")


def run_suite(mode: str, work: Path, timeout: float = 1800) -> Outcome:
    """Run the upstream suite on ``mode`` ("mlx_lm" or "kvstore") in a fresh process."""
    from tools.testing.model_builds import model_path

    hub = fake_hub(work / "hub", model_path(MODEL))
    junit = work / f"{mode}.xml"
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    env[MODE_ENV] = mode
    env[CACHE_ENV] = str(work / f"{mode}-cache")
    suite = suite_path()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tools.gates.upstream_mlx_lm", "-p", "no:cacheprovider",
           "--rootdir", str(suite.parent), "-o", "addopts=", "-o", "pythonpath=",
           f"--junitxml={junit}", str(suite)]
    subprocess.run(cmd, cwd=suite.parent, env=env, timeout=timeout, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return Outcome(mode, parse_junit(junit))


def parse_junit(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[name] = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed").replace(
            "failure", "failed")
    return out


def regressions(upstream: Outcome, ours: Outcome) -> list[str]:
    """Tests that pass on mlx_lm.server and not on kvstore, deliberate differences aside."""
    return sorted(t for t in upstream.passed - ours.passed if t not in DELIBERATE)


def gate(work: Path) -> tuple[Outcome, Outcome, list[str]]:
    """Both runs and the regressions (empty: the gate holds)."""
    upstream = run_suite("mlx_lm", work)
    ours = run_suite("kvstore", work)
    return upstream, ours, regressions(upstream, ours)


# -- the pytest plugin (``-p tools.gates.upstream_mlx_lm``) -------------------------------------


def pytest_configure(config: object) -> None:
    """In a "kvstore" run, make mlx_lm.server kvstore's server before the suite imports it."""
    if os.environ.get(MODE_ENV) != "kvstore":
        return
    import mlx_lm.server as server_mod

    from kvstore.serve.server import patch

    patch(server_mod, cache_dir=os.environ[CACHE_ENV])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gates.upstream_mlx_lm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default=None, help="where the runs keep their files (default: a temp dir)")
    p.add_argument("--fetch", action="store_true",
                   help="only download the suite into the user cache dir (needs PyPI) and print its path")
    args = p.parse_args(argv)
    if args.fetch:
        try:
            print(suite_path(say=True))
        except SuiteMissing as e:
            print(f"tools.gates.upstream_mlx_lm: {e}", file=sys.stderr)
            return 1
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        upstream, ours, bad = gate(work)
    print(f"mlx-lm {mlx_lm_version()} tests/test_server.py")
    print(upstream.summary())
    print(ours.summary())
    for t, why in DELIBERATE.items():
        print(f"deliberate difference: {t}: {why}")
    for t in bad:
        print(f"REGRESSION: {t} passes on mlx_lm.server, fails on kvstore ({ours.results.get(t)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
