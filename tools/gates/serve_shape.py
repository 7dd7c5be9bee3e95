"""The shape of ``kvstore serve`` as figures: what issue 53's closing note shows before and after.

    python -m tools.gates.serve_shape                 # a short table, for this checkout
    python -m tools.gates.serve_shape --json          # the same as JSON
    python -m tools.gates.serve_shape --repo DIR      # another checkout (its kvstore, read and run)

1. ``mlx_lm_server``: what kvstore assigns onto mlx_lm.server. A child process imports a
   pristine ``mlx_lm.server``, keeps its module dict and the ``__dict__`` of ``APIHandler``
   and ``ResponseGenerator``, runs ``kvstore.serve.server.main`` up to the moment it would
   hand over to mlx-lm (``mlx_lm.server.main``/``run`` and ``serve_forever`` stand in for
   it: nothing listens, no model loads), and compares: the names added or rebound (module
   names; methods and flags of the two classes). Where that main cannot run so, it falls
   back to ``kvstore.serve.server.patch(server_mod, cache_dir=...)`` and says so (``method``).
2. ``run_time_state``, read from the source: ``threading.local()`` objects, ``global``
   statements, names of other kvstore modules assigned (``anthropic.KEEP_BILLING_HEADER =``)
   and module-level objects a function changes (``_STORES.append``, ``STATE.phase =``).
3. ``imports``: kvstore's import graph (tools/gates/layers.py's): modules, imports, cycles,
   imports that point up the layer table.
4. ``widest_signatures``: the ten functions of kvstore/ with the most named parameters
   (``self``/``cls`` not counted).
5. ``store_options``: for each field of ``kvstore.options.StoreOptions`` (else the keywords
   of ``KVStore.__init__``), how many places state it (a parameter, a call's keyword, a
   dict key, a class field, a ``--flag``) in how many files; and the places that state four
   or more of them (each an option list).
6. ``chat_path`` (with ``--model DIR``, a local mlx-lm model): ``kvstore serve`` on it in a
   child process, one ``POST /v1/chat/completions`` (2 tokens), and in each thread that
   served it the modules it went through (kvstore/serve, kvstore/adapters, mlx_lm.server;
   other frames are transparent), in order, repeats folded: the modules entered, the moves
   between them, and how many moves returned to a module already left.

Parts 2-5 read files only and are the same for the same tree (``--static``: those alone).
Parts 1 and 6 need mlx-lm installed; where a part cannot run, it says why.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
MUTATORS = frozenset({"append", "extend", "insert", "pop", "clear", "update", "setdefault", "add", "discard",
                      "remove", "popitem", "appendleft", "put"})
LIST_AT_LEAST = 4  # a place naming this many store options restates the option list


# ---- 1. assignments onto mlx_lm.server (run in a child process) ----

def _child(out: str, model: str) -> None:
    """In a fresh process: install kvstore serve onto a pristine mlx_lm.server, write the diff."""
    import http.server
    import types

    import mlx_lm.server as server_mod

    classes = ("APIHandler", "ResponseGenerator")

    def snapshot() -> dict[str, dict[str, int]]:
        snap = {"module": {k: id(v) for k, v in vars(server_mod).items()}}
        for c in classes:
            snap[c] = {k: id(v) for k, v in vars(getattr(server_mod, c)).items()}
        return snap

    before = snapshot()
    keep = {"module": dict(vars(server_mod))}
    for c in classes:
        keep[c] = dict(vars(getattr(server_mod, c)))  # the objects stay alive: their ids stay unique
    seen: dict[str, Any] = {}

    class Handover(BaseException):
        """Raised where mlx-lm would take over: the diff is taken there."""

    def take(*_a: Any, **_k: Any) -> None:
        if not seen:
            seen["after"] = snapshot()
            seen["classes"] = {c: getattr(server_mod, c) for c in classes}
        raise Handover

    stubs = {"main": take, "run": take}
    for name, fn in stubs.items():
        if hasattr(server_mod, name):
            setattr(server_mod, name, fn)
    stubbed = {name: id(fn) for name, fn in stubs.items()}
    http.server.HTTPServer.serve_forever = take  # type: ignore[method-assign]
    method, error = "main", None
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVSTORE_DIR"] = tmp
        try:
            from kvstore.serve import server as serve_server

            serve_server.main(["--model", model, "--cache-dir", tmp, "--port", "0"], exit_process=False)
        except Handover:
            pass
        except BaseException as e:  # main changed beyond this script: fall back to patch()
            error = f"{type(e).__name__}: {e}"
        if not seen:
            method = "patch"
            for name in stubs:  # a pristine module again, then patch() alone
                if name in keep["module"]:
                    setattr(server_mod, name, keep["module"][name])
            stubbed = {}
            from kvstore.serve import server as serve_server

            serve_server.patch(server_mod, cache_dir=tmp)
            seen["after"] = snapshot()
            seen["classes"] = {c: getattr(server_mod, c) for c in classes}
    after = seen["after"]
    result: dict[str, Any] = {"method": method, "main_error": error}
    result["module_names"] = sorted(k for k, v in after["module"].items()
                                    if before["module"].get(k) != v and stubbed.get(k) != v)
    for c in classes:
        cls = seen["classes"][c]
        rebound = cls is not keep["module"][c]
        changed = sorted(k for k, v in after[c].items() if before[c].get(k) != v)
        if rebound:  # a subclass stands under the name: its own __dict__ is what it adds
            changed = sorted(k for k in vars(cls) if k not in ("__module__", "__doc__", "__qualname__",
                                                                 "__dict__", "__weakref__"))
        values = {k: vars(cls).get(k) for k in changed}
        result[c] = {"rebound_to_subclass": rebound,
                     "methods": [k for k in changed if callable(values[k]) or isinstance(values[k], (
                         staticmethod, classmethod, property, types.FunctionType))],
                     "flags": [k for k in changed if not (callable(values[k]) or isinstance(
                         values[k], (staticmethod, classmethod, property)))]}
    attrs = sum(len(result[c]["methods"]) + len(result[c]["flags"])
                for c in classes if not result[c]["rebound_to_subclass"])
    result["count"] = len(result["module_names"]) + attrs
    result["class_attributes_patched"] = attrs
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # the store's threads and mlx-lm's: nothing more to wait for


def in_child(mode: str, root: Path, model: str, timeout: float) -> dict[str, Any]:
    """This file run as a script in ``mode`` (``--child``, ``--trace``) with ``root``'s kvstore
    first on the path: the JSON it wrote, or why it wrote none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = dict(os.environ, PYTHONPATH=str(root), KVSTORE_NO_OPENBLAS="1")
        try:
            proc = subprocess.run([sys.executable, str(HERE), mode, str(out), model], cwd=root, env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the child ran past {timeout:.0f} s"}
        if not out.exists():
            return {"error": f"the child exited {proc.returncode}: {proc.stderr.strip()[-800:]}"}
        got: dict[str, Any] = json.loads(out.read_text())
        return got


def mlx_lm_server(root: Path, model: str) -> dict[str, Any]:
    """Part 1, for the kvstore of ``root``: a child process (see the module docstring)."""
    got = in_child("--child", root, model, 600)
    try:
        import importlib.metadata as md

        got["mlx_lm"] = md.version("mlx-lm")
    except Exception:
        pass
    return got


def _trace(out: str, model: str) -> None:
    """In a fresh process: ``kvstore serve`` on ``model`` (its main on this thread, as in a
    server process), one chat request from a client thread, and
    in each thread the modules it is in (kvstore/serve, kvstore/adapters, mlx_lm.server)
    from the request's start to its answer, consecutive repeats folded."""
    import socket
    import threading
    import time
    import urllib.request

    import mlx_lm.server as server_mod

    root = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]).resolve()
    tracked = {str(root / "kvstore" / "serve"): "serve", str(root / "kvstore" / "adapters"): "adapters"}
    mlx_file = str(Path(server_mod.__file__).resolve())
    names: dict[str, str | None] = {}

    def module_of(filename: str) -> str | None:
        if filename not in names:
            name = None
            if filename == mlx_file:
                name = "mlx_lm.server"
            for folder, pkg in tracked.items():
                if filename.startswith(folder + os.sep):
                    name = f"{pkg}.{Path(filename).stem}"
            names[filename] = name
        return names[filename]

    recording = threading.Event()
    seqs: dict[str, list[str]] = {}

    def prof(frame: Any, event: str, arg: Any) -> None:
        if not recording.is_set() or event not in ("call", "return"):
            return
        f = frame if event == "call" else frame.f_back
        while f is not None and module_of(f.f_code.co_filename) is None:
            f = f.f_back
        if f is None:
            return
        seq = seqs.setdefault(threading.current_thread().name, [])
        mod = module_of(f.f_code.co_filename)
        if not seq or seq[-1] != mod:
            seq.append(mod)  # type: ignore[arg-type]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    def client() -> None:
        for _ in range(1200):  # the model loads on the generation thread: ready once /health says so
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.5)
        time.sleep(1)  # the /health exchange's own thread done: what is recorded is the chat request's
        body = json.dumps({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        recording.set()
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                status = r.status
                r.read()
        except Exception as e:
            status = getattr(e, "code", None) or f"{type(e).__name__}: {e}"
        recording.clear()
        threads = {}
        for name, seq in seqs.items():
            if set(seq) == {"mlx_lm.server"}:  # the server's loop, waiting: no part of the request
                continue
            left: set[str] = set()
            returns = 0
            for prev, cur in zip(seq, seq[1:]):
                left.add(prev)
                returns += cur in left
            threads[name] = {"modules_entered": list(dict.fromkeys(seq)), "moves": len(seq) - 1,
                             "returns_to_a_module_left": returns, "path": seq[:80]}
        Path(out).write_text(json.dumps({"status": status, "threads": threads}))
        os._exit(0)

    threading.Thread(target=client, daemon=True, name="client").start()
    threading.setprofile(prof)  # the threads the server starts from here on
    sys.setprofile(prof)  # and this one, the server's main thread (signals are set here)
    from kvstore.serve import server as serve_server

    serve_server.main(["--model", model, "--cache-dir", tempfile.mkdtemp(), "--port", str(port), "--no-warmup"],
                      exit_process=False)
    os._exit(1)  # the server ended before the client wrote its answer


def chat_path(root: Path, model: str) -> dict[str, Any]:
    """Part 6: one chat request's path through the serve layer (a child process; see _trace)."""
    return in_child("--trace", root, model, 900)


# ---- 2-5: the source ----

def _files(root: Path) -> dict[str, ast.Module]:
    """kvstore/'s files (paths from ``root``) and their syntax trees."""
    return {p.relative_to(root).as_posix(): ast.parse(p.read_text())
            for p in sorted((root / "kvstore").rglob("*.py"))}


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function, nested ones and methods included."""
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((prefix + node.name, node))
            out.extend(_functions(node, f"{prefix}{node.name}."))
        elif isinstance(node, ast.ClassDef):
            out.extend(_functions(node, f"{prefix}{node.name}."))
        elif not isinstance(node, (ast.Lambda,)):
            out.extend(_functions(node, prefix))
    return out


def _module_names(tree: ast.Module) -> set[str]:
    """Names a module binds by assignment at its top level (its state, constants included)."""
    out: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return out


def _module_aliases(tree: ast.Module, path: str, files: dict[str, ast.Module]) -> set[str]:
    """Local names that are kvstore modules (``from . import anthropic``, ``import kvstore.x as y``)."""
    pkg = path.removesuffix(".py").split("/")
    pkg = pkg[:-1]
    known = {f.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for f in files}
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            out.update(a.asname or a.name for a in node.names if f"{base}.{a.name}" in known)
        elif isinstance(node, ast.Import):
            out.update(a.asname for a in node.names if a.asname and a.name in known)
    return out


def _locals(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], set[str]]:
    """(names a function binds locally, names it declares global)."""
    args = fn.args
    bound = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    bound |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    declared: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Global):
            declared.update(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            bound.add(node.name)
    return bound - declared, declared


def run_time_state(files: dict[str, ast.Module]) -> dict[str, Any]:
    """Part 2: thread-locals, ``global`` statements, other modules' names written, module
    objects changed inside functions (``path:line what``, sorted)."""
    thread_locals, globals_, foreign, changed = [], [], [], set()
    for path, tree in files.items():
        aliases = _module_aliases(tree, path, files)
        state = _module_names(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "local"
                    and getattr(node.func.value, "id", None) == "threading"):  # type: ignore[attr-defined]
                thread_locals.append(f"{path}:{node.lineno}")
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) in aliases:
                    foreign.append(f"{path}:{node.lineno} {t.value.id}.{t.attr}")  # type: ignore[attr-defined]
        for name, fn in _functions(tree):
            bound, declared = _locals(fn)
            if declared:
                globals_.append(f"{path}:{fn.lineno} {name}: global {', '.join(sorted(declared))}")
            for node in ast.walk(fn):
                target = None
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                    for t in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                        if isinstance(t, (ast.Attribute, ast.Subscript)) and isinstance(t.value, ast.Name):
                            target = t.value.id
                            if target in state and target not in bound:
                                changed.add(f"{path}:{target}")
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name)):
                    target = node.func.value.id
                    if target in state and target not in bound:
                        changed.add(f"{path}:{target}")
    return {"thread_locals": thread_locals, "global_statements": globals_,
            "other_modules_names_written": foreign, "module_objects_changed_in_functions": sorted(changed),
            "counts": {"thread_locals": len(thread_locals), "global_statements": len(globals_),
                       "other_modules_names_written": len(foreign),
                       "module_objects_changed_in_functions": len(changed)}}


def imports(root: Path) -> dict[str, Any]:
    """Part 3: kvstore's import graph and what the layer rules say of it."""
    from tools.gates.layers import check, graph  # here: the child processes run this file as a script

    edges, private = graph(root)
    ours = {m: {t for t in ts if t.split(".")[0] == "kvstore"} for m, ts in edges.items() if m.split(".")[0] == "kvstore"}
    problems = check(ours)
    return {"modules": len(ours), "imports": sum(map(len, ours.values())),
            "cycles": [p for p in problems if p.startswith("cycle")],
            "upward": [p for p in problems if "upward" in p],
            "private_names_across_modules": [p for p in private if p.startswith("kvstore")]}


def widest_signatures(files: dict[str, ast.Module], most: int = 10) -> list[dict[str, Any]]:
    """Part 4: the functions with the most named parameters (``self``/``cls`` not counted)."""
    rows: list[tuple[int, str]] = []
    for path, tree in files.items():
        for name, fn in _functions(tree):
            a = fn.args
            params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
            rows.append((len(params), f"{path}:{name}"))
    return [{"function": f, "params": n} for n, f in sorted(rows, key=lambda r: (-r[0], r[1]))[:most]]


def option_names(files: dict[str, ast.Module]) -> tuple[str, list[str]]:
    """(where they come from, the store's option names): StoreOptions' fields, else the
    keywords of ``KVStore.__init__``."""
    for path, cls_name, init in (("kvstore/options.py", "StoreOptions", False), ("kvstore/store.py", "KVStore", True)):
        tree = files.get(path)
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.ClassDef) and node.name == cls_name:
                if not init:
                    return (f"{path}:{cls_name}", [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                                                    and isinstance(s.target, ast.Name)])
                for s in node.body:
                    if isinstance(s, ast.FunctionDef) and s.name == "__init__":
                        a = s.args
                        return (f"{path}:{cls_name}.__init__",
                                [p.arg for p in a.args + a.kwonlyargs if p.arg != "self"])
    return ("none found", [])


def store_options(files: dict[str, ast.Module]) -> dict[str, Any]:
    """Part 5: how many places state each store option, and the places that state the list."""
    source, names = option_names(files)
    wanted = set(names)
    flags = {"--" + n.replace("_", "-"): n for n in names}
    places: Counter[str] = Counter()
    in_files: dict[str, set[str]] = {n: set() for n in names}
    lists = []
    for path, tree in files.items():
        for node in ast.walk(tree):
            said: list[str] = []
            kind = ""
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                said, kind = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg in wanted], "parameters"
            elif isinstance(node, ast.Call):
                said = [k.arg for k in node.keywords if k.arg in wanted]
                said += [flags[a.value] for a in node.args if isinstance(a, ast.Constant) and a.value in flags]
                kind = "keywords"
            elif isinstance(node, ast.Dict):
                said, kind = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in wanted], "dict keys"
            elif isinstance(node, ast.ClassDef):
                said = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                        and isinstance(s.target, ast.Name) and s.target.id in wanted]
                kind = "class fields"
            for n in said:
                places[n] += 1
                in_files[n].add(path)
            if len(set(said)) >= LIST_AT_LEAST:
                label = getattr(node, "name", None) or kind
                lists.append({"where": f"{path}:{getattr(node, 'lineno', 0)} {label}", "options": len(set(said)), "as": kind})
    per = {n: {"places": places[n], "files": len(in_files[n])} for n in names}
    return {"source": source, "options": len(names), "per_option": per, "option_lists": lists,
            "counts": {"option_lists": len(lists), "places": sum(places.values()),
                       "most_stated": max(per.items(), key=lambda kv: (kv[1]["places"], kv[0]))[0] if per else None}}


