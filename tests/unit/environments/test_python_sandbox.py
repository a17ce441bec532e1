"""The python tool's sandbox for real (a separate process per call): each limit and refusal becomes an
error observation through ToolEnvironment, and the next call still works."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nemo_like.environments.tools.environment import ToolEnvironment
from nemo_like.environments.tools.parsing import format_tool_call
from nemo_like.environments.tools.python_sandbox import PythonSandbox
from nemo_like.environments.tools.registry import ToolError


@pytest.fixture(scope="module")
def env() -> ToolEnvironment:
    # A generous wall limit: calls that should succeed must not time out on a loaded machine.
    return ToolEnvironment(tools=["python"], python_timeout_s=30, python_memory_mb=128, python_max_output_bytes=1000)


def run(env: ToolEnvironment, code: str) -> str:
    log = [{"role": "user", "content": "q"}, {"role": "assistant", "content": format_tool_call("python", {"code": code})}]
    (step,) = env.step([log], [{"answer": 0}])
    assert not step.terminated and step.reward == 0.0 and step.observation["role"] == "tool"
    return step.observation["content"]


def test_runs_code_repl_style_in_a_fresh_scratch_dir(env: ToolEnvironment) -> None:
    assert run(env, "x = 6\nprint('hi')\nx * 7") == "hi\n42"
    assert run(env, "open('notes.txt', 'w').write('abc')\nopen('notes.txt').read()") == "'abc'"
    assert run(env, "import os\nos.path.exists('notes.txt')") == "False"  # a new scratch dir per call
    assert run(env, "import math; math.factorial(20)") == "2432902008176640000"


@pytest.mark.parametrize(
    ("code", "observation"),
    [
        ("blob = bytearray(512 * 1024 * 1024)", "error: python: memory limit of 128 MB exceeded"),
        ("def f():\n    raise ValueError('bad input')\nf()", "error: python: ValueError: bad input"),
        # a message of several lines: the type and its first line were lost, or a last line 'MemoryError' read as memory
        ("raise ValueError('bad row\\nexpected 4 columns')", "error: python: ValueError: bad row | expected 4 columns"),
        ("raise RuntimeError('retry\\nMemoryError in the child')", "error: python: RuntimeError: retry | MemoryError in the child"),
        ("print('x' * 5000)", "error: python: output larger than 1000 bytes"),
        ("import socket\nsocket.socket()", "error: python: PermissionError: sandbox: socket.__new__ is not allowed"),
        ("import urllib.request\nurllib.request.urlopen('http://example.com')", "is not allowed"),
        ("import subprocess\nsubprocess.run(['true'])", "error: python: PermissionError: sandbox: subprocess.Popen is not allowed"),
        ("import os\nos.system('true')", "sandbox: os.system is not allowed"),
        ("import ctypes", "is not allowed"),
        ("1 +", "error: python: SyntaxError"),
    ],
)
def test_limits_and_refusals_are_error_observations(env: ToolEnvironment, code: str, observation: str) -> None:
    assert observation in run(env, code)


def test_no_writes_outside_the_scratch_dir(env: ToolEnvironment, tmp_path) -> None:
    target = tmp_path / "outside.txt"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"open('../../{target.name}', 'a')",
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        f"import os\nos.mkdir({str(tmp_path / 'd')!r})",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
        "import os\nos.symlink('/etc/passwd', 'link')\nopen('link', 'w')",
    ):
        observation = run(env, code)
        assert "sandbox:" in observation and "not allowed" in observation, code
    assert not target.exists() and not (tmp_path / "d").exists() and tmp_path.exists()
    assert run(env, "'root:' in open('/etc/passwd').read()") == "True"  # reading is allowed (documented)
    counts = env.metrics()
    assert counts["tool_errors"] > 0 and counts["tool_timeouts"] >= 0


def test_the_holes_a_review_found_are_closed(env: ToolEnvironment, tmp_path) -> None:
    """Each of these reached past the guard: a signal to the parent (the environment actor) through a pidfd or a CPU
    limit set on it, writes through a directory descriptor, a named pipe or sqlite outside the scratch dir, a shell
    through multiprocessing's spawn (no audit event), and the guard's own lists emptied from the snippet."""
    outside = str(tmp_path / "victim")
    for code in (
        "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 0)",
        "import os, resource\nresource.prlimit(os.getppid(), resource.RLIMIT_CPU, (1, 1))",
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\nos.mkdir('victim', dir_fd=fd)",
        f"import os\nos.mkfifo({outside!r})",
        f"import sqlite3\nsqlite3.connect({outside!r})",
        "import multiprocessing, os\nmultiprocessing.get_context('spawn').Process(target=os.getpid).start()",
        "import sys, socket\nsys.modules['__main__']._BLOCKED_PREFIXES = ()\nsocket.socket()",
        # A subinterpreter has no audit hook: every guard was off inside it. readline writes with no audit event.
        f"import _xxsubinterpreters as s\ns.run_string(s.create(), \"open({outside!r}, 'w')\")",
        f"import _interpreters as s\ns.run_string(s.create(), \"open({outside!r}, 'w')\")",
        f"import readline\nreadline.write_history_file({outside!r})",
        "import _testcapi",
    ):
        assert run(env, code).startswith("error: python: "), code
    assert not (tmp_path / "victim").exists()


def test_source_descriptors_descriptor_paths_and_the_guards_own_objects_are_guarded(env: ToolEnvironment, tmp_path) -> None:
    """A second review's holes: ``os.rename``/``os.link`` with ``src_dir_fd`` moved or hard-linked (then overwrote) an
    outside file (only the last argument, ``dst_dir_fd``, was checked), ``os.fchmod`` chmodded one through a read-only
    descriptor, and the hook found through ``gc`` had its closure rewritten (every guard off). And ``os.truncate``'s
    length was taken for a ``dir_fd``: truncating a scratch file was refused."""
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("moved.txt", "linked.txt", "mode.txt"):
        (victim / name).write_text("original\n")
    (victim / "mode.txt").chmod(0o644)
    opened = f"import os\nd = os.open({str(victim)!r}, os.O_RDONLY)\n"
    hook = "next(f for f in gc.get_objects() if type(f).__name__ == 'function' and f.__name__ == 'hook')"
    for code in (
        opened + "os.rename('moved.txt', 'stolen.txt', src_dir_fd=d)",
        opened + "os.link('linked.txt', 'h.txt', src_dir_fd=d)\nopen('h.txt', 'w').write('overwritten')",
        f"import os\nos.fchmod(os.open({str(victim / 'mode.txt')!r}, os.O_RDONLY), 0)",
        f"import gc, os\nhook = {hook}\nfor cell in hook.__closure__:\n    cell.cell_contents = ()\nos.system('true')",
    ):
        observation = run(env, code)
        assert "sandbox:" in observation and "not allowed" in observation, code
    assert sorted(p.name for p in victim.iterdir()) == ["linked.txt", "mode.txt", "moved.txt"]
    assert (victim / "linked.txt").read_text() == "original\n" and (victim / "mode.txt").stat().st_mode & 0o777 == 0o644
    inside = "import os\nopen('f', 'w').write('abc')\nos.truncate('f', 1)\nfd = os.open('f', os.O_RDONLY)\nos.fchmod(fd, 0o600)\n"
    assert run(env, inside + "open('f').read(), oct(os.stat('f').st_mode & 0o777)") == "('a', '0o600')"


def test_a_small_output_limit_keeps_the_whole_error_line_and_still_caps_the_answer() -> None:
    small = ToolEnvironment(tools=["python"], python_timeout_s=30, python_memory_mb=128, python_max_output_bytes=16)
    assert run(small, "int('abc')") == "error: python: ValueError: invalid literal for int() with base 10: 'abc'"
    assert run(small, "print('x' * 17)") == "error: python: output larger than 16 bytes"
    assert run(small, "'x' * 8") == "'xxxxxxxx'"


def test_a_reimported_or_reinitialised_module_brings_no_removed_call_back(env: ToolEnvironment, tmp_path) -> None:
    """A third review's holes: importing _posixsubprocess again gave a fresh fork_exec (a shell, no audit event), and
    importlib.reload of posix / _signal restored pidfd_open, pidfd_send_signal and mkfifo (a signal to the environment
    actor, a pipe anywhere); sqlite's ATTACH and VACUUM INTO wrote anywhere; a bytes path that is not UTF-8 was checked
    as another path than the kernel follows; and the parent's environment was readable in /proc."""
    fifo = tmp_path / "fifo"
    sandbox_tmp = Path(tempfile.gettempdir())  # where each call's work dir is made: the scratch dir's grandparent
    escaped = sandbox_tmp / f"nemo_like_escape_{os.getpid()}.txt"
    for code in (
        "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess\n_posixsubprocess.fork_exec",
        "import importlib, posix, os\nimportlib.reload(posix)\nposix.pidfd_open(os.getppid())",
        f"import importlib, posix\nimportlib.reload(posix)\nposix.mkfifo({str(fifo)!r})",
        "import importlib, _signal\nimportlib.reload(_signal)\n_signal.pidfd_send_signal",
        "import _imp, sys\ndel sys.modules['posix']\n_imp.create_builtin(sys.modules['os'].__spec__)",
        f"import sqlite3\nsqlite3.connect(':memory:').execute(\"ATTACH DATABASE '{tmp_path / 'x.db'}' AS x\")",
        # the link is checked relative to the working directory (a/b: '../..' is the scratch dir) but resolves from its
        # own (the scratch dir's grandparent); an undecodable name kept realpath from following it
        "import os\nscratch = os.getcwdb()\nos.makedirs('a/b')\nos.chdir('a/b')\nos.symlink(b'../..', scratch + b'/\\xff')\n"
        f"open(scratch + b'/\\xff/' + {escaped.name!r}.encode(), 'w')",
        "import os\nopen(f'/proc/{os.getppid()}/environ', 'rb').read()",
    ):
        observation = run(env, code)
        assert "sandbox:" in observation and "not allowed" in observation, (code, observation)
    assert not fifo.exists() and not (tmp_path / "x.db").exists() and not escaped.exists()
    assert run(env, "import importlib, json, dataclasses, inspect\nopen('/proc/self/status').read()[:5]") == "'Name:'"


