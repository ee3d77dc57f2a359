"""The daemon's own paths, checked at start: the tier directory and the Unix socket.

The tier directory's *parents* are the operator's (``/var/run`` is a link to ``/run`` on most
distributions), so links among them are resolved once, here, and the daemon works on the real
path from then on. The tier directory itself is shared with the trainers' group, and the daemon
never follows a link there (docs/design.md "Trust boundary"): a tier directory that *is* a link is
refused, naming its target. A relative path is made absolute against the daemon's working
directory, because trainers in other directories are handed paths inside it.

Each check raises ``ValueError`` with a message that names the path and what to do, which
``__main__`` prints as one line naming the setting (exit 2).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# sockaddr_un.sun_path is 108 bytes on Linux, the last one the terminating NUL.
MAX_SOCKET_PATH = 107


def resolved_parents(path: Path) -> Path:
    """``path`` made absolute, with every link among its parents resolved (not the last part)."""
    path = Path(os.path.abspath(path))
    if path.parent == path:
        return path
    return path.parent.resolve() / path.name


def tier_dir(setting: str, path: Path) -> Path:
    """The tier directory ``path`` as the daemon will use it; ``ValueError`` when it is a link,
    not a directory, or cannot be created where it is missing."""
    path = resolved_parents(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise ValueError(
                f"{path} is a symbolic link (to {os.readlink(path)}); the daemon does not follow "
                f"links in its tier: set {setting} to the directory itself"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{path} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{path} is not writable by this daemon (uid {os.getuid()})")
        return path
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"cannot create {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(
            f"cannot create {path}: {ancestor} is not writable by this daemon (uid {os.getuid()})"
        )
    return path


def check_socket_length(path: Path, what_to_do: str) -> None:
    """``ValueError`` when ``path`` is too long to bind a Unix socket to."""
    n = len(os.fsencode(str(path)))
    if n > MAX_SOCKET_PATH:
        raise ValueError(
            f"the socket path {path} is {n} bytes, and a Unix socket's path holds at most "
            f"{MAX_SOCKET_PATH}: {what_to_do}"
        )


def filesystem_of(path: Path) -> tuple[str, str]:
    """The (mount point, file system type) that holds ``path``, from ``/proc/self/mounts``;
    ``("", "")`` when that cannot be read."""
    real = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        # Mount points escape spaces and the like as octal (\040).
        mount = parts[1].encode().decode("unicode_escape")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
            best = (mount, parts[2])
    return best
