"""kvstore.alloc: a restore reads in a bounded number of allocation groups."""

from __future__ import annotations


def test_a_long_conversation_is_read_in_a_bounded_number_of_groups():
    """Issue 47, item 3: a restore reads each allocation group from every segment, and
    groups had a fixed size, so a conversation 4x as long (4x the chunks, 4x the bytes)
    made 10x the segment reads, tasks and spans: restore time grew as the square of the
    length (0.7 s at 16k tokens, 9.5 s at 64k). Now the groups of a SmolLM2-shaped
    entry (30 layers, float32) are at most 8 at any length, each tensor whole, in order."""
    from kvstore import alloc

    for n in (1024, 16384, 65536, 131072):
        specs = {f"{i:02d}.{kv}": ("F32", (1, 3, n, 64)) for i in range(30) for kv in ("keys", "values")}
        got = alloc.groups(specs)
        assert len(got) <= 8, (n, len(got))
        assert [name for g in got for name in g] == list(specs)


def test_an_entry_of_many_segments_is_allocated_in_fewer_groups():
    """Issue 56: each group is read from every segment, so eight groups made 8 x 512 reads
    of a 128k-token conversation (256-token chunks) and measured slower than one group at
    8k, 32k and 128k tokens. The groups shrink as the segments grow: a snapshot (one
    segment) is still read group by group as its arrays are made (the overlap), a
    conversation of 8 or more segments is allocated at once; never more than one read
    per group and segment beyond ``MAX_GROUPS``."""
    from kvstore import alloc

    specs = {f"{i:02d}.{kv}": ("F32", (1, 3, 131072, 64)) for i in range(30) for kv in ("keys", "values")}
    assert len(alloc.groups(specs, segments=1)) == alloc.MAX_GROUPS
    assert len(alloc.groups(specs, segments=2)) == alloc.MAX_GROUPS // 2
    for segments in (8, 32, 512):
        got = alloc.groups(specs, segments=segments)
        assert len(got) == 1 and list(got[0]) == list(specs), segments
    for segments in range(1, 20):
        assert len(alloc.groups(specs, segments=segments)) * segments <= alloc.MAX_GROUPS + segments


def test_fresh_bytes_are_private_memory_of_the_length_asked():
    """Private anonymous memory (shared anonymous memory is shmem on Linux, slower to
    fault in): a forked child's write to it is its own copy, never seen here."""
    import os

    from kvstore.alloc import fresh_bytes

    view = fresh_bytes(3 * 4096 + 5)
    assert len(view) == 3 * 4096 + 5 and not view.readonly and bytes(view[:8]) == bytes(8)
    pid = os.fork()
    if pid == 0:  # the child: writes, and leaves at once
        view[0] = 7
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert view[0] == 0, "the child's write reached this process: the memory is shared"
    assert len(fresh_bytes(0)) == 0
