"""Progress display for long steps (model conversion, prefill, ingest).

Bars and spinners draw only when stderr is a terminal: redirected output
(a log file, a pipe, CI) gets no carriage returns. ``-q`` turns them off too.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_enabled = True  # set by the CLI's -q


def set_enabled(on: bool) -> None:
    """Allow (True) or suppress (False) every progress display of this process."""
    global _enabled
    _enabled = on


def interactive() -> bool:
    """Whether progress may be drawn: allowed, and stderr is a terminal."""
    try:
        return _enabled and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


def quiet_transformers() -> None:
    """Silence transformers' own bars ("Loading weights") and its info/warning chatter."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.disable_progress_bar()
    if not logging.getLogger("cachegen").isEnabledFor(logging.DEBUG):
        hf_logging.set_verbosity_error()


def bar(total: int, desc: str, enabled: bool = True, unit: str = "tok") -> Any:
    """A tqdm bar on stderr, drawn only when ``enabled`` and stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not (enabled and interactive()),
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
    )


class Spinner:
    """An elapsed-time line for a step whose length is unknown (e.g. a GGUF conversion).

    Off a terminal it logs one line when the step starts and one when it ends.
    """

    def __init__(self, desc: str, enabled: bool = True):
        self.desc = desc
        self.enabled = enabled and interactive()
        self._logged = enabled and not self.enabled
        self._stop = threading.Event()
        self._t0 = 0.0

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            sys.stderr.write(f"\r{self.desc}: {time.perf_counter() - self._t0:5.1f}s")
            sys.stderr.flush()

    def __enter__(self) -> Spinner:
        self._t0 = time.perf_counter()
        if self.enabled:
            self._th = threading.Thread(target=self._run, daemon=True)
            self._th.start()
        elif self._logged:
            log.info("%s ...", self.desc)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        dt = time.perf_counter() - self._t0
        if self.enabled:
            self._th.join()
            sys.stderr.write(f"\r{self.desc}: done in {dt:.1f}s\n")
            sys.stderr.flush()
        elif self._logged:
            log.info("%s: done in %.1fs", self.desc, dt)
