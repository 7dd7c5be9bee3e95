"""How much memory the machine, or the container kvstore runs in, can still give.

On a Mac the memory tier's snapshots share unified memory with the model's weights and
everything else the user runs, so its byte budget follows what is available: it may grow
while memory is free and must give memory back when it is not, keeping a floor of free
memory it never eats into. Within a container (a Linux cgroup, v1 or v2) the limit is the
container's, not the host's: a host with 20 GB free means nothing to a process the kernel
kills at its cgroup's 2 GB. The cgroup is found through /proc/self/mountinfo (``locate``),
not under a fixed /sys/fs/cgroup path: a container may see its own cgroup mounted as the
whole hierarchy while /proc/self/cgroup names the host's path for it.

A GPU with memory of its own (MLX's CUDA backend: ``mx.device_info(mx.gpu)`` reports
``free_memory`` and ``total_memory``) holds the snapshots' arrays in device memory, which
host RAM says nothing about: there the budget is the lower of the two, each keeping its own
floor (``device_read``). Metal's memory is the machine's own (unified: ``memory_size``
only), and the CPU backend reports none: host RAM alone.

Readings cost a few tens of microseconds (psutil, or /proc/meminfo, and two or three small
cgroup files); ``Gauge`` caches one for a fraction of a second, so the request path never
pays more than one reading per interval.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .hoststate import releasing
from .escape import logger

# The memory tier keeps this much of the machine's (or container's) memory free by default:
# a fifth leaves room for the model's activations and the user's other programs on a Mac.
DEFAULT_MEMORY_FLOOR = 0.2
WATCH_SECONDS = 0.5
log = logger("kvstore")
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)


@dataclass(frozen=True)
class Reading:
    """Bytes still available to this process, and the total it may ever have (the
    machine's memory, or its container's limit when lower)."""

    available: int
    total: int


def _machine() -> Reading | None:
    try:
        import psutil
    except ImportError:  # psutil is a dependency; /proc/meminfo keeps Linux working without it
        return _meminfo()
    vm = psutil.virtual_memory()
    return Reading(int(vm.available), int(vm.total))


# The kernel's files are ASCII numbers and names, and paths as bytes. Each parser below takes
# the text as read (``_read_text``: undecodable bytes kept as surrogates, as os.fsdecode
# does, so a path still names its file) and never raises: a file it cannot read says nothing.
_NUMBER = re.compile(r"[0-9]{1,20}")  # ASCII digits only ("²".isdigit(), int() refuses it)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", "surrogateescape")
    except (OSError, ValueError):  # ValueError: a path with a NUL in it
        return None


def _lines(text: str) -> list[str]:
    return text.split("\n")  # not splitlines(): a path may hold \x1c, \x85, \u2028 ... unescaped


def parse_number(text: str | None) -> int | None:
    """A cgroup file's single number (memory.max, memory.current, ...); None for ``max``
    (no limit) or anything that is not a plain ASCII number."""
    text = (text or "").strip(" \t\n\r")  # ASCII whitespace only: str.strip() also takes \x1c-\x1f
    return int(text) if _NUMBER.fullmatch(text) else None


def stat_value(text: str | None, name: str) -> int:
    """The value of ``name`` in a ``memory.stat`` text (``name value`` lines); 0 when absent
    or not a plain number."""
    for line in _lines(text or ""):
        k, _, v = line.partition(" ")
        if k == name:
            return parse_number(v) or 0
    return 0


def parse_meminfo(text: str | None) -> Reading | None:
    """(MemAvailable, MemTotal) of /proc/meminfo's text (``Name:   123 kB`` lines), or None."""
    fields: dict[str, int] = {}
    for line in _lines(text or ""):
        name, colon, rest = line.partition(":")
        parts = rest.split()
        if colon and (len(parts) == 1 or (len(parts) == 2 and parts[1] == "kB")):
            n = parse_number(parts[0])
            if n is not None:
                fields[name.strip()] = n * (1024 if parts[-1] == "kB" else 1)
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    return Reading(fields["MemAvailable"], fields["MemTotal"])


def _meminfo() -> Reading | None:
    return parse_meminfo(_read_text(Path("/proc/meminfo")))


def _read_int(path: Path) -> int | None:
    return parse_number(_read_text(path))


def _stat(path: Path, name: str) -> int:
    return stat_value(_read_text(path), name)


