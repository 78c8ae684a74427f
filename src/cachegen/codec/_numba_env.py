"""Point numba's JIT cache at a writable directory before numba compiles.

``@njit(cache=True)`` writes next to the source by default, which fails in
read-only installs; we use ``$CACHEGEN_HOME/numba`` unless the user set
``NUMBA_CACHE_DIR``. Import this module before importing numba.
"""

from __future__ import annotations

import os


def ensure_cache_dir() -> None:
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    try:
        from cachegen.paths import subdir

        d = str(subdir("numba"))
    except OSError:  # unwritable home: numba falls back to its own default
        return
    os.environ["NUMBA_CACHE_DIR"] = d
    import sys

    if "numba" in sys.modules:  # imported earlier by someone else: numba reads its config at import
        from numba.core import config

        config.CACHE_DIR = d  # type: ignore[attr-defined]  # numba config attributes are set at runtime


ensure_cache_dir()
