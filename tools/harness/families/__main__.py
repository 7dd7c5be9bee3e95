"""``python -m tools.harness.families``: run the survey, write results JSON and a markdown table."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from tools.harness.families import configs, survey

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: one row per family, then the counts."""
    head = ("| family | cache classes | mlx-lm save/load | kvstore persists | prefix restore | cut restore | verdict |\n"
            "| --- | --- | --- | --- | --- | --- | --- |\n")
    lines = []
    for r in rows:
        rs = r.get("restore") or {}
        pre, cut = rs.get("kv-prefix", {}), rs.get("kv-cut", {})
        how = ("memory only: " + (r.get("memory_only_reason") or "?")) if r.get("built") and not r.get("persisted") \
            else ("chunked" if pre.get("chunked") else "snapshot") if r.get("built") else ""
        mlx = rs.get("mlx_roundtrip") or (("save failed: " + r["mlx_save"]) if r.get("mlx_save", "ok") != "ok" else "")
        lines.append("| " + " | ".join([
            r["family"], ", ".join(r.get("classes", [])) or "-", mlx or "-", how or "-",
            _restore_text(pre), _restore_text(cut), r["verdict"] + (": " + r.get("why", "") if not r.get("built") else ""),
        ]).replace("\n", " ") + " |")
    return head + "\n".join(lines) + "\n\n" + summary(rows) + "\n"


def _restore_text(res: dict[str, Any]) -> str:
    if not res:
        return "-"
    if "ok" not in res:
        return f"miss (n={res.get('n')})"
    return f"{'identical' if res['ok'] else 'DIFFERENT'} (n={res['n']})"


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Families in all; built and run; by verdict; mlx-lm round-trips; and of those, how
    many kvstore restores identically."""
    c = Counter(r["verdict"].split(":")[0] for r in rows)
    mlx_ok = [r for r in rows if (r.get("restore") or {}).get("mlx_roundtrip") == "identical"]
    runs = [r for r in rows if r.get("built") and not r["verdict"].startswith("not runnable")]
    return {"families": len(rows), "built": len(runs),
            "identical": c["identical"], "memory_only": c["memory only"], "wrong": c["WRONG"],
            "not_built": c["not built"] + c["not runnable"], "mlx_roundtrip_identical": len(mlx_ok),
            "kvstore_identical_where_mlx_roundtrips": sum(r["verdict"] == "identical" for r in mlx_ok)}


def summary(rows: list[dict[str, Any]]) -> str:
    c = counts(rows)
    return (f"{c['families']} families: {c['built']} built and ran; kvstore restores {c['identical']} identically "
            f"({100 * c['identical'] // max(1, c['built'])}% of those built), keeps {c['memory_only']} in memory only "
            f"(with the reason), {c['wrong']} wrong; mlx-lm's own save/load round-trips {c['mlx_roundtrip_identical']}, "
            f"of which kvstore restores {c['kvstore_identical_where_mlx_roundtrips']} identically; "
            f"{c['not_built']} could not be built or run without kvstore (reason in the row).")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.harness.families", description=__doc__)
    ap.add_argument("--only", help="comma-separated families (default: every one)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help=f"results directory (default {RESULTS})")
    args = ap.parse_args(argv)
    fams = args.only.split(",") if args.only else configs.families()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="kvstore-families-") as tmp:
        rows = survey.run(fams, pathlib.Path(tmp))
    args.out.mkdir(parents=True, exist_ok=True)
    import mlx_lm

    meta = {"mlx_lm": mlx_lm.__version__, "seconds": round(time.time() - t0, 1), "counts": counts(rows)}
    (args.out / "results.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str) + "\n")
    (args.out / "results.md").write_text(f"# kvstore families survey (mlx-lm {mlx_lm.__version__})\n\n" + table(rows))
    print(summary(rows))
    print(f"({meta['seconds']} s; {args.out / 'results.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
