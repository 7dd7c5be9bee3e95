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
# (load None: the run did not record it; the quiet runs are main's README figures, the busy
# ones issue 46's, main d92c1bf.)
DEMO = {
    "quiet": {"load": None, "total_s": 102, "install_s": 30, "prefill_tokens": 4031, "prefill_s": 59},
    "busy": {"load": "2.5-8.7", "total_s": 391, "install_s": 110, "prefill_tokens": 4031, "prefill_s": 220.8},
    # `KVSTORE_NO_OPENBLAS=1 python tools/demo.py` (--tokens defaults to 2,000 there), quiet
    "reference": {"load": None, "total_s": 884, "install_s": 0, "prefill_tokens": 2032, "prefill_s": 621.6},
}
CONVERT_S = 15  # the demo's one-time GGUF conversion, when this machine has not converted it yet

# Command 2: install, fetch mlx-lm's server suite, then `python -m pytest -q tests`.
TESTS = {
    "quiet": {"load": None, "total_s": 1200, "install_s": 60, "tests": 704, "pytest_s": 1152,
              "fast_tests": 520, "fast_s": 165},
    "busy": {"load": "2.5-8.7", "total_s": 3491, "install_s": 312, "tests": 705, "pytest_s": 3175},
    "serial": {"load": None, "tests": 704, "pytest_s": 1152},
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
    if "pytest_s" in runs["busy"]:  # the busy test run was one process: against the quiet one of those
        return runs["busy"]["pytest_s"] / runs["serial"]["pytest_s"]
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
    tq, tb = TESTS["quiet"], TESTS["busy"]
    return (
        f"Measured from a fresh clone with an empty HOME on 2 x86 cores, Debian's Python and OpenBLAS "
        f"(`sudo apt-get install libopenblas0-pthread`, used automatically): the first command took "
        f"{minutes(q['total_s'])} on a quiet machine (the install {minutes(q['install_s'])}, the demo's "
        f"{q['prefill_tokens']:,}-token cold prefill {minutes(q['prefill_s'])}) and {minutes(b['total_s'])} beside "
        f"a load of {b['load']} (the install {minutes(b['install_s'])}, the prefill {minutes(b['prefill_s'])}); "
        f"without OpenBLAS (MLX's reference BLAS) the demo prefills {r['prefill_tokens']:,} tokens in "
        f"{minutes(r['prefill_s'])} instead. The second command took {minutes(tq['total_s'])} quiet (the install "
        f"and the fetch {minutes(tq['install_s'])}, then {tq['tests']:,} tests in {minutes(tq['pytest_s'])}; the "
        f"fast tier, `-m \"not slow\"`, {tq['fast_tests']:,} of them, in {minutes(tq['fast_s'])}) and "
        f"{minutes(tb['total_s'])} beside a load of {tb['load']} (the install and the fetch "
        f"{minutes(tb['install_s'])}, {tb['tests']:,} tests in {minutes(tb['pytest_s'])}), with or without "
        f"OpenBLAS. A busy machine slows every step, the install too. pytest's first line (today's test count "
        f"and its estimate) and the demo's estimate come from these same runs (tools/measured.py).")


if __name__ == "__main__":
    import textwrap

    print(textwrap.fill(readme_paragraph(), 95))
