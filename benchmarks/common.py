"""Shared plumbing for the benchmarks: machine description, page-cache control, timing,
synthetic caches, prompts, child processes, JSON output and tables.

Every benchmark module exposes ``run(ctx: Context) -> dict`` returning the JSON document
(see ``document``): ``benchmark``, ``machine``, ``settings``, ``raw``, ``medians``,
``headline``, ``notes``. ``python -m benchmarks`` writes it as ``<out>/<name>.json``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "sequence longer than max length" when cutting text

SCHEMA = 1
CHILD_MARK = "@@BENCH-RESULT@@ "


# ----------------------------------------------------------------------------- context


@dataclass
class Context:
    """What every benchmark gets: mode, scratch space, output directory."""

    quick: bool
    work: Path              # scratch directory (stores, files); removed at the end
    out: Path               # where JSON goes
    drop: bool = True       # drop the page cache where a benchmark asks for a cold read
    options: dict[str, Any] = field(default_factory=dict)  # per-benchmark overrides from the CLI
    log: Callable[[str], None] = field(default=lambda s: print(s, flush=True))

    def scratch(self, name: str) -> Path:
        """A fresh, empty directory under the scratch space."""
        p = self.work / name
        if p.exists():
            shutil.rmtree(p)
        p.mkdir(parents=True)
        return p


# ----------------------------------------------------------------------------- machine


def _sysctl(name: str) -> str | None:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except Exception:
        return None


def cpu_model() -> str:
    if sys.platform == "darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def ram_bytes() -> int | None:
    if sys.platform == "darwin":
        v = _sysctl("hw.memsize")
        return int(v) if v and v.isdigit() else None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None


def _git() -> dict[str, Any]:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvstore"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return {"commit": rev or None, "kvstore_dirty": bool(dirty)}
    except Exception:
        return {"commit": None, "kvstore_dirty": None}


def blas_in_use() -> str:
    from kvstore import blas
    return blas.in_use()


def filesystem(path: str | Path) -> dict[str, Any]:
    """Mount point, device and type of the filesystem holding ``path`` (Linux), plus free space."""
    info: dict[str, Any] = {"path": str(path)}
    try:
        st = os.statvfs(path)
        info["free_bytes"] = st.f_bavail * st.f_frsize
    except OSError:
        pass
    try:
        real = os.path.realpath(path)
        best = ("", "", "")
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, typ = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, typ)
        if best[1]:
            info.update(device=best[0], mount=best[1], type=best[2])
    except OSError:
        pass
    return info


def machine(work: str | Path | None = None) -> dict[str, Any]:
    """CPU, cores, RAM, OS, BLAS in use, versions, load: stamped into every JSON."""
    import mlx.core as mx

    try:
        import kvstore
        kv_version = getattr(kvstore, "__version__", None)
    except Exception:
        kv_version = None
    cores = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        usable = cores
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu": cpu_model(),
        "cores": cores,
        "cores_usable": usable,
        "ram_bytes": ram_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "blas": blas_in_use(),
        "mlx_device": str(mx.default_device()),
        "versions": {
            "mlx": getattr(mx, "__version__", None) or _version("mlx"),
            "mlx_lm": _version("mlx-lm") or _version("mlx_lm"),
            "kvstore": kv_version or _version("kvstore"),
            "numpy": _version("numpy"),
            "lmdb": _version("lmdb"),
            "xxhash": _version("xxhash"),
        },
        "git": _git(),
        "root": hasattr(os, "geteuid") and os.geteuid() == 0,
        "loadavg": load,
        "filesystem": filesystem(work or tempfile.gettempdir()),
    }


# ----------------------------------------------------------------------------- page cache


def _files_under(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            for dirpath, _d, names in os.walk(p):
                out.extend(Path(dirpath) / n for n in names)
    return out


def drop_page_cache(paths: Iterable[str | Path] = (), *, enabled: bool = True) -> dict[str, Any]:
    """Evict file data from the OS page cache so the next read comes from the device.

    As root on Linux: ``sync; echo 3 > /proc/sys/vm/drop_caches`` (everything). Otherwise,
    on Linux: ``posix_fadvise(DONTNEED)`` on every file under ``paths`` (after fsync). As
    root on macOS: ``purge``. Returns what happened; ``dropped`` is False when nothing
    could be done (the read that follows is then a warm read and the JSON says so).
    """
    t0 = time.perf_counter()
    info: dict[str, Any] = {"dropped": False, "method": None}
    if not enabled:
        info["method"] = "disabled"
        return info
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if sys.platform.startswith("linux"):
        if is_root:
            try:
                os.sync()
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
                info.update(dropped=True, method="drop_caches")
            except OSError as e:
                info["error"] = str(e)
        if not info["dropped"] and hasattr(os, "posix_fadvise"):
            n = 0
            for p in _files_under(paths):
                try:
                    fd = os.open(p, os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    n += 1
                except OSError:
                    pass
                finally:
                    os.close(fd)
            if n:
                info.update(dropped=True, method="fadvise_dontneed", files=n)
    elif sys.platform == "darwin" and is_root:
        try:
            os.sync()
            subprocess.run(["purge"], check=True, timeout=120)
            info.update(dropped=True, method="purge")
        except Exception as e:
            info["error"] = str(e)
    info["seconds"] = round(time.perf_counter() - t0, 4)
    return info


def warm_files(paths: Iterable[str | Path]) -> int:
    """Read every file under ``paths`` once (pull it into the page cache)."""
    n = 0
    for p in _files_under(paths):
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                n += len(chunk)
    return n


def du(path: str | Path) -> dict[str, int]:
    """Apparent bytes, allocated bytes and file count of everything under ``path``."""
    apparent = allocated = files = 0
    for p in _files_under([path]):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        apparent += st.st_size
        allocated += getattr(st, "st_blocks", 0) * 512 or st.st_size
        files += 1
    return {"apparent_bytes": apparent, "allocated_bytes": allocated, "files": files}


def status_kb(field: str) -> int:
    """A field of ``/proc/self/status`` in KB (``VmRSS``, ``VmHWM``); 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def proc_counters() -> dict[str, int]:
    """What this process has done so far: bytes its read system calls returned (``rchar``
    of ``/proc/self/io``, files and sockets alike; 0 where there is none) and read system
    calls made (``syscr``), minor page
    faults of all its threads (pages first touched: fresh memory, or page-cache pages
    mapped) and major ones, CPU seconds of all its threads, resident and peak resident KB.
    Subtract two of them around a block."""
    import resource

    rchar = syscr = 0
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    rchar = int(line.split()[1])
                elif line.startswith("syscr:"):
                    syscr = int(line.split()[1])
    except OSError:
        pass
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"rchar": rchar, "syscr": syscr, "minflt": ru.ru_minflt, "majflt": ru.ru_majflt, "cpu_s": ru.ru_utime + ru.ru_stime,
            "rss_kb": status_kb("VmRSS"), "hwm_kb": status_kb("VmHWM")}


