"""Give freed memory back to the OS after dropping a state, so a long-running process's RSS returns.

glibc keeps freed heap memory in its arenas; ``malloc_trim(0)`` releases what it can. A no-op
where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)
_libc: ctypes.CDLL | None = None
_tried = False


def trim() -> bool:
    """Call glibc's ``malloc_trim(0)``; return whether any memory was released (False elsewhere)."""
    global _libc, _tried
    if not _tried:
        _tried = True
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                if hasattr(lib, "malloc_trim"):
                    _libc = lib
            except OSError as err:
                logger.debug("no malloc_trim: %s", err)
    if _libc is None:
        return False
    return bool(_libc.malloc_trim(0))


__all__ = ["trim"]
