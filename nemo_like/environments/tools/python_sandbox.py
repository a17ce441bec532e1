"""The built-in ``python`` tool: run a snippet in a separate, limited Python process.

Each call starts a fresh interpreter (``python -I -S -B``: no user site, no ``PYTHONPATH``, no
bytecode writes) in a fresh scratch directory (its working directory, deleted afterwards), with:

* a wall-clock limit (the process group is killed past it) and a CPU-time limit (``RLIMIT_CPU``);
* a memory limit (``RLIMIT_AS``: address space, so allocations fail with ``MemoryError``);
* an output cap: stdout beyond ``max_output_bytes`` is an error (``RLIMIT_FSIZE`` also caps every file the
  snippet writes);
* no network, no subprocesses, no signals, no ``ctypes`` and no writes outside the scratch dir, enforced by a
  :pep:`578` audit hook installed before the snippet runs (see ``sandbox_child.py``).

The result is the snippet's stdout, plus the ``repr`` of its last expression (REPL-style). Every failure
is a :class:`~nemo_like.environments.tools.errors.ToolError` with a ``kind`` for the counters. This is a
guard against accidents of a model's code, not a security boundary against a hostile one: see
``docs/guides/tools.md`` for what it does not protect against.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from nemo_like.environments.tools.errors import ToolError
from nemo_like.utils.orphans import process_tag, remove_orphan_temp_dirs

_CHILD = Path(__file__).with_name("sandbox_child.py")
_MAX_CODE_CHARS = 20_000


#: The smallest file-size limit of a snippet's process: a python_max_output_bytes of 16 left the error report 1 character
#: ("[exception] V" for a ValueError).
MIN_FILE_SIZE = 8192


#: A snippet's work directory in the temporary directory: ``<prefix><process tag>_...`` (swept once its process is gone).
WORK_PREFIX = "nemo_like_tool_"


def remove_tree(path: Path) -> None:
    """Delete ``path`` and everything under it, also what a snippet made unwritable or unreadable in its scratch
    directory (``os.chmod(".", 0o500)``): each directory gets its owner's permissions back before it is read, so no
    run leaves a directory behind in the temporary directory (``shutil.rmtree`` alone gave up on it)."""
    try:
        os.chmod(path, 0o700)
    except OSError:
        return  # gone already
    for root, dirs, _files in os.walk(path):
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass  # a link to a directory is removed as a link
    shutil.rmtree(path, ignore_errors=True)


class PythonSandbox:
    """Runs code snippets under the limits above. Construct once; each :meth:`run` is independent."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 256, max_output_bytes: int = 4096) -> None:
        self.timeout_s, self.memory_mb, self.max_output_bytes = timeout_s, memory_mb, max_output_bytes
        # A killed environment actor's call left its work directory (its finally never ran)
        remove_orphan_temp_dirs(WORK_PREFIX, remove_tree)

    def run(self, code: str) -> str:
        """The snippet's output (stdout, then its last expression's repr).

        Raises:
            ToolError: kinds ``timeout``, ``memory``, ``output_limit``, ``exception`` (the snippet raised),
                ``bad_arguments`` (not a string, or too long) and ``crash`` (killed by a signal; a process killed
                by SIGKILL from outside is run once more first)."""
        if not isinstance(code, str):
            raise ToolError("bad_arguments", f"'code' must be a string, got {type(code).__name__}")
        if len(code) > _MAX_CODE_CHARS:
            raise ToolError("bad_arguments", f"code longer than {_MAX_CODE_CHARS} characters")
        work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{process_tag()}_"))
        try:
            scratch = work / "scratch"
            scratch.mkdir()
            with open(work / "stdout", "w+b") as out, open(work / "stderr", "w+b") as err:
                returncode = self._spawn(code, scratch, out, err)
                if returncode == -signal.SIGKILL:  # killed from outside (not our time limit, which kills the group
                    # itself: "timeout"): the snippet never finished, so run it once more in a fresh process, as a dead
                    # environment actor's calls are re-sent (the same code gives the same answer: the run is unchanged)
                    for f in (out, err):
                        f.seek(0)
                        f.truncate()
                    remove_tree(scratch)
                    scratch.mkdir()
                    returncode = self._spawn(code, scratch, out, err)
                out.seek(0)
                stdout = out.read(self.max_output_bytes + 1)
                err.seek(0)
                stderr = err.read().decode(errors="replace").strip()  # at most ~4 KB: the child caps it
        finally:
            remove_tree(work)
        if returncode == "timeout" or returncode == -signal.SIGXCPU:
            raise ToolError("timeout", f"time limit of {self.timeout_s:g} s exceeded")
        last_line = stderr.splitlines()[-1] if stderr else ""  # stripped: a non-empty one ends in a non-empty line
        if returncode == 3 or (returncode == 1 and last_line.startswith("MemoryError")):
            raise ToolError("memory", f"memory limit of {self.memory_mb} MB exceeded")
        if returncode == 4 or len(stdout) > self.max_output_bytes:
            raise ToolError("output_limit", f"output larger than {self.max_output_bytes} bytes")
        if returncode == 1:
            raise ToolError("exception", last_line or "the code raised")
        if returncode != 0:
            raise ToolError("crash", f"the process ended with status {returncode}")
        return stdout.decode(errors="replace").rstrip("\n")

    def _spawn(self, code: str, scratch: Path, out, err) -> int | str:
        memory = self.memory_mb * 1024 * 1024
        cpu = max(1, math.ceil(self.timeout_s))
        # Every file the snippet writes is capped (RLIMIT_FSIZE), stdout's and stderr's too; the cap leaves room for the
        # error report (the stdout limit itself is checked here, on what came back).
        file_size = max(self.max_output_bytes + 1, MIN_FILE_SIZE)
        cmd = [sys.executable, "-I", "-S", "-B", str(_CHILD), str(scratch), str(memory), str(cpu), str(file_size), str(os.getpid())]
        env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8", "HOME": str(scratch), "TMPDIR": str(scratch)}
        env["MALLOC_ARENA_MAX"] = "1"  # the child's watchdog thread gets no 64 MiB arena of its own (RLIMIT_AS counts it)
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=scratch, env=env, start_new_session=True)
        try:
            proc.communicate(code.encode(), timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return "timeout"
        finally:
            _kill_group(proc)  # always: a process the snippet left behind must not outlive the call
        return proc.returncode


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
