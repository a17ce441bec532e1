"""math-verify in a persistent helper process, with a hard per-answer time limit.

Symbolic comparison can hang: sympy evaluating ``9^{9^{9^{9}}}`` runs for minutes inside C code, where
math-verify's own ``signal.alarm`` timeout cannot interrupt it (and ``signal`` only works in a main
thread, which Ray actor calls are not guaranteed to run in). So every answer is checked in a child
process that this module kills and replaces when an answer takes longer than ``timeout_s``; the run
never hangs, and the cost of a timeout is one process start (about a second: importing sympy).

Protocol: one JSON line per request on the child's stdin (``{"response": ..., "gold": ...}``), one JSON
line per reply on its stdout (``{"status": "correct" | "wrong" | "parse_failure" | "gold_parse_failure"}``).
Run the child as ``python -m nemo_like.environments.math_verify_process``.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

#: Reply statuses; ``timeout`` and ``crash`` are decided by the parent.
STATUSES = ("correct", "wrong", "parse_failure", "gold_parse_failure", "timeout", "crash")
_READY = "ready"
#: Checked once before a helper says it is ready: a fresh process's first fraction and first root against a decimal
#: cost 0.10-0.13 s and 0.16-0.25 s on a quiet core (lazy set-up in sympy and the LaTeX parser; 6-16 ms once warm),
#: many times that on a loaded one, charged to the first answers after each restart (a correct \frac{1}{2} timed
#: out at 1.5 s in a loaded CI run). Expected statuses: correct, wrong, correct (tests/unit/environments).
WARM_UP = (("\\boxed{\\frac{1}{2}}", "$0.5$"), ("\\boxed{\\sqrt{3}}", "$1.7$"), ("\\boxed{x+1}", "$1+x$"))


def number_text(value: Any) -> str:
    """``value`` as answer text: a float in positional notation (``str(0.00001)`` is ``'1e-05'``, which math-verify
    reads as Euler's number minus 5, so every correct answer scored 0), anything else as ``str`` gives it."""
    if isinstance(value, float) and math.isfinite(value):
        return format(Decimal(repr(value)), "f")
    return str(value).strip()


def gold_text(gold: Any) -> str:
    """The gold answer as math-verify parses it best: LaTeX in ``$...$`` unless already delimited (an unescaped ``$``;
    an escaped one, ``\\$18.90`` in MATH-style answers, is a currency sign, not a delimiter)."""
    text = number_text(gold)
    if re.search(r"(?<!\\)\$", text) or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text}$"


class MathVerifyProcess:
    """Client side: a persistent child process checking one answer at a time (started lazily)."""

    def __init__(self, timeout_s: float, start_timeout_s: float = 120.0, memory_mb: int | None = None) -> None:
        """``memory_mb``: the child's address-space limit (``None``: none)."""
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.memory_mb = memory_mb
        self.proc: subprocess.Popen | None = None
        self._buffer = b""
        self.restarts = 0  # processes started after a timeout or crash

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nemo_like.environments.math_verify_process", *([str(self.memory_mb)] if self.memory_mb else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            env=os.environ.copy(),
        )
        self._buffer = b""
        line = self._read_line(time.monotonic() + self.start_timeout_s)
        if line is None and _exit_code(self.proc) is not None:  # it died at start (math-verify missing or broken): say so
            code = self.proc.returncode
            self._kill()
            raise RuntimeError(
                f"the math-verify process exited with code {code} before it was ready (is math-verify installed in the "
                "environment actor's Python? its traceback is in the actor's stderr)"
            )
        if line is None or json.loads(line).get("status") != _READY:
            self._kill()
            raise RuntimeError(f"the math-verify process did not start within {self.start_timeout_s:.0f}s (got {line!r})")

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            self.proc = None

    def _read_line(self, deadline: float) -> str | None:
        """The next reply line, or ``None`` when the deadline passed or the child died."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # EOF: the child exited (it may not be reaped yet: poll() can still say it runs)
                self._ended = True
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def check(self, response: str, gold: Any) -> str:
        """One of :data:`STATUSES` for ``response`` against ``gold``; never takes much longer than ``timeout_s``."""
        request = (json.dumps({"response": response, "gold": gold_text(gold)}) + "\n").encode()
        for attempt in range(2):
            if self.proc is not None and self.proc.poll() is not None:  # died while idle: not this answer's doing
                self._kill()
                self.restarts += 1
            if self.proc is None:
                self._start()
            try:
                self.proc.stdin.write(request)
                self.proc.stdin.flush()
                break
            except BrokenPipeError:  # it died before reading this answer: start a fresh one and send it again
                self._kill()
                self.restarts += 1
                if attempt:
                    return "crash"
        self._ended = False
        line = self._read_line(time.monotonic() + self.timeout_s)
        if line is None:
            status = "crash" if self._ended or self.proc.poll() is not None else "timeout"
            self._kill()  # the next check starts a fresh process
            self.restarts += 1
            return status
        return json.loads(line)["status"]

    def close(self) -> None:
        self._kill()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _exit_code(proc: subprocess.Popen, grace_s: float = 2.0) -> int | None:
    """The exit code of a child whose output ended (EOF comes a moment before the exit is reaped), or None while it runs."""
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        return None


# -- the child process --------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so a hung check never outlives its environment actor. (The kernel sends
    it when the *thread* that started the child exits: the parent then finds its idle helper dead and starts another
    before the next answer, which is not scored as a crash.)"""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; EOF on stdin also ends the loop
        pass


