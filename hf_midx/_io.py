"""Atomic file writes: a reader (or a crash) never sees a half-written file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable


def _read_umask() -> int:
    umask = os.umask(0)  # the only way to read it sets it process-wide for a moment: done once, at import
    os.umask(umask)
    return umask


_UMASK = _read_umask()


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> str:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it onto ``path``.

    The temporary file is removed if ``write`` raises; the rename is atomic on POSIX and Windows.
    Creates the parent directory. Returns ``path`` as a string.
    """
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # on disk before the rename shows it: a power loss leaves the old file or the new
            os.fsync(f.fileno())
        # mkstemp makes the file 0600; give it the permissions a plain open() would (0666 less umask).
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
