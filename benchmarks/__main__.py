"""Run kvstore's benchmarks.

    python -m benchmarks                      # everything, results in benchmarks/results/
    python -m benchmarks --quick              # tiny model, small sizes (< 2 min)
    python -m benchmarks --only ttft scale    # some of them
    python -m benchmarks --out DIR            # JSON, chart and summary somewhere else

Each benchmark writes ``<out>/<name>.json`` (machine, BLAS, versions, settings, raw timings,
medians, headline numbers) and prints a short table; ``<out>/chart.png`` plots TTFT and
restore bandwidth; ``<out>/summary.md`` holds the headline table of every JSON in ``<out>``.
On Linux the run re-executes itself with Debian's OpenBLAS preloaded when it is installed
(kvstore/blas.py; float32 prefill is ~15x faster with it); the JSON records the BLAS in use.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import BENCHMARKS  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="tiny model and small sizes: the whole suite in under 2 minutes")
    p.add_argument("--only", nargs="+", choices=BENCHMARKS, metavar="NAME",
                   help=f"run only these benchmarks ({', '.join(BENCHMARKS)})")
    p.add_argument("--out", default=None,
                   help="output directory (default: benchmarks/results, or a temp dir with --quick)")
    p.add_argument("--work-dir", default=None,
                   help="parent of the scratch directory (stores, files); default: system temp")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--no-drop", action="store_true",
                   help="never drop the page cache (cold reads are then reported as not dropped)")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    p.add_argument("--scale-entries", type=int, default=None, metavar="N",
                   help="entries for the scale benchmark (default 100000; 600 with --quick)")
    p.add_argument("--long-entry-tokens", default=None, metavar="N1,N2,...",
                   help="entry lengths for long_entry (default 16384,65536,131072; 2048,8192 tiny with --quick)")
    p.add_argument("--server-model", action="append", default=[], metavar="MODEL=TOKENS",
                   help="a model (tools/testing/model_builds.py name) and the system prompt's tokens for the "
                        "server benchmark instead of its defaults, e.g. smollm2=1528; repeatable")
    p.add_argument("--ttft-lengths", action="append", default=[], metavar="MODEL=L1,L2,...",
                   help="prompt lengths for one ttft model (tools/testing/model_builds.py name), e.g. "
                        "bench-qwen3-0.6b=1024,2048,4096; an empty list skips the model; repeatable")
    p.add_argument("--child", nargs=2, metavar=("TARGET", "JSON"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _lengths(specs: list[str]) -> dict[str, list[int]]:
    out = {}
    for spec in specs:
        name, _, ls = spec.partition("=")
        out[name.strip()] = [int(x) for x in ls.split(",") if x.strip()]
    return out


def write_summary(out: Path) -> str:
    """``<out>/summary.md``: the headline rows of every benchmark JSON in ``out``."""
    from benchmarks import common

    rows = []
    run = {}
    if (out / "run.json").exists():
        run = json.loads((out / "run.json").read_text())
    mach = None
    for name in BENCHMARKS:
        path = out / f"{name}.json"
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        mach = mach or doc["machine"]
        mod = importlib.import_module(f"benchmarks.{name}")
        rows += [(name, *r) for r in mod.headline_rows(doc)]
    if not rows:
        return ""
    head = ""
    if mach:
        head = (f"Machine: {mach['cpu']}, {mach['cores']} cores, "
                f"{(mach['ram_bytes'] or 0) / 2**30:.0f} GiB RAM, {mach['os']}; BLAS {mach['blas']}; "
                f"mlx {mach['versions']['mlx']}, mlx-lm {mach['versions']['mlx_lm']}, "
                f"kvstore {mach['versions']['kvstore']}.")
        if run:
            head += (f" Run: {run.get('total_seconds', 0) / 60:.1f} min"
                     f"{' (--quick)' if run.get('quick') else ''}, load average "
                     f"{run.get('loadavg_start')} at start, {run.get('loadavg_end')} at end.")
    text = common.table("Headline numbers", ["benchmark", "metric", "kvstore", "baseline / context"], rows)
    text = (head + "\n" + text).strip() + "\n"
    (out / "summary.md").write_text(text)
    return text


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from kvstore import blas

    blas.preload_openblas()  # before mlx is imported; a no-op when not installed
    from benchmarks import common

    if args.child:
        return common.child_main(*args.child)

    import signal
    import tempfile

    # SIGTERM (a test's timeout, a CI cancel) unwinds like Ctrl-C: the finally below ends the
    # servers and removes the scratch directory; a SIGKILL leaves no server either (spawn).
    signal.signal(signal.SIGTERM, _exit_on_signal)
    out = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="kvstore-bench-quick-")) if args.quick else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    work = common.new_workdir(args.work_dir)
    ctx = common.Context(quick=args.quick, work=work, out=out, drop=not args.no_drop,
                         options={"scale_entries": args.scale_entries,
                                  "long_entry_tokens": [int(x) for x in (args.long_entry_tokens or "").split(",")
                                                        if x.strip()],
                                  "ttft_lengths": _lengths(args.ttft_lengths),
                                  "server_models": [(m, int(n)) for m, _, n in (x.partition("=") for x in args.server_model)]})
    names = [n for n in BENCHMARKS if not args.only or n in args.only]
    mach = common.machine()
    print(f"kvstore benchmarks{' (quick)' if args.quick else ''}: {', '.join(names)}\n"
          f"  {mach['cpu']}, {mach['cores']} cores, {(mach['ram_bytes'] or 0) / 2**30:.0f} GiB RAM, "
          f"{mach['os']}, BLAS {mach['blas']}, mlx {mach['versions']['mlx']}, "
          f"mlx-lm {mach['versions']['mlx_lm']}, load {mach['loadavg']}\n"
          f"  scratch {work}, results {out}", flush=True)
    t_all = time.perf_counter()
    timings: dict[str, float] = {}
    failed: list[str] = []
    try:
        for name in names:
            mod = importlib.import_module(f"benchmarks.{name}")
            print(f"\n=== {name} ===", flush=True)
            t0 = time.perf_counter()
            try:
                doc = mod.run(ctx)
            except Exception:
                import traceback
                traceback.print_exc()
                failed.append(name)
                continue
            timings[name] = time.perf_counter() - t0
            path = common.write_json(out, name, doc)
            print(mod.report(doc))
            print(f"\n[{name}: {timings[name]:.0f} s -> {path}]", flush=True)
    finally:
        common.end_all()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - t_all

    run_info = {"argv": sys.argv[1:], "quick": args.quick, "benchmarks": names,
                "seconds": {k: round(v, 1) for k, v in timings.items()},
                "total_seconds": round(total, 1), "failed": failed,
                "loadavg_start": mach["loadavg"], "loadavg_end": common.machine()["loadavg"],
                "finished_unix": round(time.time(), 1)}
    (out / "run.json").write_text(json.dumps(run_info, indent=1) + "\n")

    text = write_summary(out)
    print("\n" + text)
    if not args.no_chart:
        try:
            from benchmarks import chart
            png = chart.draw(out)
            if png:
                print(f"chart: {png}")
        except Exception as e:  # a chart is never worth failing a run
            print(f"chart skipped: {e}", file=sys.stderr)
    print(f"\ntotal {total:.0f} s ({total / 60:.1f} min); results in {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
