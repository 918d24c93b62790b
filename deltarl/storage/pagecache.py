"""Streaming big objects through the page cache instead of filling it.

Keyframe parts are written once and read once per reader (a replay, a relay filling its cache,
an actor), which then holds them itself. Left in the page cache, GBs of them make the kernel find
fresh pages for every write and read (on a VM whose host reclaims free guest memory that costs
more than the disk) and push out what other processes use. Writers flush and drop each window
behind them (no extra I/O: the final fsync writes every byte anyway); readers drop what they read.
Small objects (manifests, headers, segments a relay serves again) stay cached.
"""

from __future__ import annotations

import os

#: A streamed write is flushed and dropped in windows this large.
FLUSH_WINDOW_BYTES = 32 << 20
#: Reads at least this large drop what they read.
DROP_READ_BYTES = 1 << 20


def drop(fd: int, offset: int, length: int) -> None:
    """Let ``[offset, offset + length)`` of a file go from the page cache (clean pages only)."""
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def flush_and_drop(fd: int, start: int, end: int) -> None:
    """Write the file's dirty pages to disk, then let ``[start, end)`` go from the page cache."""
    os.fdatasync(fd)
    drop(fd, start, end - start)


def drop_read(fd: int, offset: int, length: int) -> None:
    """After a read of ``length`` bytes at ``offset``: drop them if the read was a big one."""
    if length >= DROP_READ_BYTES:
        drop(fd, offset, length)


class WriteBehind:
    """Flush a file being streamed out window by window, and drop each flushed window: the cached
    footprint stays about one window, whose pages the kernel reuses for the next."""

    def __init__(self, fd: int, window: int | None = None) -> None:
        self.fd = fd
        self.window = window or FLUSH_WINDOW_BYTES
        self.flushed = 0
        self.written = 0

    def wrote(self, n: int) -> None:
        """``n`` more bytes were written (in order)."""
        self.written += n
        if self.written - self.flushed >= self.window:
            flush_and_drop(self.fd, self.flushed, self.written)
            self.flushed = self.written


__all__ = ["DROP_READ_BYTES", "FLUSH_WINDOW_BYTES", "WriteBehind", "drop", "drop_read", "flush_and_drop"]
