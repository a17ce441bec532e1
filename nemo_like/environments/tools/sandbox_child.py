"""Runs inside the sandbox process of the ``python`` tool (started by :mod:`.python_sandbox`; never imported).

argv: scratch dir, memory limit (bytes), CPU limit (s), file-size limit (bytes), the parent's pid. The code arrives on
stdin. Limits are set, the audit hook installed, then the code runs REPL-style: when its last statement
is an expression, that value's ``repr`` is printed (unless ``None``). Exit codes: 0 ok, 1 the code raised
(``Type: message`` on stderr), 3 memory limit, 4 output/file-size limit, 5 the parent died (nobody reads it).
"""

import ast
import errno
import os
import resource
import signal
import sys

#: Audit events refused outright (prefix match): network, new processes, signals, native code.
_BLOCKED_PREFIXES = (
    "socket.",
    "subprocess.",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "os.pidfd_open",
    "signal.pthread_kill",
    "resource.prlimit",
    "pty.",
    "ctypes.",
    # sqlite's own SQL writes files the path check never sees (ATTACH DATABASE '/x', VACUUM INTO '/x')
    "sqlite3.",
    "_winapi.",
    "webbrowser.",
    "urllib.",
    "http.",
    "ftplib.",
    "smtplib.",
    # The guard's own objects (its hook's closure cells) are reachable through the collector's lists and other
    # threads' frames; rewriting them switched the guard off.
    "gc.get_",
    "sys._current_frames",
    "sys.settrace",
    "sys.setprofile",
    # A subinterpreter starts with no audit hook: code run there had none of these guards.
    "cpython.PyInterpreterState_New",
)
#: Audit events whose path arguments must stay inside the scratch dir: ``(path argument indices, dir_fd argument
#: indices)``. A path relative to another directory's descriptor is refused (rename and link have a source's and a
#: destination's ``dir_fd``: checking only the last argument let ``src_dir_fd`` through and refused ``os.truncate``'s
#: length).
_PATH_EVENTS = {
    "os.remove": ((0,), (1,)),
    "os.rename": ((0, 1), (2, 3)),
    "os.rmdir": ((0,), (1,)),
    "os.mkdir": ((0,), (2,)),
    "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)),
    "os.link": ((0, 1), (2, 3)),
    "os.symlink": ((0, 1), (2,)),
    "os.truncate": ((0,), ()),
    "os.utime": ((0,), (3,)),
    "os.chflags": ((0,), ()),
    "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()),
    "shutil.rmtree": ((0,), ()),
    "shutil.copyfile": ((1,), ()),
    "shutil.move": ((1,), ()),
    "shutil.copytree": ((1,), ()),
    "shutil.make_archive": ((0,), ()),
    "shutil.unpack_archive": ((1,), ()),
}
#: Path events that accept an open descriptor as the path (``os.fchmod`` is ``os.chmod`` with an int): the descriptor's
#: file must be inside the scratch dir.
_FD_PATH_EVENTS = ("os.chmod", "os.chown", "os.utime", "os.truncate", "os.chflags", "os.setxattr", "os.removexattr")
_REPORT_CHARS = 1000  # the error report's share of the stderr file (set from the file-size limit in main)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


#: Modules whose functions the guard removes (calls that raise no audit event), and multiprocessing, which starts
#: processes through them: importing one of them again would give a fresh copy with the functions back (``del
#: sys.modules["_posixsubprocess"]; import _posixsubprocess``), so the ``import`` audit event, which fires only for a
#: module not already loaded, is refused for them (multiprocessing, never loaded before, cannot be imported at all).
_STRIPPED_MODULES = ("_posixsubprocess", "posix", "os", "_signal", "signal", "_ctypes", "subprocess", "multiprocessing")
#: Modules never loaded before the snippet that reach past the guard: subinterpreters (no audit hook in them), C test
#: modules (raw memory and interpreter internals), readline (writes its history file with no audit event), POSIX
#: shared memory (a file outside the scratch dir).
_REFUSED_MODULES = (
    "_xxsubinterpreters",
    "_xxinterpchannels",
    "_xxinterpqueues",
    "_interpreters",
    "_interpchannels",
    "_interpqueues",
    "_testcapi",
    "_testinternalcapi",
    "_testmultiphase",
    "_testsinglephase",
    "_testbuffer",
    "_testimportmultiple",
    "_ctypes_test",
    "readline",
    "_posixshmem",
)


