"""The math environment for real: math-verify in its helper process, through MathEnvironment.score."""

from __future__ import annotations

import os
import time

import pytest

from nemo_like.environments.math import MathEnvironment, has_boxed_answer
from nemo_like.environments.math_verify_process import WARM_UP, verify_answer

# (response, gold answer, correct?)
PAIRS = [
    # a space before the box's brace (valid LaTeX); answer tags and backticks around an unboxed answer (an earlier
    # expression of the reasoning was scored: 6*7 right against 42)
    ("\\boxed {7}", "7", True),
    ("So \\boxed\n{7}. Check: 3+4=7 in 2 steps", "7", True),
    ("We multiply: 6*7.\n<answer>41</answer>", "42", False),
    ("We multiply: 6*7.\n`41`", "42", False),
    ("<answer>42</answer>", "42", True),
    # fractions, decimals, a/b
    ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", True),
    ("So we get 0.5", "\\frac{1}{2}", True),
    ("\\boxed{1/2}", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("\\boxed{\\frac{2}{4}}", "\\frac12", True),
    ("\\boxed{0.333}", "\\frac{1}{3}", False),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", False),
    # integers, negatives, plain final numbers
    ("\\boxed{-7}", "-7", True),
    ("Therefore the result is -7.", "-7", True),
    ("\\boxed{7}", "-7", False),
    ("First 3, then 5, so the answer is 12", "12", True),
    ("\\boxed{42}", 42, True),
    ("\\boxed{41}", 42, False),
    ("\\boxed{1,000}", "1000", True),
    # radicals, pi, expressions
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{3}", False),
    ("\\boxed{2\\pi}", "2\\pi", True),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{x^2+1}", "(x+1)^2", False),
    # sets and intervals
    ("\\boxed{\\{1,2,3\\}}", "\\{3,2,1\\}", True),
    ("\\boxed{\\{1,2\\}}", "\\{1,2,3\\}", False),
    ("The solution set is $(0,1]$", "(0,1]", True),
    ("\\boxed{[0,1]}", "(0,1]", False),
    ("\\boxed{(-\\infty, 2)}", "(-\\infty,2)", True),
    ("\\boxed{[2, \\infty)}", "(2,\\infty)", False),
    # equations and tuples
    ("$x=5$", "5", True),
    ("\\boxed{(1, 2)}", "(1,2)", True),
    ("\\boxed{(2, 1)}", "(1,2)", False),
    # percent / degrees / text around
    ("\\boxed{30^\\circ}", "30", True),
    ("so the rate is \\boxed{50\\%}.", "50", True),  # a percent in a box stayed text: 0 for a right answer
    ("\\boxed{25 \\%}", "25\\%", True),
    ("\\boxed{26\\%}", "25\\%", False),
    # a float gold below 1e-4: str() wrote '1e-05', which math-verify read as e - 5
    ("\\boxed{0.00001}", 1e-05, True),
    ("\\boxed{0.000025}", 2.5e-05, True),
    ("\\boxed{e-5}", 1e-05, False),
    ("The answer is $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt3}{2}", True),
    # a currency sign in the gold (MATH writes \$18.90): it is not a $...$ delimiter (the gold did not parse)
    ("The total is \\boxed{18.90}", "\\$18.90", True),
    ("\\boxed{5}", "\\$5", True),
    # LaTeX's other box and typeset forms math-verify alone read as wrong: \fbox, thin-space thousands, spaced or
    # punctuated percent signs
    ("The answer is \\fbox{7}.", "7", True),
    ("\\boxed{1\\,000}", "1000", True),
    ("\\boxed{1\\,000\\,000}", "1000000", True),
    ("\\boxed{10\\%.}", "10", True),
    ("\\boxed{5\\ \\%}", "5", True),
    ("\\fbox{8}", "7", False),
    # ... but an \fbox that frames a step is not read over the answer stated after it
    ("Key step: \\fbox{x = 3}. Therefore the answer is 4.", "4", True),
    ("We first find \\fbox{12} apples; the total is therefore $20$.", "20", True),
    # a full stop typed at the end of the box (math-verify read it as wrong)
    ("\\boxed{5.}", "5", True),
    ("So $\\boxed{-3.}$", "-3", True),
    ("\\boxed{2.5 ;}", "2.5", True),
    ("\\boxed{2\\pi.}", "2\\pi", True),
    ("\\boxed{\\dfrac{3}{4}.\\,}", "\\frac{3}{4}", True),
    ("\\boxed{x.\n}", "x", True),
    ("\\boxed{5.}", "6", False),
    ("\\boxed{5\\,}", "5", True),  # ... but LaTeX's thin space \, is no full stop (cut, it left \boxed{5\})
    ("\\boxed{\\frac{1}{2}\\;}", "\\frac{1}{2}", True),
    ("\\boxed{12\\,\\%}", "12", True),
    ("\\boxed{5\\," + " " * 15 + "}", "5", True),  # the thin space just before the full-stop rule's window
    # a correct answer followed by a degenerate run of whitespace (the percent rule's search was quadratic: 20,000
    # newlines took 6 s, 60,000 past this test's 30 s limit: scored 0)
    ("\\boxed{5}" + "\n" * 60_000, "5", True),
    # the Unicode minus sign of typeset text (U+2212): a plain-text answer read as no answer
    ("The answer is \u22123.", "-3", True),
    ("So the slope is \u22123.5", "-3.5", True),
    # malformed or missing answers
    ("\\boxed{\\frac{1}{2", "\\frac{1}{2}", False),
    ("I don't know.", "5", False),
    ("", "5", False),
]


@pytest.fixture(scope="module")
def env():
    environment = MathEnvironment(timeout_s=30.0)  # generous: this test is about answers, not time
    yield environment
    environment.close()


def test_at_least_30_pairs_scored_as_math_says(env: MathEnvironment) -> None:
    assert len(PAIRS) >= 30
    rewards = env.score([r for r, _, _ in PAIRS], [{"answer": g, "task_name": "math"} for _, g, _ in PAIRS])
    wrong = [(PAIRS[i][0], PAIRS[i][1], PAIRS[i][2], r) for i, r in enumerate(rewards) if r != float(PAIRS[i][2])]
    assert not wrong, f"(response, gold, expected, reward): {wrong}"
    counts = env.metrics()
    assert counts["correct"] == sum(ok for _, _, ok in PAIRS)
    assert counts["timeouts"] == 0
    assert counts["parse_failures"] >= 2  # "I don't know." and "" have no answer at all
    assert env.metrics()["correct"] == 0  # counters reset on read


def test_format_reward_only_for_a_wrong_boxed_answer(env: MathEnvironment) -> None:
    env.format_reward = 0.1
    try:
        rewards = env.score(["\\boxed{3}", "\\boxed{4}", "4", "3"], [{"answer": "3"}] * 4)
    finally:
        env.format_reward = 0.0
    assert rewards == [1.0, 0.1, 0.0, 1.0]
    assert has_boxed_answer("so \\boxed {2}") and not has_boxed_answer("boxed{2}")
    # an empty box, a bare one at the end of a cut response, or one promised in prose earned the format reward
    assert not any(has_boxed_answer(r) for r in ("\\boxed{}", "\\boxed{ }", "the answer is \\boxed{", "\\fbox{}"))
    # ... nor one cut before its closing brace; nested braces close it as LaTeX does
    assert not any(has_boxed_answer(r) for r in ("so \\boxed{1", "so \\boxed{\\frac{1}{2"))
    assert all(has_boxed_answer(r) for r in ("so \\boxed{\\frac12}", "so \\boxed {x}", "\\boxed{\\frac{1}{2}} and \\boxed{"))
    assert has_boxed_answer("} stray { \\boxed{ {} x }") and not has_boxed_answer("\\boxed{ } \\boxed{")
    # a length limit inside a repetition loop of unclosed boxes: one pass (a scan per box took 35 s at 64,000 characters)
    assert not has_boxed_answer("\\boxed{\\frac{1}{2}" * 4_000) and has_boxed_answer("\\boxed{\\frac{1}{2}" * 4_000 + "}" * 8_001)


def test_a_checker_that_dies_at_start_says_so_at_once(tmp_path, monkeypatch) -> None:
    """It was reported as a 120 s start time-out (\"got None\"), the cause (math-verify missing) hidden."""
    from nemo_like.environments.math_verify_process import MathVerifyProcess

    (tmp_path / "math_verify.py").write_text("raise ImportError('math_verify is broken here')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    with pytest.raises(RuntimeError, match=r"the math-verify process exited with code \d+ before it was ready"):
        MathVerifyProcess(timeout_s=5.0)._start()


def test_a_checker_that_dies_during_an_answer_is_counted_as_a_crash(tmp_path, monkeypatch) -> None:
    """Its output ends a moment before its exit is reaped: polling right after the end of output still saw it running,
    and most crashes (9 of 15) were counted as time-outs."""
    from nemo_like.environments.math_verify_process import MathVerifyProcess

    (tmp_path / "math_verify.py").write_text(
        "import os\n"
        "def parse(text, **kw):\n    if 'CRASH' in text:\n        os._exit(3)\n    return [text]\n"
        "def verify(gold, predicted, **kw):\n    return gold == predicted\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    checker = MathVerifyProcess(timeout_s=30.0)
    try:
        statuses = [checker.check("CRASH", "1") for _ in range(12)]
    finally:
        checker.close()
    assert statuses == ["crash"] * 12


HANGS = "\\boxed{9^{9^{9^{9}}}}"  # sympy evaluates the power tower: measured > 30 s (still running) without a limit


def test_a_hanging_answer_is_cut_off_and_the_rest_of_the_batch_is_scored() -> None:
    env = MathEnvironment(timeout_s=1.5)
    try:
        env.score(["\\boxed{1}"], [{"answer": "1"}])  # start the helper process outside the measured batch
        env.metrics()
        responses = ["\\boxed{2}", HANGS, "\\boxed{\\frac{1}{2}}", "no answer here", "\\boxed{3}"]
        golds = ["2", "1", "0.5", "4", "4"]
        start = time.monotonic()
        rewards = env.score(responses, [{"answer": g} for g in golds])
        elapsed = time.monotonic() - start
        counts = env.metrics()
    finally:
        env.close()
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert counts["timeouts"] == 1 and counts["correct"] == 2 and counts["parse_failures"] == 1
    assert env.checker.restarts == 1
    print(f"batch with one hanging answer scored in {elapsed:.1f}s (limit 1.5s + one helper restart)")


def test_an_answer_whose_check_needs_more_memory_than_the_limit_stays_within_it() -> None:
    """A 12-character answer (2^(2^33) + 1) grew the helper to ~0.5 GB within its time limit; each environment actor's
    helper could. Under memory_mb the check fails inside it instead, and the helper goes on checking."""
    env = MathEnvironment(timeout_s=20.0, memory_mb=300)
    try:
        assert env.score(["\\boxed{2^{2^{33}}+1}"], [{"answer": "5"}]) == [0.0]
        status = open(f"/proc/{env.checker.proc.pid}/status").read() if env.checker.proc is not None else ""
        assert env.score(["\\boxed{3}"], [{"answer": "3"}]) == [1.0]
        counts = env.metrics()
    finally:
        env.close()
    peak_kb = int(next((line.split()[1] for line in status.splitlines() if line.startswith("VmPeak")), "0"))
    assert counts["timeouts"] == 0 and (peak_kb == 0 or peak_kb <= 300 * 1024), (counts, peak_kb)


def test_the_helpers_warm_up_runs_the_parsers_first_answers_would_pay_for() -> None:
    """A warm-up that failed to parse would warm nothing: each pair reaches the verifier's comparison."""
    assert [verify_answer(response, gold) for response, gold in WARM_UP] == ["correct", "wrong", "correct"]


def test_a_helper_that_died_while_idle_costs_no_answer_its_reward() -> None:
    """Killed between checks (out of memory, or the kernel's parent-death signal when the thread that started it
    exits): the next answer is checked by a fresh helper, not scored as a crash."""
    env = MathEnvironment(timeout_s=30.0)
    try:
        assert env.score(["\\boxed{2}"], [{"answer": "2"}]) == [1.0]
        env.checker.proc.kill()
        env.checker.proc.wait()
        assert env.score(["\\boxed{3}"], [{"answer": "3"}]) == [1.0]
        counts = env.metrics()
    finally:
        env.close()
    assert counts["crashes"] == 0 and counts["correct"] == 2 and env.checker.restarts == 1


@pytest.mark.slow
def test_the_hanging_answer_really_hangs_without_the_limit() -> None:
    """Guard that HANGS is still pathological: with a 4 s limit it is still cut off (not merely slow at 1.5 s)."""
    env = MathEnvironment(timeout_s=4.0)
    try:
        assert env.score([HANGS], [{"answer": "1"}]) == [0.0]
        assert env.metrics()["timeouts"] == 1
    finally:
        env.close()
