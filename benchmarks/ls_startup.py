"""Interleaved fresh-process timings of `kvstore ls` on an empty store: main's tree vs this
branch's, with and without a bytecode cache, against `python -c pass`."""
import json, os, statistics, subprocess, sys, tempfile, time
trees = {"main": sys.argv[1], "branch": sys.argv[2]}
runs = int(sys.argv[3]); d = sys.argv[4]
pyc = tempfile.mkdtemp(prefix="perf-pyc-")
res = {}
def env(tree, cached):
    e = dict(os.environ, PYTHONPATH=tree)
    if cached:
        e.pop("PYTHONDONTWRITEBYTECODE", None); e["PYTHONPYCACHEPREFIX"] = os.path.join(pyc, os.path.basename(tree))
    else:
        e["PYTHONDONTWRITEBYTECODE"] = "1"
    return e
cmds = {}
for t, path in trees.items():
    for cached in (False, True):
        cmds[f"{t}{'_bytecode' if cached else ''}"] = ([sys.executable, "-m", "kvstore.cli", "ls", "--cache-dir", d], env(path, cached), path)
cmds["python"] = ([sys.executable, "-c", "pass"], dict(os.environ), None)
for k, (c, e, cwd) in cmds.items():
    subprocess.run(c, env=e, cwd=cwd, check=True, capture_output=True)  # warm / write bytecode
times = {k: [] for k in cmds}
for _ in range(runs):
    for k, (c, e, cwd) in cmds.items():
        t0 = time.perf_counter(); subprocess.run(c, env=e, cwd=cwd, check=True, capture_output=True); times[k].append(time.perf_counter() - t0)
med = {k: statistics.median(v) for k, v in times.items()}
out = {"median_s": med, "vs_python": {k: v / med["python"] for k, v in med.items()}, "loadavg": os.getloadavg(), "runs": times}
print(json.dumps(out, indent=1))