def test_a_snippet_that_ends_normally_is_an_answer_whatever_it_says_on_stderr(env: ToolEnvironment) -> None:
    """sys.exit() / sys.exit(0) were reported as errors ('SystemExit: 0'), a large stderr (debug prints) as an output
    limit or a crash, and a MemoryError handled and printed by the snippet as a memory-limit error: each lost the answer."""
    assert run(env, "import sys\nprint(9716)\nsys.exit(0)") == "9716"
    assert run(env, "import sys\nprint(9716)\nsys.exit()") == "9716"
    assert run(env, "import sys\nsys.stderr.write('debug ' * 5000)\nprint(9716)") == "9716"
    handled = "try:\n    bytearray(1 << 30)\nexcept MemoryError:\n    import traceback; traceback.print_exc()\nprint(9716)"
    assert run(env, handled) == "9716"
    assert run(env, "import sys\nsys.exit(3)") == "error: python: SystemExit: 3"
    # exit() and quit() as `python script.py` has them (the child runs without site, which defines them: a NameError)
    assert run(env, "print(9716)\nexit()") == run(env, "print(9716)\nquit(0)") == "9716"
    assert run(env, "exit(3)") == "error: python: SystemExit: 3"


def test_an_exceptions_message_with_line_separators_keeps_its_type_in_one_line(env: ToolEnvironment) -> None:
    """The child joined a message's "\n" lines but the parent reports the last of str.splitlines, which also splits on
    "\r" and other separators: `ValueError('bad row: 3,4\r\n')` came back as "python:  |", its type and text lost."""
    assert run(env, "raise ValueError('bad row: 3,4\\r\\n')") == "error: python: ValueError: bad row: 3,4"
    assert run(env, "raise ValueError('line1\\r\\nline2')") == "error: python: ValueError: line1 | line2"
    assert run(env, "raise KeyError('a\\x1cb')") == "error: python: KeyError: 'a\\x1cb'"
    assert run(env, "raise ValueError('a\\x1cb')") == "error: python: ValueError: a | b"


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time; time.sleep(30)"])
def test_the_wall_clock_limit_kills_the_snippet(code: str) -> None:
    env = ToolEnvironment(tools=["python"], python_timeout_s=1.5)
    assert run(env, code) == "error: python: time limit of 1.5 s exceeded"
    assert env.metrics()["tool_timeouts"] == 1