def _file_cache(stat: Path, prefix: str = "") -> int:
    """The group's clean-or-syncable file cache (active and inactive), which the kernel
    reclaims before it kills anything: counted as available, as the machine's MemAvailable
    counts it. kvstore's own pack files land there as it writes them."""
    return _stat(stat, prefix + "active_file") + _stat(stat, prefix + "inactive_file")


def cgroup_paths(text: str | None) -> tuple[str | None, str | None]:
    """(the v2 path, the v1 memory controller's path) in /proc/self/cgroup's text
    (``id:controllers:path`` lines; a line of another shape is passed over)."""
    v2 = v1 = None
    for line in _lines(text or ""):
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _cgroup_paths() -> tuple[str | None, str | None]:
    """(the v2 path, the v1 memory controller's path) of this process, from /proc/self/cgroup."""
    return cgroup_paths(_read_text(Path("/proc/self/cgroup")))


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are written in octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cgroup_mounts(mountinfo: str) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """(cgroup v2 mounts, cgroup v1 mounts holding the memory controller) listed in
    ``mountinfo`` (/proc/self/mountinfo's text), each as (the cgroup it shows at its root,
    where it is mounted), in mount order: a later mount on the same point hides an earlier."""
    v2: list[tuple[str, Path]] = []
    v1: list[tuple[str, Path]] = []
    for line in _lines(mountinfo):
        fields = [f for f in line.split(" ") if f]  # the kernel escapes " \t\n\\" in a field, nothing else
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 4:
            continue
        kind, supers = fields[sep + 1], fields[sep + 3].split(",")
        mount = (_unescape(fields[3]), Path(_unescape(fields[4])))
        if kind == "cgroup2":
            v2.append(mount)
        elif kind == "cgroup" and "memory" in supers:
            v1.append(mount)
    return v2, v1


def locate(path: str, mounts: list[tuple[str, Path]]) -> tuple[Path, Path] | None:
    """The directory of cgroup ``path`` (as /proc/self/cgroup names it) under ``mounts``:
    the mount's root stripped from it, the latest mount first (one mounted over another
    hides it). A container's own cgroup bind-mounted as the hierarchy (Docker's cgroup v1
    layout, where /proc/self/cgroup still names the host's path) is found so; when no mount
    holds the path (a cgroup namespace renames it), the latest mount point itself, which is
    then the process's own cgroup. Returns (that directory, its mount point), or None: no
    such hierarchy is mounted."""
    for root, point in reversed(mounts):
        base = root.rstrip("/")
        if path == base or path.startswith(base + "/"):
            d = point / path[len(base):].lstrip("/")
            if d.is_dir():
                return d, point
    return (mounts[-1][1], mounts[-1][1]) if mounts else None


def _cgroup_dirs() -> tuple[tuple[Path, Path] | None, tuple[Path, Path] | None]:
    """(this process's v2 cgroup, its v1 memory cgroup), each as ``locate`` gives it,
    resolved through /proc/self/mountinfo."""
    v2_path, v1_path = _cgroup_paths()
    text = _read_text(Path("/proc/self/mountinfo"))
    if text is None:
        return None, None
    v2_mounts, v1_mounts = cgroup_mounts(text)
    return (locate(v2_path, v2_mounts) if v2_path is not None else None,
            locate(v1_path, v1_mounts) if v1_path is not None else None)


def _cgroup() -> Reading | None:
    """The tightest memory limit of this process's cgroup and its ancestors, and the room
    left under it (usage less the file cache the kernel reclaims first), or None."""
    v2_dirs, v1_dirs = _cgroup_dirs()
    if v1_dirs is not None:
        v1 = v1_dirs[0]
        limit = _stat(v1 / "memory.stat", "hierarchical_memory_limit") or _read_int(v1 / "memory.limit_in_bytes")
        usage = _read_int(v1 / "memory.usage_in_bytes")
        if limit and limit < NO_LIMIT and usage is not None:
            used = usage - _file_cache(v1 / "memory.stat", "total_")
            return Reading(max(0, limit - used), limit)
        return None
    if v2_dirs is None:
        return None
    best: Reading | None = None
    d, top = v2_dirs
    while True:
        limit, usage = _read_int(d / "memory.max"), _read_int(d / "memory.current")
        if limit is not None and usage is not None:
            room = Reading(max(0, limit - (usage - _file_cache(d / "memory.stat"))), limit)
            best = room if best is None or room.available < best.available else best
        if d == top or top not in d.parents:
            return best
        d = d.parent