# ----------------------------------------------------------------------------- timing


def loadavg1() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def now() -> float:
    return time.perf_counter()


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def median(xs: Sequence[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def summary(xs: Sequence[float]) -> dict[str, Any]:
    xs = [float(x) for x in xs]
    return {"n": len(xs), "median": median(xs), "min": min(xs) if xs else None,
            "max": max(xs) if xs else None, "p50": percentile(xs, 50), "p99": percentile(xs, 99)}


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


class Timer:
    """Wrap a bound method so every call's duration is recorded (``calls``)."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name
        self.orig = getattr(obj, name)
        self.calls: list[float] = []

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self.orig(*a, **k)
            finally:
                self.calls.append(time.perf_counter() - t0)

        setattr(obj, name, wrapper)

    def take(self) -> list[float]:
        out, self.calls = self.calls, []
        return out

    def restore(self) -> None:
        setattr(self.obj, self.name, self.orig)


# ----------------------------------------------------------------------------- caches


def kv_shape(name: str) -> dict[str, Any]:
    """Cache shapes of the models the benchmarks use (float32 KV, as they run here)."""
    shapes = {
        "smollm2": {"layers": 30, "kv_heads": 3, "head_dim": 64},
        "bench-qwen3-0.6b": {"layers": 28, "kv_heads": 8, "head_dim": 128},
        "tiny-llama": {"layers": 3, "kv_heads": 2, "head_dim": 32},
    }
    s = dict(shapes[name], dtype="float32", name=name)
    s["bytes_per_token"] = s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * 4
    return s


def synth_cache(shape: dict[str, Any], n_tokens: int, seed: int = 0) -> list[Any]:
    """A list of mlx-lm ``KVCache`` holding ``n_tokens`` positions of random KV (exactly
    sized buffers, evaluated)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    key = mx.random.key(seed)
    out = []
    for i in range(shape["layers"]):
        k1, k2, key = mx.random.split(key, 3)
        c = KVCache()
        dims = (1, shape["kv_heads"], n_tokens, shape["head_dim"])
        c.keys = mx.random.normal(dims, key=k1).astype(mx.float32)
        c.values = mx.random.normal(dims, key=k2).astype(mx.float32)
        c.offset = n_tokens
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def extend_cache(cache: list[Any] | None, shape: dict[str, Any], n_new: int, seed: int,
                 drop_old: bool = False) -> list[Any]:
    """``cache`` grown by ``n_new`` random positions (what a prefill of them would add).
    ``drop_old``: each old layer's arrays are let go as soon as its new ones exist (when
    nothing else holds them, a build's peak is then one conversation, not two)."""
    import mlx.core as mx

    new = synth_cache(shape, n_new, seed)
    if not cache:
        return new
    for old, c in zip(cache, new):
        n = old.offset
        c.keys = mx.concatenate([old.keys[..., :n, :], c.keys], axis=2)
        c.values = mx.concatenate([old.values[..., :n, :], c.values], axis=2)
        c.offset = n + n_new
        mx.eval(c.keys, c.values)
        if drop_old:
            old.keys = old.values = None
    return new


def cache_bytes(cache: list[Any]) -> int:
    """KV payload bytes of a plain KVCache list (filled positions only)."""
    return sum(int(c.keys[..., : c.offset, :].nbytes) + int(c.values[..., : c.offset, :].nbytes)
               for c in cache)


def bench_identity(tag: str):
    from kvstore import Identity
    return Identity.from_components({"benchmark": tag}, name=f"bench-{tag}")


# ----------------------------------------------------------------------------- prompts

_WORDS = (
    "the a cache of keys and values is stored on disk so that a later request with the same "
    "prefix can skip prefill entirely while the model still produces exactly what a cold run "
    "would give river mountain city seven blue quickly under over system user assistant token "
    "layer window rotate quantize restore memory page block hash index write read sync tool "
    "weather currency calendar email maps stocks news translate files search music flights"
).split()
_STARTS = ("Which", "What", "How", "Why", "Where", "When", "Who", "Can", "Does", "Should",
           "Could", "Would", "Is", "Are", "Tell", "Explain", "List", "Give", "Show", "Name")


def text_tokens(tokenizer: Any, n_tokens: int, seed: int) -> list[int]:
    """Exactly ``n_tokens`` tokens of deterministic pseudo-English."""
    rng = random.Random(seed)
    words: list[str] = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        words.extend(rng.choice(_WORDS) for _ in range(max(64, n_tokens // 2)))
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
    return [int(t) for t in ids[:n_tokens]]


def question_tokens(tokenizer: Any, n_tokens: int, k: int) -> list[int]:
    """A ``n_tokens``-token question; questions with different ``k`` start differently."""
    start = _STARTS[k % len(_STARTS)]
    rng = random.Random(1000 + k)
    words = [f"\n{start}"]
    ids: list[int] = []
    while len(ids) < n_tokens:
        words.extend(rng.choice(_WORDS) for _ in range(32))
        ids = tokenizer.encode(" ".join(words) + "?", add_special_tokens=False)
    return [int(t) for t in ids[:n_tokens]]


def load_model(name: str):
    """(model, tokenizer, model dir) from tools.testing.model_builds, offline."""
    from tools.testing.model_builds import load_model as _load, model_path

    path = model_path(name)
    model, tok = _load(name)
    return model, tok, path


def warm_up(model: Any, n: int = 16) -> None:
    """One short forward pass on a throwaway cache (first-call costs out of the way):
    ``kvstore.generate.warm_up``, what ``kvstore serve`` runs before it is ready."""
    from kvstore.generate import warm_up as forward_once

    forward_once(model, n)


def prefault_memory(quick: bool = False) -> dict[str, Any]:
    """Touch, then free, most of the free memory once, in a child process. On a VM that
    backs guest memory lazily (this one does) the first touch of never-used guest memory
    costs a host fault, so whichever method first meets fresh memory would pay for it;
    after this every method meets memory the host already backs. Harmless elsewhere."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        return {"bytes": 0, "seconds": 0.0, "skipped": "no /proc/meminfo"}
    nbytes = min(int(avail * 0.7), (1 if quick else 16) << 30)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import numpy as np; a = np.ones({nbytes}, np.uint8)"],
                   check=False, timeout=600)
    return {"bytes": nbytes, "seconds": round(time.perf_counter() - t0, 2)}


def unload() -> None:
    import gc

    import mlx.core as mx
    gc.collect()
    try:
        mx.clear_cache()
    except AttributeError:  # older mlx
        mx.metal.clear_cache()


# ----------------------------------------------------------------------------- children


_SERVERS: "set[subprocess.Popen[bytes]]" = set()  # started by spawn, not yet terminated


def spawn(cmd: Sequence[str], log: Any, env: dict[str, str] | None = None,
          cwd: Path | str | None = REPO_ROOT) -> "subprocess.Popen[bytes]":
    """Start a server subprocess (output to the open file ``log``) that cannot outlive this
    run: it dies with this process (even by SIGKILL, on Linux), and ``end_all`` ends it when
    the run finishes or fails, whichever benchmark forgot it."""
    from tools.testing.procs import die_with_parent

    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=cwd, preexec_fn=die_with_parent)
    _SERVERS.add(proc)
    return proc


def end_all() -> None:
    """Terminate every server ``spawn`` started that is still running."""
    while _SERVERS:
        terminate(_SERVERS.pop(), timeout=30)


def terminate(proc: "subprocess.Popen[bytes]", timeout: float = 120) -> int:
    """SIGTERM a server subprocess and wait (SIGKILL after ``timeout`` s); its exit status."""
    _SERVERS.discard(proc)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def run_child(target: str, args: dict[str, Any], *, timeout: float = 1800,
              prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run ``benchmarks.<module>:<func>(**args)`` in a fresh interpreter (same BLAS, same
    environment; under the command ``prefix`` if given) and return its JSON result."""
    cmd = [*prefix, sys.executable, "-m", "benchmarks", "--child", target, json.dumps(args)]
    t0 = time.perf_counter()
    from tools.testing.procs import die_with_parent

    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=die_with_parent)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {target} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(lines[-1][len(CHILD_MARK):])
    out["process_wall_seconds"] = wall
    return out


def child_main(target: str, args_json: str) -> int:
    import importlib

    mod, func = target.split(":")
    fn = getattr(importlib.import_module(f"benchmarks.{mod}"), func)
    result = fn(**json.loads(args_json))
    print(CHILD_MARK + json.dumps(result), flush=True)
    return 0


# ----------------------------------------------------------------------------- output


def document(name: str, ctx: Context, settings: dict[str, Any], raw: Any, medians: dict[str, Any],
             headline: dict[str, Any], notes: list[str], started: float, mach: dict | None = None) -> dict[str, Any]:
    return {
        "benchmark": name,
        "schema": SCHEMA,
        "quick": ctx.quick,
        "started_unix": round(time.time() - (time.perf_counter() - started), 3),
        "seconds": round(time.perf_counter() - started, 3),
        "machine": mach or machine(ctx.work),
        "settings": settings,
        "raw": raw,
        "medians": medians,
        "headline": headline,
        "notes": notes,
    }


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return None if not math.isfinite(x) else round(x, 6)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(out: Path, name: str, doc: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_clean(doc), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def run_alone(prefix: str, out: str, name: str, drop: bool, body: Callable[[Context], dict[str, Any]],
              report: Callable[[dict[str, Any]], str]) -> int:
    """One benchmark run on its own (``python -m benchmarks.X``): a scratch directory removed
    afterwards whatever happens, ``body``'s document written as ``out/name.json`` and its
    ``report`` printed."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        ctx = Context(quick=False, work=work, out=Path(out), drop=drop)
        doc = body(ctx)
        write_json(ctx.out, name, doc)
        print(report(doc))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if unit == "s":
            return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"
        if unit == "x":
            return f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"
        if unit == "GB/s":
            return f"{x:.2f} GB/s"
        return f"{x:.3g}"
    return str(x)


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table (also valid GitHub markdown)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [f"\n{title}", line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def gb(nbytes: float) -> float:
    return nbytes / 1e9


def new_workdir(parent: str | None = None) -> Path:
    return Path(tempfile.mkdtemp(prefix="kvstore-bench-", dir=parent))