def test_counters_and_the_run_continues_after_failures(env: ToolEnvironment) -> None:
    env.metrics()  # reset
    outputs = [run(env, code) for code in ("bytearray(1 << 30)", "1/0", "import socket; socket.socket()", "2 + 2")]
    assert outputs[-1] == "4"
    counts = env.metrics()
    assert (counts["tool_calls"], counts["tool_errors"], counts["tool_timeouts"], counts["tool_memory_errors"]) == (4, 3, 0, 1)


def test_sandbox_rejects_bad_arguments_without_starting_a_process(monkeypatch) -> None:
    sandbox = PythonSandbox()
    monkeypatch.setattr(PythonSandbox, "_spawn", lambda *args: pytest.fail("a sandbox process started for bad arguments"))
    for code, message in ((123, "must be a string"), ("x" * 20_001, "longer than")):
        with pytest.raises(ToolError, match=message) as err:
            sandbox.run(code)
        assert err.value.kind == "bad_arguments"


def test_a_sandbox_process_killed_from_outside_is_run_once_more(monkeypatch) -> None:
    """SIGKILL of the sandbox's process (an operator, the OOM killer): the snippet is run again in a fresh process, so
    the tool's answer, and the run, are the uninterrupted ones; a second kill is a ``crash``."""
    import signal

    spawns = []
    real_spawn = PythonSandbox._spawn

    def killed_first(self, code, scratch, out, err):
        spawns.append(code)
        if len(spawns) in kills:
            out.write(b"partial output of the killed process")
            return -signal.SIGKILL
        return real_spawn(self, code, scratch, out, err)

    monkeypatch.setattr(PythonSandbox, "_spawn", killed_first)
    kills = {1}
    assert PythonSandbox().run("print('a'); 6 * 7") == "a\n42" and len(spawns) == 2  # nothing of the killed run shows
    spawns.clear()
    kills = {1, 2}
    with pytest.raises(ToolError, match="status -9") as err:
        PythonSandbox().run("6 * 7")
    assert err.value.kind == "crash" and len(spawns) == 2


