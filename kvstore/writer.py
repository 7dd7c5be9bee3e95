"""The write-behind thread: one owner for disk writes, fed by a bounded queue.

``submit`` never blocks: when the queue is full the job is dropped and counted, so
generation is never held up by the disk. ``flush`` waits until everything queued so far
is on disk (or failed); ``close`` flushes and stops the thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from .hoststate import releasing
from .escape import logger

log = logger("kvstore")

Job = Callable[[], None]


class Writer:
    def __init__(self, maxsize: int = 16, name: str = "kvstore-writer") -> None:
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=maxsize)
        self._thread = threading.Thread(target=releasing(self._serve), name=name, daemon=True)  # its jobs run MLX work
        self._closed = False
        self.dropped = 0
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting in the queue (not counting the one running)."""
        return self._q.qsize()

    @property
    def pending(self) -> int:
        """Jobs queued or running: 0 means everything submitted so far has finished."""
        return self._q.unfinished_tasks

    def on_thread(self) -> bool:
        """True when called from the writer thread itself (a job that queues more work)."""
        return threading.current_thread() is self._thread

    def submit(self, job: Job) -> bool:
        """Queue a job; False (and counted as dropped) if the queue is full or closed."""
        if self._closed:
            self.dropped += 1
            return False
        try:
            self._q.put_nowait(job)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every job queued before this call has run. True if it finished."""
        if not self._thread.is_alive():
            return self._q.unfinished_tasks == 0
        done = threading.Event()
        try:
            self._q.put(done.set, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # a failed write costs that entry, never the thread
                log.exception("kvstore: background write failed")
            finally:
                self._q.task_done()
