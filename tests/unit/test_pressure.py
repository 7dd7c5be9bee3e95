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
