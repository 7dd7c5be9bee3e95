"""The memory tier follows the memory the machine (here: a memory cgroup, as a container
would be) can still give: under real pressure from another process its snapshots leave
memory, nothing is lost (each is served again from disk, bit for bit), the process holding
the store is not killed, and the budget grows back when the memory returns.

The cgroup is a real kernel memory cgroup (v1 or v2) made by the test, with a hard limit:
without kvstore giving memory back, the second process's allocation would push the group
over its limit and the kernel would kill one of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from kvstore import pressure
from tests.support.children import child_env
from tests.support import ROOT
from tools.testing.procs import end_group, start_group

MB = 1 << 20
LIMIT = 1400 * MB  # the group: python + MLX (~250 MB), the store's 10 x 48 MB, the hog's 640 MB
FLOOR = 250 * MB  # kvstore keeps this much of the group free


def _make_cgroup(limit: int) -> Path | None:
    """A fresh memory cgroup with a hard ``limit``; returns its cgroup.procs (None: the
    kernel or our rights do not allow one here)."""
    name = f"kvstore-test-{uuid.uuid4().hex[:8]}"
    for root, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):
        if not (root / "cgroup.procs").exists() or (limit_file == "memory.max" and
                                                     not (root / "cgroup.subtree_control").exists()):
            continue
        try:
            d = root / name
            d.mkdir()
            (d / limit_file).write_text(str(limit))
            return d / "cgroup.procs"
        except OSError:
            continue
    return None


HOG = """
import json, sys, time
import numpy as np
open(sys.argv[1], "w").write(__import__("os").getpid().__str__())
held = []
for _ in range(int(sys.argv[2]) // 32):
    held.append(np.ones(32 << 20, dtype=np.uint8))  # touched: resident
    time.sleep(0.15)
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def cgroup():
    procs = _make_cgroup(LIMIT)
    if procs is None:
        pytest.skip("no memory cgroup can be made here (needs root and a cgroup v1 memory or v2 hierarchy)")
    yield procs
    for p in procs.read_text().split():  # anything left is ours
        try:
            os.kill(int(p), 9)
        except OSError:
            pass
    try:
        procs.parent.rmdir()
    except OSError:
        pass


def test_the_memory_tier_yields_to_real_pressure_and_loses_nothing(tmp_path: Path, cgroup: Path) -> None:
    store = start_group(
        [sys.executable, "-m", "tests.support.programs.memory_pressure",
         json.dumps({"cgroup": str(cgroup), "dir": str(tmp_path / "cache"), "floor": FLOOR, "entries": 10,
                     "layers": 12})],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        cwd=str(ROOT))
    started = [store]
    try:
        _pressure_round(store, cgroup, started)
    finally:  # neither process outlives the test, whatever failed
        for p in started:
            end_group(p, grace=0)


def _pressure_round(store: subprocess.Popen, cgroup: Path, started: list[subprocess.Popen]) -> None:
    assert store.stdin is not None and store.stdout is not None

    def ask(cmd: str | None = None) -> dict:
        if cmd:
            store.stdin.write(cmd + "\n")  # type: ignore[union-attr]
            store.stdin.flush()  # type: ignore[union-attr]
        line = store.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the store's process ended ({store.wait()}): {store.stderr.read()[-3000:]}"  # type: ignore[union-attr]
        return json.loads(line)

    filled = ask()
    assert filled["memory_entries"] == 10 and filled["memory_bytes"] >= 10 * 48 * MB, filled
    assert filled["evictions_pressure"] in (0, None), filled  # room enough before the hog
    hog = start_group([sys.executable, "-c", textwrap.dedent(HOG), str(cgroup), str(640)],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    started.append(hog)
    assert hog.stdout is not None and hog.stdin is not None
    assert hog.stdout.readline().strip() == "held", f"the hog was killed ({hog.poll()})"
    shrunk = ask("wait_shrink")
    assert shrunk["ok"] and shrunk["evictions_pressure"] > 0, shrunk
    assert shrunk["memory_bytes"] < filled["memory_bytes"], (filled, shrunk)
    assert shrunk["dropped_writes"] == 0 and shrunk["write_errors"] == 0, shrunk
    hog.stdin.write("\n")
    hog.stdin.flush()
    assert hog.wait(300) == 0
    grown = ask("wait_grow")
    assert grown["ok"], (shrunk, grown)
    checked = ask("check")
    assert store.wait(300) == 0, store.stderr.read()[-3000:]  # type: ignore[union-attr]
    fetched = checked["fetched"]
    assert all(f["n"] == 512 and f["same"] for f in fetched), fetched  # nothing lost, bit for bit
    assert {"disk"} <= {f["source"] for f in fetched}, fetched  # the evicted ones came back from disk


def test_the_budget_reads_the_containers_limit_and_keeps_the_floor(cgroup: Path) -> None:
    """In a process inside the test's cgroup, ``pressure.read`` reports the group's limit
    (not the host's memory), and the gauge's budget keeps the floor free."""
    script = """
        import json, sys
        open(sys.argv[1], "w").write(__import__("os").getpid().__str__())
        from kvstore import pressure
        r = pressure.read()
        g = pressure.Gauge(0.25)
        budget = g.budget(0, 1 << 62)
        after = pressure.read()  # the group's usage moves as this process runs: the budget read between
        print(json.dumps({"total": r.total, "available": r.available, "budget": budget, "after": after.available,
                          "capped": g.budget(0, 1000)}))
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(cgroup)], capture_output=True, text=True,
                       env=child_env(), cwd=str(ROOT), timeout=120)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["total"] == LIMIT, got
    assert 0 < got["available"] < LIMIT
    lo, hi = sorted((got["available"], got["after"]))  # the budget's own read of available lies between
    assert max(0, lo - LIMIT // 4) <= got["budget"] <= max(0, hi - LIMIT // 4), got
    assert got["capped"] == min(1000, got["budget"])
    here = pressure.read()  # outside the group: the machine's (or this session's container's) memory
    assert here is not None and here.total > LIMIT


def test_a_containers_own_cgroup_mounted_as_the_hierarchy_is_found(cgroup: Path) -> None:
    """Docker's layout on a cgroup v1 host (and a v2 one without a cgroup namespace): the
    container's own memory cgroup is bind-mounted as the whole hierarchy while
    /proc/self/cgroup still names its host path. A process in the test's cgroup, in a
    private mount namespace (``unshare -m``) with that cgroup bind-mounted over the
    hierarchy's mount point, reads the group's limit, not the host's memory."""
    import shutil

    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("unshare(1) and mount(1) are needed to make a private mount namespace")
    group, point = cgroup.parent, cgroup.parent.parent  # e.g. /sys/fs/cgroup/memory/kvstore-test-x
    script = "import json; from kvstore import pressure; r = pressure.read(); print(json.dumps([r.total, r.available]))"
    shell = (f'echo $$ > "{cgroup}" && mount --make-rprivate / && mount --bind "{group}" "{point}" && '
             f'grep -q "{group.name} {point} " /proc/self/mountinfo && exec "{sys.executable}" -c "{script}"')
    p = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, env=child_env(),
                       cwd=str(ROOT), timeout=120)
    if p.returncode != 0 and ("unshare failed" in p.stderr or "Operation not permitted" in p.stderr):
        pytest.skip(f"no private mount namespace here: {p.stderr.strip()[:200]}")
    assert p.returncode == 0, p.stderr
    total, available = json.loads(p.stdout.strip().splitlines()[-1])
    assert total == LIMIT, (total, LIMIT, "the host's memory was read, not the container's")
    assert 0 < available < LIMIT


def test_a_bad_memory_floor_is_refused(tmp_path: Path) -> None:
    from kvstore import KVStore

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="memory_floor"):
            KVStore(tmp_path, memory_floor=bad)