#: A percent sign closing a box (``\boxed{50\%}``, also ``50\ \%`` and ``50\%.``): math-verify drops ``%`` after a
#: ``$...$`` answer (``$50\%$`` is 50) but not inside a box, where ``50\%`` stayed text and a correct percentage scored 0.
#: A match starts only where a whitespace run does (``(?<!\s)``): tried at every position of a run, the search was
#: quadratic, and a correct answer followed by 20,000 newlines timed out (scored 0).
BOXED_PERCENT = re.compile(r"(?<!\s)\s*(?:\\ )?\\?%\s*[.,;]?\s*\}")
#: A sentence's full stop typed at the end of a box (``\boxed{5.}``, ``\boxed{2\pi.}``, ``\boxed{x;\,}``): math-verify read
#: the box as wrong. Searched in each box's last characters only (:func:`without_stops_in_boxes`).
BOX_END_STOP = re.compile(r"(?<!\\)[.,;](?:\s|\\[,;:! ])*\Z")  # not the , of LaTeX's \, (a thin space)
BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE = re.compile(r"[{}]")


def closed_boxes(text: str) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each ``\\boxed{...}`` / ``\\fbox{...}`` that closes in ``text`` (its braces balanced): its
    content is ``text[start:end]``. Every brace is matched in one pass (a scan per box was quadratic)."""
    openings = {opened.end() for opened in BOX_OPEN.finditer(text)}
    if not openings:
        return
    stack: list[int] = []
    for brace in _BRACE.finditer(text):
        if brace.group() == "{":
            stack.append(brace.end())
        elif stack and (start := stack.pop()) in openings:
            yield start, brace.start()


def without_stops_in_boxes(text: str) -> str:
    """``text`` with a full stop (``.`` ``,`` ``;`` and the spacing after it) cut from the end of each box's content."""
    kept, position = [], 0
    for start, end in closed_boxes(text):  # in the order the boxes close
        stop = BOX_END_STOP.search(text, max(start, end - 16), end)  # (the lookbehind sees before the window)
        if stop is not None:
            kept.append(text[position : stop.start()])
            position = end
    return "".join(kept) + text[position:]


