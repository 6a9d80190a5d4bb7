"""Reading an adapter's files as the server's path policy checked them.

The server resolves every file a load reads (realpath) and checks that it lies inside an allowed
folder (server/adapters.py); the engine core, another process, reads them. A check in one process and
a read in another leave a window: a folder on the way swapped for a symlink, or a file replaced and
put back, between the two. So the check that counts is made here, on the descriptor the bytes are
read from: the file is opened by the resolved path the server checked (O_NOFOLLOW: a link put at that
path is not followed), and what the descriptor is (its device and inode, and where the kernel says it
lies) must be what the server checked; only then is it read, from that descriptor. Whatever is
swapped before or after, the bytes read are the checked file's.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from ruvllm.errors import AdapterPathError

# What the server's check found for each path a load reads, keyed by the path as the loader forms it
# (the resolved folder joined with the file's name): (real path, device, inode; -1, -1 where no file was).
Identity = tuple[str, int, int]
CheckedFiles = Mapping[str, Identity]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def read_file(path: Path, checked: CheckedFiles | None = None) -> bytes:
    """A file's bytes. Without `checked` (adapters named at start-up, learned ones: no policy applies),
    read through the path it resolves to now. With it, only a file the server checked, read from a
    descriptor that is that file (AdapterPathError naming the file otherwise)."""
    if checked is None:
        with open(os.open(os.path.realpath(path), os.O_RDONLY | _NOFOLLOW | _CLOEXEC), "rb") as f:
            return f.read()
    want = checked.get(str(path))
    if want is None:
        raise AdapterPathError(f"{path}: not among the files the path policy checked for this load; not read")
    real, dev, ino = want
    if ino == -1:
        raise AdapterPathError(f"{path}: no such file when the path policy checked it, and one since; not read")
    try:
        fd = os.open(real, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a link at the last component
            raise AdapterPathError(f"{path}: replaced by a symbolic link after the path policy checked it; "
                                   "not read") from None
        raise
    with open(fd, "rb") as f:
        _same_file(f.fileno(), path, want)
        return f.read()


def _same_file(fd: int, path: Path, want: Identity) -> None:
    """The open descriptor is the file the server checked: the same device and inode, a regular file,
    and (where the system can say) at the same resolved path, so no folder on the way was swapped
    for a link (which the device and inode alone would catch too, but the path names it plainly)."""
    real, dev, ino = want
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise AdapterPathError(f"{path}: not a regular file; not read")
    where = descriptor_path(fd)
    if where is not None and where != real and where.endswith(" (deleted)"):  # unlinked since it was opened
        where = where[:-len(" (deleted)")]
    if where is not None and where != real:
        raise AdapterPathError(f"{path}: opened at {where}, and the path policy checked {real} (a folder on the "
                               "way was swapped since); not read")
    if (st.st_dev, st.st_ino) != (dev, ino):
        raise AdapterPathError(f"{path}: another file than the one the path policy checked (replaced since); "
                               "not read")


def descriptor_path(fd: int) -> str | None:
    """Where the kernel says an open file lies: Linux's /proc/self/fd link, macOS's F_GETPATH; None
    where neither is there (the device and inode check stands alone then)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
    try:
        import fcntl

        getpath = getattr(fcntl, "F_GETPATH", None)
        if getpath is not None:
            return fcntl.fcntl(fd, getpath, b"\0" * 1024).rstrip(b"\0").decode()
    except (OSError, ImportError, UnicodeDecodeError):
        pass
    return None