def _install_guard(scratch):
    root = os.path.realpath(scratch)
    own_proc = f"/proc/{os.getpid()}"
    realpath, fspath, fsdecode, isinstance_, str_, int_ = os.path.realpath, os.fspath, os.fsdecode, isinstance, str, int
    stripped, refused = tuple(_STRIPPED_MODULES), tuple(_REFUSED_MODULES)
    # Held by the hook, not read from this module's globals, which the snippet can reach (sys.modules["__main__"]).
    blocked, path_events, write_flags = tuple(_BLOCKED_PREFIXES), dict(_PATH_EVENTS), _WRITE_FLAGS
    fd_path_events = tuple(_FD_PATH_EVENTS)
    max_written, real_os_open, os_open_event, opened = _MAX_FILES_WRITTEN, os.open, _OS_OPEN_EVENT, _Opened
    new_name_events = ("os.rename", "os.link", "os.symlink")  # (source, new name, ...)

    def resolved(path):  # fsdecode: the bytes the kernel follows (a 'replace' decode did not)
        return realpath(fsdecode(fspath(path)))

    def inside(path, event=""):
        if path is None:
            return True
        if isinstance_(path, int_):  # an open descriptor: open() of stdout/stderr; fchmod-like calls on its file
            return event not in fd_path_events or inside(realpath(f"/proc/self/fd/{path}"))
        full = resolved(path)
        return full == root or full.startswith(root + os.sep)

    def another_process(path):  # /proc/<pid>/... of a process other than the snippet's: the parent's environ, say
        if isinstance_(path, int_) or path is None:
            return False
        parts = resolved(path).split(os.sep)
        return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and os.sep.join(parts[:3]) != own_proc

    written = set()  # the files opened for writing so far (the scratch dir's quota counts files, not opens)

    def hook(event, args):
        if event == os_open_event:  # the os.open the snippet sees (:func:`_guarded_os_open`): the real one lives here
            path, flags, mode, dir_fd = args
            if dir_fd is not None and dir_fd != -1:  # its "open" event carries no dir_fd: a path relative to any directory
                raise PermissionError("sandbox: os.open with dir_fd is not allowed")
            raise opened(real_os_open(path, flags, mode))
        if event.startswith(blocked):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in stripped:
            raise PermissionError(f"sandbox: importing {args[0]} again is not allowed")
        if event == "import" and args[0] in refused:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writing = (isinstance_(mode, str_) and any(c in mode for c in "wax+")) or (isinstance_(flags, int_) and flags & write_flags)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the scratch dir is not allowed: {path!r}")
            if writing and not isinstance_(path, int_):
                written.add(resolved(path))
                if len(written) > max_written:
                    raise PermissionError(f"sandbox: more than {max_written} files written")
            if another_process(path):
                raise PermissionError(f"sandbox: reading another process's /proc entries is not allowed: {path!r}")
        elif event in path_events:
            paths, dir_fds = path_events[event]
            for index in dir_fds:
                if index < len(args) and isinstance_(args[index], int_) and args[index] != -1:  # relative to another dir
                    raise PermissionError(f"sandbox: {event} with dir_fd is not allowed")
            for index in paths:
                if index < len(args) and not inside(args[index], event):
                    raise PermissionError(f"sandbox: {event} outside the scratch dir is not allowed: {args[index]!r}")
            if event in new_name_events:  # a new name for a file (shutil.move and copies go through these or open)
                if event == "os.rename":  # the file moves: it is counted once, under its new name
                    written.discard(resolved(args[0]))
                written.add(resolved(args[1]))
                if len(written) > max_written:
                    raise PermissionError(f"sandbox: more than {max_written} files written")

    # Calls that raise no audit event: signalling through a pidfd (the parent is an environment actor), and new
    # processes through _posixsubprocess (multiprocessing's spawn), named pipes and device nodes. Imported before the
    # hook, which refuses importing these modules again.
    import _posixsubprocess
    import subprocess  # imported now, so it holds no fork_exec of its own after this

    subprocess._fork_exec = None
    for module, name in ((os, "pidfd_open"), (os, "mkfifo"), (os, "mknod"), (signal, "pidfd_send_signal"), (_posixsubprocess, "fork_exec")):
        if hasattr(module, name):
            delattr(module, name)
    # A built-in module initialised again gets its removed functions back (importlib.reload(posix) restored pidfd_open
    # and mkfifo; reloading _signal, pidfd_send_signal). Every built-in module is loaded now, and the two calls that
    # (re)initialise one are replaced by functions that hold nothing: the snippet's imports find them in sys.modules.
    import _imp

    for name in sys.builtin_module_names:
        if name not in sys.modules:
            try:
                __import__(name)
            except ImportError:
                pass
    _imp.exec_builtin = _imp.create_builtin = _refuse_builtin_init
    # os.open's audit event carries no dir_fd, so a path relative to a directory descriptor (of /proc: the environment
    # actor's environ; of any directory: a write anywhere) passed every path check. The snippet's os.open asks the hook
    # for the descriptor; the real one is held by the hook alone (also taken out of os.supports_*, where the snippet
    # could find it; left out of supports_dir_fd, shutil's rmtree takes its path-based route).
    import posix

    guarded = _guarded_os_open(sys.audit, os_open_event, opened)
    for support in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks, os.supports_effective_ids):
        support.discard(real_os_open)
    os.open = posix.open = guarded
    os.fwalk = _no_fwalk  # it opens every subdirectory with dir_fd and skips, silently, the ones it cannot open
    sys.addaudithook(hook)


