"""kvstore.pressure: the memory cgroup located through /proc/self/mountinfo."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore import pressure


@pytest.mark.parametrize("mountinfo,path,want", [
    # cgroup v1, Docker: the container's own group mounted as the hierarchy, the host path in /proc/self/cgroup
    ("63 51 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory", "/docker/abc",
     "/sys/fs/cgroup/memory"),
    # the whole hierarchy mounted, hidden by a later mount of one group on the same point
    ("35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
     "63 35 0:32 /a/b /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory", "/a/b/c", "/sys/fs/cgroup/memory"),
    # cgroup v2 in a cgroup namespace: the path is "/", the mount's root too
    ("30 23 0:26 / /sys/fs/cgroup rw shared:4 - cgroup2 cgroup2 rw,nsdelegate", "/", "/sys/fs/cgroup"),
    # a mount point with a space in it (octal-escaped in mountinfo)
    ("41 31 0:38 /ctr /run/my\\040cgroups rw - cgroup2 cgroup2 rw", "/host/ctr", "/run/my cgroups"),
])
def test_the_cgroup_is_located_through_mountinfo(mountinfo: str, path: str, want: str) -> None:
    """Where /proc/self/mountinfo's text says the cgroup is (no directory exists here: the
    fallback, the latest mount point itself, is what is found)."""
    v2, v1 = pressure.cgroup_mounts(mountinfo)
    got = pressure.locate(path, v2 or v1)
    assert got is not None and got[0] == Path(want) and got[1] == Path(want), got


# -- property tests of the /proc and cgroup parsers (hypothesis; tests/conftest.py's profile) ------

from hypothesis import example, given, strategies as st  # noqa: E402

ANY_TEXT = st.text(st.characters(codec="utf-8") | st.sampled_from(list(" \t\n:-,/\\0123456789\x85\u2028\x1c")))
PATH_CHARS = st.characters(codec="utf-8", exclude_characters="\n\0") | st.sampled_from(list(" \t\\\x85\u2028\x1c"))
PATHS = st.lists(st.text(PATH_CHARS, min_size=1, max_size=8).filter(lambda p: "/" not in p), max_size=4) \
    .map(lambda parts: "/" + "/".join(parts))


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cgroup")  # one directory for every example


def _escape(path: str) -> str:  # as the kernel writes a mountinfo path field (fs/proc_namespace.c)
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


@given(ANY_TEXT, st.sampled_from(["memory.max", "stat", "meminfo", "cgroup", "mountinfo"]))
@example("MemAvailable:\nMemTotal: 5 kB", "meminfo")
@example("0::/\nnot a cgroup line", "cgroup")
@example("\u00b2", "memory.max")
@example("total_active_file \u00b2", "stat")
def test_no_text_in_a_proc_or_cgroup_file_raises(text: str, kind: str) -> None:
    """Whatever a file holds (a planted one, a kernel we do not know), reading it gives a
    value or nothing: never an exception out of the memory gauge."""
    if kind == "memory.max":
        got = pressure.parse_number(text)
        assert got is None or (got >= 0 and str(got) == text.strip().lstrip("0").rjust(1, "0"))
    elif kind == "stat":
        assert pressure.stat_value(text, "total_active_file") >= 0
    elif kind == "meminfo":
        r = pressure.parse_meminfo(text)
        assert r is None or (r.available >= 0 and r.total >= 0)
    elif kind == "cgroup":
        v2, v1 = pressure.cgroup_paths(text)
        assert all(p is None or p.startswith("/") for p in (v2, v1))
    else:
        v2, v1 = pressure.cgroup_mounts(text)
        for root, point in v2 + v1:
            assert isinstance(root, str) and isinstance(point, Path)
            pressure.locate("/a/b", v2 or v1)


@given(st.binary(max_size=64))
@example(b"\xff\xfe")
@example("\u00b2".encode())
def test_a_cgroup_file_of_any_bytes_reads_as_a_number_or_nothing(files_dir: Path, data: bytes) -> None:
    """The file-reading side: bytes that are not UTF-8, or digits int() refuses, are
    nothing (None / 0), not an exception."""
    f = files_dir / "memory.max"
    f.write_bytes(data)
    got = pressure._read_int(f)
    assert got is None or (data.strip().isdigit() and got == int(data.strip()))
    f.write_bytes(b"total_active_file " + data + b"\ninactive_file 3\n")
    assert pressure._stat(f, "inactive_file") in (0, 3) and pressure._stat(f, "total_active_file") >= 0


@given(PATHS, PATHS, st.booleans())
@example("/docker/abc", "/sys/fs/cgroup/memory", False)
@example("/a b\\c\u2028d", "/run/my\tcgroups\x85", True)
def test_a_mountinfo_line_reads_back_its_paths(root: str, point: str, v2: bool) -> None:
    """A mount the kernel lists (its path fields escaped as it escapes them) is read back
    with exactly those paths, whatever characters they hold, among other lines."""
    kind, supers = ("cgroup2", "rw,nsdelegate") if v2 else ("cgroup", "rw,memory")
    line = f"63 51 0:32 {_escape(root)} {_escape(point)} rw,nosuid shared:4 - {kind} cgroup {supers}"
    text = "\n".join(["25 1 8:1 / / rw - ext4 /dev/root rw", line, "garbage", ""])
    got2, got1 = pressure.cgroup_mounts(text)
    assert (got2 if v2 else got1) == [(root, Path(point))] and not (got1 if v2 else got2)


@given(PATHS, PATHS)
def test_proc_self_cgroup_reads_back_its_paths(v2: str, v1: str) -> None:
    text = f"12:cpu,cpuacct:/x\n4:memory:{v1}\n0::{v2}\n"
    assert pressure.cgroup_paths(text) == (v2, v1)


# -- a GPU with memory of its own (issue 55, hazard b) -----------------------------------

# What MLX 0.32's backends report (mlx/backend/cuda/device_info.cpp; Metal's device_info; the CPU's).
CUDA_INFO = {"device_name": "NVIDIA H200", "architecture": "sm_90", "free_memory": 40 << 30,
             "total_memory": 140 << 30}
METAL_INFO = {"architecture": "applegpu_g15s", "memory_size": 64 << 30, "max_recommended_working_set_size": 48 << 30}
CPU_INFO = {"architecture": "x86_64", "device_name": "AMD EPYC"}


def test_only_a_device_that_reports_memory_of_its_own_is_read() -> None:
    assert pressure.parse_device_info(CUDA_INFO) == pressure.Reading(40 << 30, 140 << 30)
    assert pressure.parse_device_info(METAL_INFO) is None  # unified memory: host RAM already says it
    assert pressure.parse_device_info(CPU_INFO) is None
    assert pressure.parse_device_info({"free_memory": "x", "total_memory": 1}) is None


def test_the_budget_keeps_the_floor_of_device_memory_too() -> None:
    """A host with RAM to spare and a GPU nearly full: the tier's snapshots live on the GPU,
    so the GPU's room (less its floor) bounds the budget, not the host's."""
    host = pressure.read()
    assert host is not None and host.available > (1 << 30), host  # this test needs a GB of RAM free
    gpu = pressure.Reading(available=300 << 20, total=1 << 30)  # 300 MiB free of 1 GiB
    g = pressure.Gauge(100 << 20, device=lambda: gpu)  # a floor of 100 MiB
    assert g.device_reading() == gpu
    assert g.budget(0, 1 << 62) == 200 << 20
    assert g.budget(50 << 20, 1 << 62) == 250 << 20  # what it holds is room it may keep
    assert g.budget(0, 1000) == 1000  # the user's cap still caps
    full = pressure.Gauge(0.5, device=lambda: gpu)  # half of the device: more than is free
    assert full.budget(0, 1 << 62) == 0
    none = pressure.Gauge(100 << 20, device=lambda: None)  # the CPU backend, or Metal
    assert none.budget(0, 1 << 62) > 300 << 20  # host RAM alone


def test_the_default_device_reading_follows_mlx() -> None:
    """On this machine's MLX: a GPU with its own memory is read, anything else gives None."""
    import mlx.core as mx

    got = pressure.device_read()
    if mx.is_available(mx.gpu):
        assert (got is None) == (pressure.parse_device_info(mx.device_info(mx.gpu)) is None)
    else:
        assert got is None
