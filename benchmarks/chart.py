"""``<out>/chart.png``: TTFT (cold / memory hit / disk hit) and restore / write bandwidth.

    python -m benchmarks.chart [DIR]     # redraw from the JSON in DIR (default: results/)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COLORS = {"cold": "#9e9e9e", "memory": "#4c72b0", "disk": "#dd8452", "disk_warm": "#f2c59b",
          "kvstore": "#dd8452", "raw": "#55a868", "mlx_lm": "#8172b3", "mlx_lm_fsync": "#b8aee0"}


def _load(out: Path, name: str) -> dict[str, Any] | None:
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _ttft_panel(ax: Any, model: str, rows: list[dict]) -> None:
    import numpy as np

    rows = sorted(rows, key=lambda r: r["tokens"])
    x = np.arange(len(rows))
    series = [("cold prefill", "cold", "cold_ttft"), ("memory hit", "memory", "memory_ttft"),
              ("disk hit, new process", "disk", "disk_ttft"),
              ("disk hit, new process, warm page cache", "disk_warm", "disk_warm_ttft")]
    w = 0.2
    for i, (label, color, key) in enumerate(series):
        vals = [r["medians"][key] or 0 for r in rows]
        bars = ax.bar(x + (i - 1.5) * w, vals, w, label=label, color=COLORS[color])
        if key == "disk_ttft":
            for b, r in zip(bars, rows):
                sp = r["medians"].get("speedup_disk")
                if sp:
                    ax.annotate(f"{sp:.0f}x" if sp >= 10 else f"{sp:.1f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{r['tokens']}" for r in rows])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title(f"TTFT, {model} (float32)", fontsize=10)
    ax.grid(axis="y", alpha=0.3, which="both")


def _bw_panel(ax: Any, rows: list[dict]) -> None:
    import numpy as np

    groups = []
    for r in rows:
        m = r["medians"]
        name = f"{r['shape']['name']}\n{r['tokens']} tok, {m['payload_bytes'] / 1e6:.0f} MB"
        for state in ("cold", "warm"):
            groups.append((f"{name}\nread, {state}", [m[f"{state}_kvstore_gbps"], m[f"{state}_raw_gbps"],
                                                       m[f"{state}_mlx_lm_gbps"]]))
    x = np.arange(len(groups))
    w = 0.27
    for i, (label, color) in enumerate([("kvstore restore", "kvstore"), ("raw read of kvstore's blobs", "raw"),
                                        ("mlx-lm load_prompt_cache", "mlx_lm")]):
        ax.bar(x + (i - 1) * w, [g[1][i] or 0 for g in groups], w, label=label, color=COLORS[color])
    ax.set_xticks(x, [g[0] for g in groups], fontsize=7)
    ax.set_ylabel("GB/s of KV payload")
    ax.set_title("Restore bandwidth (page cache dropped / warm)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def _write_panel(ax: Any, rows: list[dict]) -> None:
    import numpy as np

    x = np.arange(len(rows))
    w = 0.27
    for i, (label, color, key) in enumerate([("kvstore insert+flush (fsynced)", "kvstore", "write_kvstore_gbps"),
                                             ("save_prompt_cache", "mlx_lm", "write_mlx_lm_gbps"),
                                             ("save_prompt_cache + fsync", "mlx_lm_fsync", "write_mlx_lm_fsync_gbps")]):
        ax.bar(x + (i - 1) * w, [r["medians"][key] or 0 for r in rows], w, label=label, color=COLORS[color])
    ax.set_xticks(x, [f"{r['shape']['name']}\n{r['tokens']} tok" for r in rows], fontsize=7)
    ax.set_ylabel("GB/s of KV payload")
    ax.set_title("Write bandwidth", fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def draw(out: str | Path) -> Path | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    ttft, bw = _load(out, "ttft"), _load(out, "bandwidth")
    if not ttft and not bw:
        return None
    models: dict[str, list[dict]] = {}
    for r in (ttft or {}).get("raw", []):
        models.setdefault(r["model"], []).append(r)
    n_top = max(1, len(models))
    fig = plt.figure(figsize=(6 * max(n_top, 2), 9.5), constrained_layout=True)
    grid = fig.add_gridspec(2, max(n_top, 2) * 2)
    span = (max(n_top, 2) * 2) // n_top
    for i, (model, rows) in enumerate(models.items()):
        ax = fig.add_subplot(grid[0, i * span:(i + 1) * span])
        _ttft_panel(ax, model, rows)
        if i == 0:
            ax.legend(fontsize=7, loc="best", framealpha=0.85)
    if bw:
        cols = max(n_top, 2) * 2
        ax = fig.add_subplot(grid[1, : cols * 3 // 4])
        _bw_panel(ax, bw["raw"])
        ax.legend(fontsize=7)
        ax = fig.add_subplot(grid[1, cols * 3 // 4:])
        _write_panel(ax, bw["raw"])
        ax.legend(fontsize=7)
    mach = (ttft or bw)["machine"]
    fig.suptitle(f"kvstore benchmarks{' (--quick)' if (ttft or bw).get('quick') else ''}: {mach['cpu']}, "
                 f"{mach['cores']} cores, BLAS {mach['blas']}, mlx {mach['versions']['mlx']}, "
                 f"mlx-lm {mach['versions']['mlx_lm']}", fontsize=10)
    path = out / "chart.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "results"
    print(draw(d))
