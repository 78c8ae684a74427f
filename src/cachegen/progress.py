"""Progress display for long steps (model conversion, prefill, ingest)."""

from __future__ import annotations

import sys
import threading
import time

from tqdm import tqdm


def bar(total: int, desc: str, enabled: bool = True, unit: str = "tok") -> tqdm:
    """A tqdm bar on stderr; silent when disabled or when stderr is not a terminal and CI is set."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, leave=False, dynamic_ncols=True)


class Spinner:
    """An elapsed-time line for a step whose length is unknown (e.g. a GGUF conversion)."""

    def __init__(self, desc: str, enabled: bool = True):
        self.desc, self.enabled = desc, enabled
        self._stop = threading.Event()
        self._t0 = 0.0

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            sys.stderr.write(f"\r{self.desc}: {time.perf_counter() - self._t0:5.1f}s")
            sys.stderr.flush()

    def __enter__(self) -> "Spinner":
        self._t0 = time.perf_counter()
        if self.enabled:
            self._th = threading.Thread(target=self._run, daemon=True)
            self._th.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.enabled:
            self._th.join()
            sys.stderr.write(f"\r{self.desc}: done in {time.perf_counter() - self._t0:.1f}s\n")
            sys.stderr.flush()
