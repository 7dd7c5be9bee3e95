"""The fault kinds, one module each, holding both halves of the kind: the worker-side
``op_*`` commands (run inside a worker process) and the parent-side ``run_<kind>(ctx)``
that drives them and tallies the result."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..worker import Op
from . import bad_input, concurrency, corruption, crash, full_disk, hostile, permissions, shared

if TYPE_CHECKING:
    from ..context import Ctx

# the parent's runner of each kind
RUNNERS: dict[str, Callable[[Ctx], dict]] = {
    "crash": crash.run_crash, "corruption": corruption.run_corruption, "full_disk": full_disk.run_full_disk,
    "permissions": permissions.run_permissions, "concurrency": concurrency.run_concurrency,
    "bad_input": bad_input.run_bad_input, "hostile": hostile.run_hostile, "shared": shared.run_shared,
}
# the worker commands the kinds add to the check (see serve.operations)
OPS: dict[str, Op] = {
    "populate": permissions.op_populate,
    "crash_run": crash.op_crash_run, "build_template": corruption.op_build_template, "live": corruption.op_live,
    "full_disk": full_disk.op_full_disk, "open_full": full_disk.op_open_full, "perm": permissions.op_perm,
    "bad_input": bad_input.op_bad_input, "conc": concurrency.op_conc,
    "cli": hostile.op_cli, "owner": hostile.op_owner, "modes": hostile.op_modes, "clock": hostile.op_clock,
    "weights_populate": hostile.op_weights_populate, "weights_fetch": hostile.op_weights_fetch,
    "shared_publish": shared.op_shared_publish, "shared_fetch": shared.op_shared_fetch,
}
