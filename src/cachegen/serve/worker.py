"""The single model worker: one forward pass at a time, a bounded queue in front of it.

On a CPU (and on one GPU with batch-1 decoding) concurrent forward passes only
slow each other down, so every model job runs on one thread, in arrival
order. Requests beyond ``max_queue`` waiting ones are refused at once (the
server answers 429 with ``Retry-After``) instead of piling up. A job whose
client went away is skipped if it has not started, and stops at its next
decoding step if it has (``Job.cancel``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The worker's queue holds ``max_queue`` jobs already."""


@dataclass
class Job:
    run: Callable[[Job], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class ModelWorker:
    def __init__(self, max_queue: int = 16):
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self._q: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._thread = threading.Thread(target=self._loop, name="cachegen-model", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._waiting + self._running > self.max_queue:  # one runs, max_queue wait
                raise QueueFull(f"{self._waiting} requests are waiting for the model")
            self._waiting += 1
        self._q.put(job)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                self._running = 1
            try:
                if not job.cancelled.is_set():
                    job.run(job)
            except BaseException:  # a job reports its own errors; this keeps the worker alive
                log.exception("model job failed")
            finally:
                with self._lock:
                    self._running = 0