REMOVE_AS_ANOTHER_USER = r"""
import os, sys, tempfile
from pathlib import Path
from nemo_like.environments.tools.python_sandbox import remove_tree
if os.geteuid() == 0:
    os.setgid(65534); os.setuid(65534)  # root ignores permissions: run as nobody, as a non-root user does
work = Path(tempfile.mkdtemp(prefix="nemo_like_tool_"))
(work / "scratch" / "deep").mkdir(parents=True)
(work / "scratch" / "deep" / "f").write_text("x")
os.chmod(work / "scratch" / "deep", 0o500); os.chmod(work / "scratch", 0o000)  # what a snippet may do to its scratch
remove_tree(work)
print(work.exists())
"""


def test_a_scratch_dir_the_snippet_made_unwritable_is_still_removed() -> None:
    """A snippet that took its own write (or read) permission from its scratch directory left it in /tmp:
    ``shutil.rmtree(..., ignore_errors=True)`` gave up on it without a word."""
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", REMOVE_AS_ANOTHER_USER], cwd="/", env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_a_killed_actors_work_directory_is_swept_by_the_next_sandbox(tmp_path, monkeypatch) -> None:
    """An environment actor killed during a call (a replaced hung actor, the end of an async run) never ran the call's
    clean-up: its work directory stayed in the temporary directory, named with no pid, so nothing could sweep it."""
    import tempfile

    from nemo_like.environments.tools.python_sandbox import WORK_PREFIX
    from nemo_like.utils.orphans import pid_namespace, process_tag

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)
    orphan = tmp_path / f"{WORK_PREFIX}{dead}p{pid_namespace()}_x1"
    (orphan / "scratch").mkdir(parents=True)
    live = tmp_path / f"{WORK_PREFIX}{process_tag()}_x2"  # a call of this process, running
    live.mkdir()
    sandbox = PythonSandbox()
    assert not orphan.exists() and live.exists()
    assert sandbox.run("6 * 7") == "42" and [p.name for p in tmp_path.iterdir()] == [live.name]  # its own: removed


