"""A standing compatibility gate: vllm-mlx's own tests of ``MemoryAwarePrefixCache`` against
kvstore's class (``kvstore.adapters.vllm_mlx_batched.KVPrefixCache``).

    python -m tools.gates.upstream_vllm_mlx        # in a venv with vllm-mlx (tools/gates/compat_env.sh)

The suites come from the sdist of the installed vllm-mlx on PyPI (``pip download --no-deps
--no-binary :all: vllm-mlx==<version>``), extracted once into the user cache dir
(``.../kvstore/upstream/vllm_mlx-<version>/``) and run from there: no upstream code is copied
into this repository. They run twice, each in a fresh pytest process:

- ``vllm_mlx``: as upstream runs them;
- ``kvstore``: ``vllm_mlx.memory_cache.MemoryAwarePrefixCache`` (and the names the
  scheduler and the multimodal batch generator imported) replaced by kvstore's class before
  the suites import it, by this module loaded as a pytest plugin. Every instance gets a
  live disk tier (a temp cache dir) and a real identity: the tests' models are mocks, so
  ``model_path`` names tools.testing.model_builds' tiny-llama for all of them.

The gate: every test that passes on vllm-mlx's class passes on kvstore's, except the
deliberate differences in ``DELIBERATE`` (each listed, with its reason, in README.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tools.gates.upstream_mlx_lm import Outcome, parse_junit, upstream_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
# vllm-mlx's tests that exercise MemoryAwarePrefixCache (its own, and the scheduler's and
# the multimodal generator's use of it)
SUITES = ("tests/test_memory_cache.py", "tests/test_memory_cache_mlx.py",
          "tests/test_memory_cache_stream_safety.py", "tests/test_memory_cache_trim_failclosed.py",
          "tests/test_kv_cache_quantization.py", "tests/test_ssd_cache.py",
          "tests/test_prefix_cache.py", "tests/test_prefix_cache_untrimmable.py",
          "tests/test_mllm_ssd_spill.py", "tests/test_scheduler_prompt_save_failclosed.py",
          "tests/test_batching.py", "tests/test_prefix_cache_scheduler_parity.py",
          "tests/test_prefix_cache_real_model_parity.py", "tests/test_scheduler_max_kv_size.py",
          "tests/test_engine_core_request_owner.py", "tests/test_ssd_shutdown_wiring.py",
          "tests/test_mllm_continuous_batching.py")
MODE_ENV = "KVSTORE_UPSTREAM_MODE"
CACHE_ENV = "KVSTORE_UPSTREAM_CACHE_DIR"
DELIBERATE: dict[str, str] = {}


def vllm_mlx_version() -> str:
    from importlib.metadata import version

    return version("vllm-mlx")


def suites_dir(version: str | None = None) -> Path:
    """The extracted sdist of vllm-mlx ``version`` (default: the installed one), with its
    tests; downloaded and extracted once per machine, then reused."""
    from filelock import FileLock

    version = version or vllm_mlx_version()
    root = upstream_dir()
    final = root / f"vllm_mlx-{version}"
    if (final / "tests").is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"vllm_mlx-{version}.lock")):
        if (final / "tests").is_dir():
            return final
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--quiet", "-d", tmp, f"vllm-mlx=={version}"], check=True, timeout=600)
            sdist = next(Path(tmp).glob("vllm_mlx-*.tar.gz"))
            part = Path(tmp) / "x"
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers()
                           if m.name.startswith(f"vllm_mlx-{version}/tests/") and m.isfile()]
                tar.extractall(part, members=members, filter="data")
            (part / f"vllm_mlx-{version}").rename(final)
    return final


def run_suite(mode: str, work: Path, timeout: float = 3600) -> Outcome:
    """Run the upstream suites on ``mode`` ("vllm_mlx" or "kvstore") in a fresh process."""
    root = suites_dir()
    junit = work / f"{mode}.xml"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    env[MODE_ENV] = mode
    env[CACHE_ENV] = str(work / f"{mode}-cache")
    suites = [str(root / s) for s in SUITES if (root / s).is_file()]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tools.gates.upstream_vllm_mlx", "-p", "no:cacheprovider",
           "--rootdir", str(root), "-o", "addopts=", "-o", "pythonpath=", f"--junitxml={junit}", *suites]
    subprocess.run(cmd, cwd=root, env=env, timeout=timeout, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return Outcome(mode, parse_junit(junit))


def regressions(upstream: Outcome, ours: Outcome) -> list[str]:
    """Tests that pass on vllm-mlx's class and not on kvstore's, deliberate differences aside."""
    return sorted(t for t in upstream.passed - ours.passed if t not in DELIBERATE)


def gate(work: Path) -> tuple[Outcome, Outcome, list[str]]:
    """Both runs and the regressions (empty: the gate holds)."""
    upstream = run_suite("vllm_mlx", work)
    ours = run_suite("kvstore", work)
    return upstream, ours, regressions(upstream, ours)


# -- the pytest plugin (``-p tools.gates.upstream_vllm_mlx``) -----------------------------------


def pytest_configure(config: object) -> None:
    """In a "kvstore" run, make vllm-mlx's prefix cache kvstore's before the suites import it."""
    if os.environ.get(MODE_ENV) != "kvstore":
        return
    import vllm_mlx.memory_cache as memory_cache

    from kvstore.adapters import vllm_mlx_batched
    from tools.testing.model_builds import model_path

    vllm_mlx_batched.install(cache_dir=os.environ[CACHE_ENV], model_path=model_path(MODEL))
    memory_cache.MemoryAwarePrefixCache = vllm_mlx_batched.prefix_cache_class()  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.gates.upstream_vllm_mlx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default=None, help="where the runs keep their files (default: a temp dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        upstream, ours, bad = gate(work)
    print(f"vllm-mlx {vllm_mlx_version()}: {', '.join(SUITES)}")
    print(upstream.summary())
    print(ours.summary())
    for t, why in DELIBERATE.items():
        print(f"deliberate difference: {t}: {why}")
    for t in bad:
        print(f"REGRESSION: {t} passes on vllm-mlx's class, fails on kvstore's ({ours.results.get(t)})")
    gained = sorted(ours.passed - upstream.passed)
    for t in gained:
        print(f"passes on kvstore's class only: {t}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
