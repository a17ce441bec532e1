"""Files replaced whole: written beside their place (a temporary file of their own), flushed to disk, then renamed
into it, so a reader never finds half of one, nor does a crash of the process or of the machine."""

from __future__ import annotations

import errno
import os
import re
import stat
import uuid
from pathlib import Path

#: The name of :func:`replace_file`'s temporary file: ``.<name>.<pid>.<8 hex>.tmp`` beside the target.
_PARTIAL = re.compile(r"^\..+\.(\d+)\.[0-9a-f]{8}\.tmp$")


def partial_path(path: Path) -> Path:
    """Where :func:`replace_file` writes ``path``'s new contents before the rename."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def partial_owner(name: str, of: str) -> int | None:
    """The pid of the process that made ``name`` as :func:`partial_path` of a path named ``of`` (None: it is not one)."""
    match = _PARTIAL.match(name)
    return int(match.group(1)) if match and name.startswith(f".{of}.") else None


def process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this machine (another user's live process runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


#: A dead process's partial directory is only removed once nothing in it changed for this long: the pid may be another
#: machine's (a shared filesystem), whose writer is alive and still filling it.
PARTIAL_QUIET_S = 600.0


def remove_dead_partial_dirs(path: Path) -> list[Path]:
    """Remove the temporary directories of :func:`partial_path` (``path``'s siblings) that a process now gone left
    (killed between writing and renaming: a SIGKILL or an out-of-memory kill skips the cleanup), once nothing in one
    changed for :data:`PARTIAL_QUIET_S`; returns what was removed. One that cannot be removed is left alone."""
    import shutil
    import time

    removed = []
    for entry in path.parent.iterdir() if path.parent.is_dir() else []:
        pid = partial_owner(entry.name, path.name)
        if pid is None or not entry.is_dir() or entry.is_symlink() or not process_gone(pid):
            continue
        try:
            if entry.lstat().st_uid != os.getuid():
                continue
            newest = max([entry.stat().st_mtime, *(p.stat().st_mtime for p in entry.rglob("*"))])
        except OSError:  # gone meanwhile
            continue
        if time.time() - newest > PARTIAL_QUIET_S:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def remove_partial_files(directory: str | Path, pid: int) -> int:
    """Remove the temporary files of :func:`replace_file` that process ``pid`` left in ``directory`` (killed between a
    write and its rename: a SIGKILL skips the cleanup); returns how many. Only for a process known to be gone: a run
    whose lock was taken over (:class:`~nemo_like.utils.run_lock.RunLock`); another live writer's files (an eval writing
    its results there) carry their own pid."""
    removed = 0
    for entry in os.scandir(directory):
        match = _PARTIAL.match(entry.name)
        if match and int(match.group(1)) == pid and entry.is_file(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    return removed


def _keep_permissions(fd: int, path: Path) -> None:
    """Give the open file ``fd`` the permissions and group of ``path``, if it exists."""
    try:
        existing = os.stat(path)
    except FileNotFoundError:
        return
    os.fchmod(fd, stat.S_IMODE(existing.st_mode))
    try:
        os.fchown(fd, -1, existing.st_gid)
    except PermissionError:  # a group this user is not in: the default group, as a new file's
        pass


def replace_file(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path``, replacing what was there in one rename; returns the path. The data is
    on disk before the rename and the rename before the return (an OS crash could otherwise leave the new name over
    an empty file: the rename may reach the disk before the data), and two writers of one path never rename each
    other's partial file (each writes its own temporary file). A symlink's target is replaced (the link stays), and an
    existing file keeps its permissions and group, as a plain write keeps them; a new one gets the umask's."""
    target = Path(os.path.realpath(path))  # beside the link's target: the rename stays on its filesystem
    payload = data if isinstance(data, bytes) else data.encode("utf-8")
    partial = partial_path(target)
    try:  # the open too: a stop handled as it returns left the new empty file behind
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as out:
            _keep_permissions(out.fileno(), target)
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return Path(path)


#: What a filesystem answers when it cannot fsync a directory (WSL1's drvfs, some CIFS / network mounts): it has no such
#: flush to offer, so there is nothing more to wait for (SQLite and git ignore them the same way).
_NO_DIRECTORY_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES, errno.EISDIR}


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk, where its filesystem can."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno in _NO_DIRECTORY_FSYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _NO_DIRECTORY_FSYNC:
            raise
    finally:
        os.close(fd)
