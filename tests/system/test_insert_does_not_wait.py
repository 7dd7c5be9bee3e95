"""An insert returns while the host's computation of the cache is still running.

mlx-lm's generation runs one step ahead: the cache it inserts is often not computed yet,
and an insert that waited for it would hold the end of every turn up by that step
(``memory.snapshot``: the snapshot is scheduled, and its readers wait). Shown with a
computation the test holds from outside: the cache is made from an ``all_sum`` over MLX's
ring backend (two processes on 127.0.0.1), which cannot finish until the peer process sends
its part, and the test releases the peer only once the host has said the insert returned.
An insert that waited, or that ran anything on the host's busy stream, never returns, and
the test fails at its deadline. After the release, the memory hit and the disk entry hold
the computed values.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from queue import Empty, Queue

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 240.0  # for both processes to start and the host to say the insert returned

CHILD = r'''
import json, sys
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from kvstore import KVStore
from tests.support.caches import ident

group = mx.distributed.init(strict=True, backend="ring")
part = mx.ones((1, 2, 40, 8))
if group.rank() == 1:  # the peer: holds the host's all_sum until the test says go
    sys.stdin.readline()
    mx.eval(mx.distributed.all_sum(part, stream=mx.cpu))
    sys.exit(0)
summed = mx.distributed.all_sum(part, stream=mx.cpu)  # 2.0 everywhere, once the peer sends
cache = []
for i in range(2):
    c = KVCache()
    c.update_and_fetch(summed * (i + 1), summed + i)
    cache.append(c)
model, tokens = ident("ring"), list(range(40))
store = KVStore(sys.argv[1])
store.insert(model, tokens, cache)
print("inserted", flush=True)
sys.stdin.readline()  # the peer was released
seen = {}
got = store.fetch(model, tokens + [99])
seen["memory"] = (got.source, got.n, [mx.array_equal(c.keys, summed * (i + 1)).item() and
                                      mx.array_equal(c.values, summed + i).item() for i, c in enumerate(got.cache)])
store.close()
with KVStore(sys.argv[1]) as again:
    got = again.fetch(model, tokens + [99])
    seen["disk"] = (got.source, got.n, [mx.array_equal(c.keys, summed * (i + 1)).item() and
                                        mx.array_equal(c.values, summed + i).item() for i, c in enumerate(got.cache)])
print(json.dumps(seen), flush=True)
'''


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _lines(stream, into: Queue) -> None:
    for line in stream:
        into.put(line.strip())
    into.put(None)


def _attempt(tmp_path: Path, k: int) -> tuple[bool, list[str], int | None]:
    """One run of the two processes: (the host said the insert returned before the peer
    was released, every line the host printed, the host's exit status)."""
    script = tmp_path / "ring_host.py"
    script.write_text(CHILD)
    hosts = tmp_path / f"hosts{k}.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in _free_ports(2)]))
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLX_HOSTFILE": str(hosts)}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / f"cache{k}")], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**env, "MLX_RANK": str(rank)})
             for rank in (0, 1)]
    host, peer = procs
    out: Queue = Queue()
    threading.Thread(target=_lines, args=(host.stdout, out), daemon=True).start()
    threading.Thread(target=_lines, args=(peer.stdout, Queue()), daemon=True).start()  # drained
    said: list[str] = []
    end = time.monotonic() + DEADLINE  # one deadline for every line, however many come
    try:
        try:
            while not said or said[-1] != "inserted":
                line = out.get(timeout=max(0.0, end - time.monotonic()))
                if line is None:
                    break
                said.append(line)
        except Empty:
            pass
        returned_first = bool(said) and said[-1] == "inserted"
        for p in (peer, host):  # the peer first: the host's all_sum can finish now
            try:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # it has ended already: its status says how
        status = host.wait(120)
        while (line := out.get(timeout=30)) is not None:
            said.append(line)
        peer.wait(120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return returned_first, said, status


def test_an_insert_returns_before_the_hosts_computation_of_the_cache_finishes(tmp_path: Path) -> None:
    for k in range(3):  # a port taken between choosing and binding it ends both processes at once
        returned_first, said, status = _attempt(tmp_path, k)
        if returned_first or status == 0:
            break
    assert status == 0, said
    assert returned_first, f"the insert did not return while the cache was being computed: {said}"
    seen = json.loads(said[-1])
    assert seen == {"memory": ["memory", 40, [True, True]], "disk": ["disk", 40, [True, True]]}, seen