def read() -> Reading | None:
    """What this process may still take: the machine's available memory, or its
    container's room when that is less. None where neither can be read."""
    machine = _machine()
    box = _cgroup() if os.name == "posix" and Path("/proc/self/cgroup").exists() else None
    if machine is None or box is None:
        return machine or box
    return Reading(min(machine.available, box.available), min(machine.total, box.total))


def parse_device_info(info: Mapping[str, object]) -> Reading | None:
    """(free, total) device memory of an ``mx.device_info`` dict, or None where the device
    reports no memory of its own (CUDA reports ``free_memory`` / ``total_memory``; Metal
    only ``memory_size``, the machine's unified memory; the CPU nothing)."""
    free, total = info.get("free_memory"), info.get("total_memory")
    if isinstance(free, int) and isinstance(total, int) and not isinstance(free, bool) and total > 0:
        return Reading(max(0, min(free, total)), total)
    return None


def device_read() -> Reading | None:
    """The GPU's own memory, when MLX (already imported: nothing here imports it) has a GPU
    that reports memory of its own (``parse_device_info``); None otherwise, or on any error."""
    mx = sys.modules.get("mlx.core")
    try:
        if mx is None or not mx.is_available(mx.gpu):
            return None
        return parse_device_info(mx.device_info(mx.gpu))
    except Exception:  # an MLX without device_info, a driver that will not say: host RAM only
        return None


def floor_bytes(floor: float | int, total: int) -> int:
    """A floor given as a fraction of the total (0 < f < 1) or in bytes."""
    return int(floor * total) if isinstance(floor, float) and 0 < floor < 1 else int(floor)


class Gauge:
    """The memory tier's byte budget: ``min(cap, held + available - floor)``, read at most
    once per ``interval`` seconds. ``cap`` is the user's hard limit (``max_bytes``). Where
    ``device`` reads a GPU's own memory (``device_read``, the default), the budget is also
    at most ``held + device available - device floor``: the snapshots live there."""

    def __init__(self, floor: float | int, interval: float = 0.25,
                 device: Callable[[], Reading | None] = device_read) -> None:
        if isinstance(floor, bool) or floor < 0 or (isinstance(floor, float) and floor >= 1):
            raise ValueError(f"memory_floor must be a fraction in [0, 1) or a number of bytes, got {floor!r}")
        self.floor = floor
        self.interval = interval
        self._lock = threading.Lock()
        self._at = -1e18
        self._reading: Reading | None = None
        self._device = device
        self._device_reading: Reading | None = None

    def _refresh(self) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self.interval:
                self._reading, self._device_reading, self._at = read(), self._device(), now

    def reading(self) -> Reading | None:
        """Host memory (the machine's, or the container's), read at most once per interval."""
        self._refresh()
        return self._reading

    def device_reading(self) -> Reading | None:
        """The GPU's own memory where it has some (``device``), read with ``reading``."""
        self._refresh()
        return self._device_reading

    def budget(self, held: int, cap: int) -> int:
        """Bytes the tier may hold now, given the ``held`` bytes it holds: within the floor
        of host memory and, on a GPU with memory of its own, of device memory too."""
        self._refresh()
        out = cap
        for r in (self._reading, self._device_reading):
            if r is not None:
                out = min(out, held + r.available - floor_bytes(self.floor, r.total))
        return max(0, out)

    def stats(self) -> dict[str, int | None]:
        """Available memory now and the floor under it (``stats()``'s memory figures)."""
        r = self.reading()
        return {"memory_available_bytes": r.available if r is not None else None,
                "memory_floor_bytes": self.floor_of()}

    def floor_of(self) -> int | None:
        r = self.reading()
        return floor_bytes(self.floor, r.total) if r is not None else None


class Watch:
    """A daemon thread calling ``tick`` every ``interval`` seconds until ``tick`` returns
    False or ``stop`` is called; an exception in ``tick`` is logged once and the watch goes on."""

    def __init__(self, tick: Callable[[], bool], interval: float = WATCH_SECONDS) -> None:
        self._tick, self._interval = tick, interval
        self._stopped = threading.Event()
        # a tick may evict and clear MLX's cache: MLX work on this thread (see hoststate)
        self._thread = threading.Thread(target=releasing(self._watch), name="kvstore-memory", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        warned = False
        while not self._stopped.wait(self._interval):
            try:
                if not self._tick():
                    return
            except Exception:
                if not warned:
                    warned = True
                    log.exception("kvstore: the memory watch failed (it goes on)")

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
