"""The worker process's side (``python -m tools.harness.faults --worker ROLE``): serve the check's and
the kinds' commands, JSON lines in and out. The parent's side of a worker is ``worker.Worker``;
this module sits above the kinds, which drive workers, so that neither imports the other."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

from .check import op_check
from .common import exc_info
from .kinds import OPS
from .synth import Zoo
from .worker import ROLE_MODELS, Op


def operations() -> dict[str, Op]:
    """Every command a worker serves, by name."""
    return {"check": op_check, **OPS}


def worker_main(role: str) -> int:
    """Serve JSON commands on stdin; events and results go out as JSON lines on stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {role}[{os.getpid()}] %(name)s %(levelname)s %(message)s")
    lock = threading.Lock()

    def emit(obj: dict) -> None:
        line = json.dumps(obj, default=str) + "\n"
        with lock:
            proto.write(line)
            proto.flush()

    zoo = Zoo(ROLE_MODELS[role])
    for n in zoo.models:  # warm up: the first prefill compiles kernels
        zoo.prefill(n, [1, 2, 3])
    import kvstore.maintenance  # noqa: F401  (import cost paid before "ready")
    ops = operations()
    emit({"ev": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("op") == "exit":
            break
        try:
            out = ops[msg["op"]](zoo, msg, emit)
        except Exception as e:
            out = {"harness_error": exc_info(msg["op"], e)}
        emit({"ev": "result", "result": out})
        if role == "crash":
            break
    return 0
