"""The background writer: encodes and stores new chunks off the request path.

A request must never wait for the codec or the store to answer it, so the
KV it computed is handed to one writer thread through a bounded queue. When
the queue is full the job is dropped (and counted): storing is an
optimisation, and a backlog would only hold memory for contexts that may
never come back. A store fault is logged (redacted) and counted, never raised.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field

from cachegen.errors import CachegenError
from cachegen.kv import KVCache
from cachegen.store.url import redact

log = logging.getLogger(__name__)


@dataclass
class WriterStats:
    submitted: int = 0  # jobs accepted
    dropped: int = 0  # jobs refused because the queue was full
    dropped_chunks: int = 0
    written_chunks: int = 0
    failed: int = 0  # jobs that raised (store outage, bad KV)
    errors: list[str] = field(default_factory=list)  # the last few, redacted


@dataclass
class _Job:
    tokens: list[int]
    kv: KVCache  # tokens [kv.start, len(tokens)), kv.start on a chunk boundary


class BackgroundWriter:
    """One thread that runs ``store.put_context`` for queued jobs, ``max_pending`` at most."""

    def __init__(self, store, max_pending: int = 8):
        self.store = store
        self.max_pending = max_pending
        self.stats = WriterStats()
        self._q: queue.Queue[_Job | None] = queue.Queue()  # bounded by max_pending in submit()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def depth(self) -> int:
        """Jobs queued or being written."""
        with self._lock:
            return self._busy

    def submit(self, tokens: list[int], kv: KVCache) -> bool:
        """Queue a write; ``False`` (and a drop counted) if the queue is full or the writer closed."""
        chunks = -(-(len(tokens) - kv.start) // max(self.store.chunk_tokens, 1))
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cachegen-writer", daemon=True)
                self._thread.start()
            if self._busy >= self.max_pending:
                self.stats.dropped += 1
                self.stats.dropped_chunks += chunks
                log.info("background writer full (%d jobs): dropped %d chunks", self.max_pending, chunks)
                return False
            self._q.put_nowait(_Job(list(tokens), kv))
            self._busy += 1
            self.stats.submitted += 1
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is written (for tests, benches and shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued jobs (up to ``timeout`` s) and stop the thread."""
        with self._lock:
            self._closed = True
            th = self._thread
        if th is not None:
            self.flush(timeout)
            self._q.put(None)
            th.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                written = self.store.put_context(job.tokens, job.kv)
                with self._lock:
                    self.stats.written_chunks += len(written)
            except (CachegenError, OSError, ValueError, RuntimeError) as e:
                msg = redact(f"{type(e).__name__}: {e}")
                log.warning("background store write failed: %s", msg)
                with self._lock:
                    self.stats.failed += 1
                    self.stats.errors = ([*self.stats.errors, msg])[-5:]
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()