_OS_OPEN_EVENT = "nemo_like.sandbox.os_open"
#: Files a snippet may open for writing (each capped by RLIMIT_FSIZE): bounds what one call can leave in the scratch dir.
_MAX_FILES_WRITTEN = 1000


class _Opened(BaseException):
    """Carries the descriptor the hook opened back to :func:`_guarded_os_open` (a hook returns nothing)."""

    def __init__(self, fd):
        super().__init__(fd)
        self.fd = fd


def _guarded_os_open(audit, event, opened):
    """An ``os.open`` that holds no reference to the real one: the hook opens (``dir_fd`` refused) and raises
    ``opened(fd)``."""

    def open(path, flags, mode=0o777, *, dir_fd=None):  # noqa: A001 - os.open's own name and signature
        try:
            audit(event, path, flags, mode, dir_fd)
        except opened as done:
            return done.fd
        raise PermissionError("sandbox: os.open is not available")  # unreachable while the hook is installed

    return open


def _no_fwalk(*args, **kwargs):
    raise PermissionError("sandbox: os.fwalk is not allowed (os.open with dir_fd is refused); use os.walk")


def _refuse_builtin_init(*args):
    raise PermissionError("sandbox: initialising a built-in module again is not allowed")


def _run(code):
    tree = ast.parse(code, "<tool>", "exec")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<tool>", "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), namespace)
        if value is not None:
            print(repr(value))


def main():
    scratch, memory, cpu, file_size, parent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    # Before the memory limit: the thread's stack (and any arena; MALLOC_ARENA_MAX=1 in the environment) would count
    # against it (a default 8 MiB stack and 64 MiB arena took ~74 MiB of a 256 MB limit)
    _exit_with_parent(parent)
    code = sys.stdin.read()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    os.chdir(scratch)
    _install_guard(scratch)
    # The stderr file counts against RLIMIT_FSIZE like any other: a snippet's own stderr (debug prints, tracebacks)
    # keeps half of it, at most 1000 characters (4 bytes each at most), and the error report the other half.
    global _REPORT_CHARS
    _REPORT_CHARS = min(1000, (file_size - 1) // 8)
    sys.stderr = _CappedText(sys.stderr, _REPORT_CHARS)
    import builtins

    builtins.exit = builtins.quit = sys.exit  # `python -S` skips site, which defines them: a snippet's exit() was a NameError
    try:
        _run(code)
        sys.stdout.flush()
    except SystemExit as exc:  # sys.exit() / sys.exit(0) (and exit(), quit()) end a snippet normally
        if exc.code not in (None, 0):
            _report(exc)
        sys.stdout.flush()
    except MemoryError:
        os._exit(3)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            os._exit(4)
        _report(exc)
    except BaseException as exc:  # the user's code raised (SystemExit included): report it
        _report(exc)


def _exit_with_parent(parent):
    """End this process when its parent (the environment actor, pid ``parent``, passed by it: one that died while this
    process started would otherwise be missed) is gone: the wall-clock limit is the parent's to enforce, so a sleeping
    or blocked snippet (RLIMIT_CPU never fires for it) outlived a killed actor for ever. A thread the snippet cannot
    reach (``_thread``, not ``threading``'s list) polls the parent's pid."""
    import _thread
    import time

    getppid, sleep, exit_ = os.getppid, time.sleep, os._exit
    if getppid() != parent:
        exit_(5)

    def watch():
        while getppid() == parent:
            sleep(0.5)
        exit_(5)

    _thread.stack_size(1 << 18)  # 256 KiB: the loop needs little
    _thread.start_new_thread(watch, ())
    _thread.stack_size(0)  # the snippet's own threads get the default stack (recursion in one had crashed the process)


class _CappedText:
    """A text stream that keeps the first ``limit`` characters written to it and drops the rest."""

    def __init__(self, stream, limit):
        self.stream, self.left = stream, limit

    def write(self, text):
        kept = text[: max(self.left, 0)]
        self.left -= len(kept)
        if kept:
            self.stream.write(kept)
        return len(text)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _report(exc):
    try:
        stream = sys.__stderr__
        # the last line, one line whatever the message (the parent reports its last line: a message's own lines, or a
        # "\r" or any other separator str.splitlines splits on, lost its type)
        report = " | ".join(f"{type(exc).__name__}: {exc}".splitlines())
        stream.write("\n" + report[: _REPORT_CHARS - 1])
        stream.flush()
    finally:
        os._exit(1)


if __name__ == "__main__":
    main()