#: ``\fbox{...}``, LaTeX's other box: math-verify reads only ``\boxed``, so a correct ``\fbox`` answer scored 0. Read as
#: a box only when the response has no answer without it (a response that frames a step and states its answer after
#: it is read as before).
FBOX = re.compile(r"\\fbox\s*\{")
#: A thin space between digit groups (``1\,000``), as LaTeX typesets thousands: math-verify read ``1\,000`` as wrong.
THIN_SPACE_THOUSANDS = re.compile(r"(\d)\\,(?=\d{3}(?!\d))")
#: Whitespace between ``\boxed`` and its brace (``\boxed {7}``, valid LaTeX, and a box to :func:`closed_boxes`):
#: math-verify reads only ``\boxed{``, so the answer went unread (the format reward, or an earlier number scored).
BOXED_SPACE = re.compile(r"\\boxed\s+\{")
#: Answer tags and backticks around an unboxed final answer (``<answer>42</answer>``, 42 in backticks): math-verify reads a
#: plain number only after whitespace or ``=``, so it skipped that one and scored an earlier expression of the
#: reasoning (``6*7`` right against 42 with ``41`` tagged as the answer). Read as spaces.
ANSWER_MARKUP = re.compile(r"</?answer>|`")


def normalised_answer(text: str) -> str:
    """``text`` as math-verify reads it best: thin spaces between digit groups dropped (:data:`THIN_SPACE_THOUSANDS`), a
    percent sign closing a box dropped (:data:`BOXED_PERCENT`), a full stop ending a box's content dropped
    (:data:`BOX_END_STOP`), and the Unicode minus sign (U+2212, as typeset text writes it) made
    ASCII: math-verify read a plain-text ``−3`` as no answer (inside ``$...$`` or a box it read it); ``\boxed {`` closed up
    (:data:`BOXED_SPACE`), answer tags and backticks read as spaces (:data:`ANSWER_MARKUP`)."""
    text = ANSWER_MARKUP.sub(" ", BOXED_SPACE.sub(r"\\boxed{", text.replace("\u2212", "-")))
    return without_stops_in_boxes(BOXED_PERCENT.sub("}", THIN_SPACE_THOUSANDS.sub(r"\1", text)))


def verify_answer(response: str, gold: str, gold_cache: dict[str, Any] | None = None) -> str:
    """``correct`` / ``wrong`` / ``parse_failure`` / ``gold_parse_failure`` (no time limit: run it in the child). Both
    sides are :func:`normalised_answer` first."""
    from math_verify import parse, verify

    cache = gold_cache if gold_cache is not None else {}
    if gold not in cache:
        cache[gold] = parse(normalised_answer(gold), parsing_timeout=None)
    gold_parsed = cache[gold]
    if not gold_parsed:
        return "gold_parse_failure"
    predicted = parse(normalised_answer(response), parsing_timeout=None)
    if not predicted and FBOX.search(response):  # only an \fbox holds an answer: read it as \boxed (FBOX)
        predicted = parse(normalised_answer(FBOX.sub(r"\\boxed{", response)), parsing_timeout=None)
    if not predicted:
        return "parse_failure"
    return "correct" if verify(gold_parsed, predicted, timeout_seconds=None) else "wrong"


def serve() -> None:
    """Child main loop: answer requests until stdin closes."""
    import logging

    _die_with_parent()
    if len(sys.argv) > 1:  # memory_mb: a check past it raises MemoryError, and the process ends (below)
        import resource

        limit = int(sys.argv[1]) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything a library prints goes to stderr, never into the reply stream
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # "timeout disabled" notices: we enforce our own
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    import math_verify  # noqa: F401  (import before announcing readiness: a check then costs only its own time)

    for response, gold in WARM_UP:  # sympy and the LaTeX parser set up lazily: ~0.4 s on a quiet core, not the first answer's
        try:
            verify_answer(response, gold)
        except Exception:  # noqa: BLE001 - a warm-up, not an answer
            pass
    out.write(json.dumps({"status": _READY}) + "\n")
    out.flush()
    cache: dict[str, Any] = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            status = verify_answer(request["response"], request["gold"], cache)
        except MemoryError:  # past memory_mb: a crash (the parent counts it and starts a fresh process)
            os._exit(3)
        except Exception:  # noqa: BLE001 - a response that breaks the parser is unparsable, not a crash
            status = "parse_failure"
        if len(cache) > 4096:
            cache.clear()
        out.write(json.dumps({"status": status}) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
