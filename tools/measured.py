"""How long README's two commands take: the one source of README's figures, pytest's first
line (tests/conftest.py) and the demo's estimate (tools/demo.py).

Each run below is one measurement of one command, run exactly as README writes it from a
fresh clone with an empty HOME on 2 x86 cores (Debian's Python; OpenBLAS installed unless
the run says ``blas: "reference"``): ``quiet`` alone on the machine, ``busy`` beside other
work (``load``: the 1-minute load average seen during the run). Replace a run's figures
only with those of a new run, all of them together, then paste ``python -m tools.measured``
into README (tests/system/test_newcomer.py checks README says exactly that paragraph).
"""

from __future__ import annotations

# Command 1: install, then `python tools/demo.py` (its cold prefill of `prefill_tokens`).
# quiet: main 3bc9ab1, 2026-11-28; busy: main 5209c45, the same day, beside seven other jobs;
# reference: an earlier quiet run (this machine ran its prefill about 2.2x faster that day).
DEMO = {
    "quiet": {"load": "0.5-1.4", "total_s": 204, "install_s": 51, "prefill_tokens": 4031, "prefill_s": 130.1},
    "busy": {"load": "6.2-19.6", "total_s": 995, "install_s": 215, "prefill_tokens": 4031, "prefill_s": 693.4},
    # `KVSTORE_NO_OPENBLAS=1 python tools/demo.py` (--tokens defaults to 2,000 there), quiet
    "reference": {"load": None, "total_s": 884, "install_s": 0, "prefill_tokens": 2032, "prefill_s": 621.6},
}
CONVERT_S = 3  # the demo's one-time GGUF conversion, when this machine has not converted it yet (2.1 s quiet)

# Command 2: install, fetch mlx-lm's server suite, then `python -m pytest -q -n 2 tests`
# (quiet: README's command, main cf2b632; its fast tier: `python -m pytest -q -m "not slow"
# tests`, one process, main 3bc9ab1). serial: the same suite in one process, `python -m pytest
# -q tests`, quiet, main 3bc9ab1 (its per-test rates are what pytest's first line scales);
# busy: README's command, main b885a30, beside a second run of README's command from another
# fresh clone started 20 s later (load mean 8.0; both exit 0). All 2026-11-28.
TESTS = {
    "quiet": {"load": "0.9-3.6", "total_s": 1110, "install_s": 112, "tests": 802, "pytest_s": 1006,
              "fast_tests": 582, "fast_s": 208},
    "busy": {"load": "1.0-14.1", "total_s": 2923, "install_s": 126, "tests": 803, "pytest_s": 2811},
    "serial": {"load": "0.9-1.8", "tests": 801, "pytest_s": 1768},
}


def _demo_s(run: dict) -> float:
    return run["total_s"] - run["install_s"]


def rates_per_test() -> tuple[float, float]:
    """(seconds per fast test, per slow test) on 2 quiet cores in one process, from the quiet
    serial run (``serial``) and the quiet fast tier."""
    q, one = TESTS["quiet"], TESTS["serial"]
    slow = one["tests"] - q["fast_tests"]
    return q["fast_s"] / q["fast_tests"], (one["pytest_s"] - q["fast_s"]) / slow


def busy_factor(runs: dict) -> float:
    """How much longer the busy run of a command took than its quiet one (after the install)."""
    if "pytest_s" in runs["busy"]:  # both test runs are README's command (two workers)
        return runs["busy"]["pytest_s"] / runs["quiet"]["pytest_s"]
    return _demo_s(runs["busy"]) / _demo_s(runs["quiet"])


def pytest_estimate(fast: int, slow: int, workers: int = 1) -> str:
    """pytest's first line: the run of ``fast`` + ``slow`` tests, quiet and busy, in one
    process or (``workers`` 2, README's ``-n 2``) two, scaled by the measured gain of two."""
    per_fast, per_slow = rates_per_test()
    quiet = fast * per_fast + slow * per_slow
    if workers > 1:
        quiet *= TESTS["quiet"]["pytest_s"] / TESTS["serial"]["pytest_s"]
    return (f"about {minutes(quiet)} on 2 quiet cores, {minutes(quiet * busy_factor(TESTS))} beside a load of "
            f"{TESTS['busy']['load']}")


def demo_estimate(blas: str, tokens: int, convert: bool) -> tuple[float, float, float]:
    """(whole demo, of it the cold prefill, the same on a busy machine) in seconds, for
    ``tokens`` of system prompt on ``blas`` ("openblas" or "reference")."""
    run = DEMO["quiet" if blas == "openblas" else "reference"]
    prefill = tokens * run["prefill_s"] / run["prefill_tokens"]
    total = prefill + _demo_s(run) - run["prefill_s"] + (CONVERT_S if convert else 0)
    return total, prefill, total * busy_factor(DEMO)


def minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def readme_paragraph() -> str:
    """README's paragraph of figures, from the runs above."""
    q, b, r = DEMO["quiet"], DEMO["busy"], DEMO["reference"]
    tq, tb, ts = TESTS["quiet"], TESTS["busy"], TESTS["serial"]
    return (
        f"Measured from a fresh clone with an empty HOME on 2 x86 cores, Debian's Python and OpenBLAS "
        f"(`sudo apt-get install libopenblas0-pthread`, used automatically): the first command took "
        f"{minutes(q['total_s'])} on a quiet machine (the install {minutes(q['install_s'])}, the demo's "
        f"{q['prefill_tokens']:,}-token cold prefill {minutes(q['prefill_s'])}) and {minutes(b['total_s'])} beside "
        f"a load of {b['load']} (the install {minutes(b['install_s'])}, the prefill {minutes(b['prefill_s'])}); "
        f"without OpenBLAS (MLX's reference BLAS) the demo prefills {r['prefill_tokens']:,} tokens in "
        f"{minutes(r['prefill_s'])} instead. The second command took {minutes(tq['total_s'])} quiet (the install "
        f"and the fetch {minutes(tq['install_s'])}, then {tq['tests']:,} tests in {minutes(tq['pytest_s'])} in two "
        f"workers; in one process, `python -m pytest -q tests`, {ts['tests']:,} tests took "
        f"{minutes(ts['pytest_s'])}; the fast tier, `-m \"not slow\"`, {tq['fast_tests']:,} of them, in "
        f"{minutes(tq['fast_s'])}) and {minutes(tb['total_s'])} beside a second run of the same command, "
        f"a load of {tb['load']} (the install and the fetch {minutes(tb['install_s'])}, {tb['tests']:,} tests in "
        f"{minutes(tb['pytest_s'])}, both runs exit 0), with or without OpenBLAS. A busy machine slows every step, the install too. pytest's first line (today's test count "
        f"and its estimate) and the demo's estimate come from these same runs (tools/measured.py).")


if __name__ == "__main__":
    import textwrap

    print(textwrap.fill(readme_paragraph(), 95))