def commit(root: Path) -> str | None:
    got = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return got.stdout.strip() or None


def shape(root: Path, model: str = "/nonexistent/model", run: bool = True) -> dict[str, Any]:
    """Every part, for the checkout at ``root`` (``run`` False: the source only, parts 2-5)."""
    files = _files(root)
    out: dict[str, Any] = {"checkout": {"commit": commit(root)}}
    if run:
        out["mlx_lm_server"] = mlx_lm_server(root, model)
        if Path(model).is_dir():
            out["chat_path"] = chat_path(root, model)
    out.update(run_time_state=run_time_state(files), imports=imports(root),
               widest_signatures=widest_signatures(files), store_options=store_options(files))
    return out


def table(s: dict[str, Any]) -> str:
    """The figures of ``shape`` in a few lines."""
    lines = [f"kvstore serve's shape at {s['checkout']['commit']}"]
    m = s.get("mlx_lm_server")
    if m is not None and "error" in m:
        lines.append(f"assignments onto mlx_lm.server: not measured ({m['error'][:200]})")
    elif m is not None:
        parts = [f"module names {m['module_names']}"] + [
            f"{c} {'subclass; ' if m[c]['rebound_to_subclass'] else ''}methods {m[c]['methods']} flags {m[c]['flags']}"
            for c in ("APIHandler", "ResponseGenerator")]
        lines.append(f"assignments onto mlx_lm.server ({m['method']}): {m['count']}: " + "; ".join(parts))
    r = s["run_time_state"]["counts"]
    lines.append(f"run-time state: {r['thread_locals']} thread-locals, {r['global_statements']} global statements, "
                 f"{r['other_modules_names_written']} other modules' names written, "
                 f"{r['module_objects_changed_in_functions']} module objects changed in functions")
    i = s["imports"]
    lines.append(f"imports: {i['modules']} modules, {i['imports']} imports, {len(i['cycles'])} cycles, "
                 f"{len(i['upward'])} pointing up")
    lines.append("widest signatures: " + ", ".join(f"{w['function']} {w['params']}" for w in s["widest_signatures"]))
    o = s["store_options"]
    lines.append(f"store options ({o['source']}): {o['options']} options stated in {o['counts']['places']} places; "
                 f"{o['counts']['option_lists']} places state {LIST_AT_LEAST} or more; most stated: "
                 + ", ".join(f"{n} {v['places']} in {v['files']} files" for n, v in
                             sorted(o["per_option"].items(), key=lambda kv: -kv[1]["places"])[:3]))
    c = s.get("chat_path")
    if c is not None and "error" in c:
        lines.append(f"one chat request: not measured ({c['error'][:200]})")
    elif c is not None:
        for name, th in c["threads"].items():
            lines.append(f"one chat request, thread {name}: {len(th['modules_entered'])} modules entered "
                         f"({', '.join(th['modules_entered'])}), {th['moves']} moves, "
                         f"{th['returns_to_a_module_left']} returns to a module left")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2])
        return 0
    if argv[:1] == ["--trace"]:
        _trace(argv[1], argv[2])
        return 0
    root = Path(argv[argv.index("--repo") + 1]).resolve() if "--repo" in argv else HERE.parents[2]
    model = argv[argv.index("--model") + 1] if "--model" in argv else "/nonexistent/model"
    s = shape(root, model, run="--static" not in argv)
    print(json.dumps(s, indent=1) if "--json" in argv else table(s), end="\n" if "--json" in argv else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
