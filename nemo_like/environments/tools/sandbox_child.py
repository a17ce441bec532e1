"""Runs inside the sandbox process of the ``python`` tool (started by :mod:`.python_sandbox`; never imported).

argv: scratch dir, memory limit (bytes), CPU limit (s), file-size limit (bytes). The code arrives on
stdin. Limits are set, the audit hook installed, then the code runs REPL-style: when its last statement
is an expression, that value's ``repr`` is printed (unless ``None``). Exit codes: 0 ok, 1 the code raised
(``Type: message`` on stderr), 3 memory limit, 4 output/file-size limit.
"""

import ast
import errno
import os
import resource
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
    "pty.",
    "ctypes.",
    "_winapi.",
    "webbrowser.",
    "urllib.",
    "http.",
    "ftplib.",
    "smtplib.",
)
#: Audit events whose path arguments must stay inside the scratch dir (index of each path argument).
_PATH_EVENTS = {
    "os.remove": (0,),
    "os.rename": (0, 1),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.link": (0, 1),
    "os.symlink": (0, 1),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.chflags": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (1,),
    "shutil.move": (1,),
    "shutil.copytree": (1,),
    "shutil.make_archive": (0,),
    "shutil.unpack_archive": (1,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _install_guard(scratch):
    root = os.path.realpath(scratch)
    realpath, fspath, isinstance_, str_, bytes_, int_ = os.path.realpath, os.fspath, isinstance, str, bytes, int

    def inside(path):
        if isinstance_(path, int_) or path is None:
            return True  # an already open descriptor (stdout, stderr)
        path = fspath(path)
        if isinstance_(path, bytes_):
            path = path.decode(errors="replace")
        full = realpath(path)
        return full == root or full.startswith(root + os.sep)

    def hook(event, args):
        if event.startswith(_BLOCKED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writing = (isinstance_(mode, str_) and any(c in mode for c in "wax+")) or (isinstance_(flags, int_) and flags & _WRITE_FLAGS)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the scratch dir is not allowed: {path!r}")
        elif event in _PATH_EVENTS:
            for index in _PATH_EVENTS[event]:
                if index < len(args) and not inside(args[index]):
                    raise PermissionError(f"sandbox: {event} outside the scratch dir is not allowed: {args[index]!r}")

    sys.addaudithook(hook)


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
    scratch, memory, cpu, file_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    code = sys.stdin.read()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    os.chdir(scratch)
    _install_guard(scratch)
    try:
        _run(code)
        sys.stdout.flush()
    except MemoryError:
        os._exit(3)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            os._exit(4)
        _report(exc)
    except BaseException as exc:  # the user's code raised (SystemExit included): report it
        _report(exc)


def _report(exc):
    try:
        sys.stderr.write(f"{type(exc).__name__}: {exc}"[:2000])
        sys.stderr.flush()
    finally:
        os._exit(1)


if __name__ == "__main__":
    main()