def test_a_directory_descriptor_reaches_no_other_process_and_writes_nothing_outside(env: ToolEnvironment, tmp_path) -> None:
    """A fourth review's hole: ``os.open``'s audit event carries no ``dir_fd``, so a path relative to a descriptor of
    ``/proc`` read the environment actor's environ (its secrets: W&B keys), and one relative to any directory wrote
    outside the scratch dir. The snippet's ``os.open`` refuses ``dir_fd``; the real one is out of its reach. Each call
    also opens at most 1000 files for writing (RLIMIT_FSIZE caps each, nothing capped their number)."""
    fd_of = "import os\nfd = os.open({!r}, os.O_RDONLY)\n"
    for code in (
        fd_of.format("/proc") + "os.read(os.open(f'{os.getppid()}/environ', os.O_RDONLY, dir_fd=fd), 100)",
        fd_of.format("/proc") + "open(f'{os.getppid()}/environ', opener=lambda p, f: os.open(p, f, dir_fd=fd)).read()",
        fd_of.format(str(tmp_path)) + "os.open('victim', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        # the real one, looked for where the standard library keeps references to it
        "import os, posix\nopen_ = next(f for s in (os.supports_dir_fd, os.supports_fd) for f in s if f.__name__ == 'open')",
        "for i in range(1001):\n    open(f'f{i}', 'w').close()",
        "import os\nos.makedirs('d/e')\nlist(os.fwalk('.'))",  # it skipped every subdirectory without a word
        # writing one path and renaming it away made any number of files
        "import os\nfor i in range(1001):\n    open('tmp', 'w').close()\n    os.replace('tmp', f'out{i}')",
    ):
        observation = run(env, code)
        assert observation.startswith("error: python: ") and ("not allowed" in observation or "StopIteration" in observation
                                                            or "more than 1000 files" in observation), (code, observation)  # fmt: skip
    assert not (tmp_path / "victim").exists()
    fine = "import os, shutil\nfd = os.open('f', os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'abc')\nos.close(fd)\n"
    fine += "os.makedirs('a/b')\nshutil.rmtree('a')\nfor i in range(900):\n    open(f'g{i}', 'w').close()\n"
    fine += "for i in range(1500):\n    open('log', 'a').close()\n"  # files are counted, not opens
    fine += "import tempfile\nfor i in range(60):\n    fd, tmp = tempfile.mkstemp(dir='.')\n    os.close(fd)\n"
    fine += "    os.replace(tmp, f'atomic{i}')\nopen('f').read()"  # a renamed file counts once (it counted twice)
    assert run(env, fine) == "'abc'"
    # the watchdog thread takes none of the memory limit (its default stack and arena took ~74 MiB of 256 MB)
    assert run(env, "b = bytearray(96 << 20)\nlen(b) >> 20") == "96"
    # and the snippet's own threads keep the default stack (the watchdog's 256 KiB had become every thread's: a recursion
    # of depth 900 in one crashed the process with SIGSEGV)
    deep = "import functools, sys, threading\nsys.setrecursionlimit(3000)\n@functools.lru_cache(None)\ndef f(n):\n    return 0 if n == 0 else 1 + f(n - 1)\n"
    deep += "out = []\nt = threading.Thread(target=lambda: out.append(f(900)))\nt.start()\nt.join()\nout"  # C calls: C stack
    assert run(env, deep) == "[900]"


WAIT_IN_A_SANDBOX = r"""
from nemo_like.environments.tools.python_sandbox import PythonSandbox
PythonSandbox(timeout_s=120).run("import time; time.sleep(100)")
"""


def test_a_sandbox_process_ends_with_its_environment_actor() -> None:
    """Its wall-clock limit is the parent's to enforce: a sleeping snippet (RLIMIT_CPU never fires) outlived an
    environment actor killed mid-call (a replaced hung actor, the end of an async run) for ever."""
    import signal
    import time

    root = Path(__file__).resolve().parents[3]
    actor = subprocess.Popen([sys.executable, "-c", WAIT_IN_A_SANDBOX], cwd="/", env={**os.environ, "PYTHONPATH": str(root)})

    def sandbox_pids() -> list[int]:
        children = Path(f"/proc/{actor.pid}/task/{actor.pid}/children")
        return [int(pid) for pid in children.read_text().split()] if children.exists() else []

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
        except (FileNotFoundError, IndexError):
            return False

    deadline = time.monotonic() + 60
    while not sandbox_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    (child,) = sandbox_pids()
    time.sleep(1.0)  # the snippet sleeps
    assert running(child)
    os.kill(actor.pid, signal.SIGKILL)
    actor.wait()
    deadline = time.monotonic() + 30
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = running(child)
    if alive:
        os.kill(child, signal.SIGKILL)  # leave nothing behind
    assert not alive
