"""Tool calling without Ray: <tool_call> parsing, the calculator's safety, the registry (built-ins, custom
tools by import path) and ToolEnvironment.step (observations, termination, rewards, counters)."""

from __future__ import annotations

import json

import pytest

from nemo_like.config import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.environments.interface import FINAL_TURN
from nemo_like.environments.registry import check_constructor_kwargs, resolve_environments
from nemo_like.environments.tools.calculator import CalculatorError, calculator, evaluate_expression
from nemo_like.environments.tools.environment import ToolEnvironment
from nemo_like.environments.tools.parsing import MAX_MALFORMED_CALLS, ToolCall, ToolCallError, format_tool_call, parse_tool_calls
from nemo_like.environments.tools.registry import ToolRegistry
from nemo_like.serving.tool_parsers import parse_hermes


def call(name: str, **arguments: object) -> str:
    return format_tool_call(name, arguments)


def test_parsing_well_formed_several_and_malformed_calls() -> None:
    text = "Let me compute. " + call("calculator", expression="2+3") + "\n" + call("python", code="print(1)")
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("just 42") == []
    # arguments given as a JSON string holding an object (some models emit this)
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == [ToolCall("f", {"x": 1})]
    bad = {
        "<tool_call>{name: 'calculator'}</tool_call>": "malformed JSON",
        "<tool_call>[1, 2]</tool_call>": "JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': "non-empty string 'name'",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "f", "arguments": {}, "id": 3}</tool_call>': "unexpected keys",
        '<tool_call>{"name": "f", "arguments": {}}': "unterminated",
        "<tool_call>" + "[" * 5000 + "</tool_call>": "RecursionError",  # a model stuck on '[' must not crash the actor
        '<tool_call>{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>": "ValueError",  # past 4300 digits
        '<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}</tool_call>': "not a JSON object",
    }
    for text, message in bad.items():
        (parsed,) = parse_tool_calls(text)
        assert isinstance(parsed, ToolCallError) and message in parsed.message, (text, parsed)
    # Code that prints the closing tag: the call ends at the tag after its JSON (the first tag cut the JSON in two)
    code = 'print("<tool_call>{}</tool_call>")'
    assert parse_tool_calls(call("python", code=code) + " then " + call("calculator", expression="1+1")) == [
        ToolCall("python", {"code": code}),
        ToolCall("calculator", {"expression": "1+1"}),
    ]
    # A call without its closing tag before the next call: its own error, and the next call still runs (it was read
    # as part of the first one's body: both lost, and the error blamed the JSON)
    unclosed = call("calculator", expression="2+3").removesuffix("</tool_call>") + "\n" + call("calculator", expression="1+1")
    missing, second = parse_tool_calls(unclosed)
    assert isinstance(missing, ToolCallError) and missing.message == "missing </tool_call> before the next <tool_call>"
    assert second == ToolCall("calculator", {"expression": "1+1"})
    # ... also after prose or malformed JSON (the body ran to the next call's closing tag: the next call was lost)
    for first in (
        call("calculator", expression="2+3").removesuffix("</tool_call>") + " let me also check:",
        '<tool_call>{"name": "calculator"',
    ):
        missing, second = parse_tool_calls(first + " " + call("calculator", expression="1+1"))
        assert isinstance(missing, ToolCallError) and "missing </tool_call>" in missing.message
        assert second == ToolCall("calculator", {"expression": "1+1"})
    # ... but a tag inside one of the malformed call's JSON strings is the call's own text: one error, and the call
    # written in that string does not run
    printed = (
        '<tool_call>{"name": "python", "arguments": {"code": "print(\'' + call("calculator", expression="2**10") + "')\"}}</tool_call>"
    )
    (error,) = parse_tool_calls(printed)
    assert isinstance(error, ToolCallError) and "malformed JSON" in error.message
    # ... while quotes in prose (a quoted tag, 12" pizza) say nothing about JSON strings: the next call still runs
    good = call("calculator", expression="2+2")
    assert parse_tool_calls('I will use the "<tool_call>" format:\n' + good)[1:] == [ToolCall("calculator", {"expression": "2+2"})]
    unclosed_then_prose = call("calculator", expression="1").removesuffix("</tool_call>") + ' a 12" pizza ' + good
    assert parse_tool_calls(unclosed_then_prose)[1:] == [ToolCall("calculator", {"expression": "2+2"})]
    # ... or a stray quote in a malformed call without its closing tag (quote counting took the next tag for text)
    stray = '<tool_call>{"name": "search", "arguments": {"query": "27" monitor"}}\n'
    assert parse_tool_calls(stray + good)[1:] == [ToolCall("calculator", {"expression": "2+2"})]
    # ... also when the next call's own arguments spell a closing tag (it was taken for that call's end)
    prints_tag = call("python", code="print('</tool_call>')")
    malformed = '<tool_call>{"name": "python", "arguments": {"code": "x = 1"}\n'
    assert parse_tool_calls(malformed + prints_tag)[1:] == [ToolCall("python", {"code": "print('</tool_call>')"})]
    # More well-formed calls than any cap: all read (the cap counts malformed ones)
    assert parse_tool_calls(good * 300) == [ToolCall("calculator", {"expression": "2+2"})] * 300
    # A degenerate turn repeating an unclosed tag: at most MAX_MALFORMED_CALLS malformed calls are read, then one error
    # (each failed JSON decode costs its position in the text: 40,000 tags took 3 s)
    calls = parse_tool_calls("<tool_call>{ " * 40_000)
    assert len(calls) == MAX_MALFORMED_CALLS + 1 and "the rest is not read" in calls[-1].message
    # The model's own text repeated in an error is cut (a 20,000-character name came back whole, past the output cut)
    long_name = "f" * 20_000
    for text in (
        '<tool_call>{"name": "' + long_name + '", "arguments": 3}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}, "' + long_name + '": 1}</tool_call>',
    ):
        (error,) = parse_tool_calls(text)
        assert isinstance(error, ToolCallError) and len(error.message) < 300, len(error.message)
    assert len(ToolRegistry.from_config(["calculator"]).call(long_name, {}).text) < 300
    assert len(ToolRegistry.from_config(["calculator"]).call("calculator", {long_name: 1}).text) < 5_000
    assert parse_hermes(unclosed).tool_calls == []  # the server, as vLLM: not every call parses, so all is content
    assert parse_hermes(call("python", code=code)).tool_calls[0]["function"]["arguments"] == json.dumps({"code": code})
    assert parse_hermes('<tool_call>{"name": "python", "arguments": {"code": "' + code.replace('"', '\\"') + '"}}').tool_calls  # stop-cut


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347*28", "9716"),
        ("2 ** 10", "1024"),
        ("-(3 - 10) // 2", "3"),
        ("7 % 3 + 10/4", "3.5"),
        ("10/2", "5"),
        ("1e3 * 2", "2000"),
        ("2 ** 1000", str(2**1000)),
        ("10 ** 999", str(10**999)),
        ("123456789012345678 / 2", "61728394506172839"),  # exact: every digit (a float gave 61728394506172840)
        ("7 / 2", "3.5"),
        ("9 * 10 ** 999", str(9 * 10**999)),  # 1000 digits: the product's bound refused it
        ("((10**999 - 1) * 10 + 9) // 3 * 3", str(10**1000 - 1)),
        ("0x1e-400", "-370"),  # a hex int, not an exponent literal that underflows
        ("5 * 0.0", "0"),
    ],  # 302 and 1000 digits: within the limit
)
def test_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('ls')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("(1).__class__", "Attribute is not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("[1, 2]", "List is not allowed"),
        ("9 ** 9 ** 9", "exponent"),
        ("10 ** 999 * 10 ** 999", "more than 1000 digits"),
        ("10 ** 1000", "more than 1000 digits"),  # 1001 digits: the limit counted bits (3330 allow 1003 digits)
        ("99999 ** 1000", "more than 1000 digits"),
        ("1 / 0", "division by zero"),
        ("0 ** -1", "zero to a negative power"),
        ("(-8) ** 0.5", "complex"),
        ("10.0 ** 400", "too large"),
        ("(10 ** 400) ** -1", "too large"),
        ("1 +", "invalid expression"),
        ("1" * 201, "longer than 200"),
        # a non-zero result that underflows a float showed as an exact 0 (an integer checker took it)
        ("10 ** -400", "underflows"),
        ("1 / 10 ** 400", "underflows"),
        ("1e-300 * 1e-300", "underflows"),
        ("1e-400 * 3", "reads as 0"),
        ("1_000e-400", "reads as 0"),
        ("2\ud800", "invalid expression"),  # a lone surrogate was a UnicodeEncodeError ('exception', not a bad expression)
    ],
)
def test_calculator_rejects_everything_but_bounded_arithmetic(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message):
        evaluate_expression(expression)


def test_registry_built_ins_custom_tools_by_import_path_and_errors(tmp_path) -> None:
    (tmp_path / "my_tools.py").write_text(
        "def reverse(text: str) -> str:\n    return text[::-1]\n\ndef boom():\n    raise KeyError('x')\n\n"
        "def forgot(x: int):\n    x * 2\n"  # no return: the model was shown "None" as a successful call
    )
    tools = ["calculator", *(f"{tmp_path}/my_tools.py:{name}" for name in ("reverse", "boom", "forgot"))]
    registry = ToolRegistry.from_config(tools)
    assert sorted(registry.tools) == ["boom", "calculator", "forgot", "reverse"]
    forgot = registry.call("forgot", {"x": 3})
    assert (forgot.ok, forgot.error_kind, forgot.text) == (False, "bad_return", "forgot: returned None, not the observation text")
    assert registry.call("reverse", {"text": "abc"}).text == "cba"
    assert registry.call("calculator", {"expression": "6*7"}).text == "42"
    assert registry.call("reverse", {"txt": "abc"}).error_kind == "bad_arguments"
    assert registry.call("boom", {}).text == "boom: KeyError: 'x'"
    assert registry.call("nope", {}).error_kind == "unknown_tool"
    named = ToolRegistry.from_config({"calc": "calculator", "rev": "nemo_like.environments.tools.calculator:format_number"})
    assert sorted(named.tools) == ["calc", "rev"] and named.call("rev", {"value": 2.0}).text == "2"
    with pytest.raises(ConfigError, match="not a built-in tool.*Did you mean 'calculator'"):
        ToolRegistry.from_config(["calculater"])
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        ToolRegistry.from_config([f"{tmp_path}/my_tools.py:nope"])


def test_the_tools_schemas_a_prompt_lists_come_from_their_docstrings_and_signatures(tmp_path) -> None:
    """env.<task>.tools_in_prompt: the schemas handed to the chat template name each tool as the model calls it and
    describe it from its docstring (Google style: per-argument descriptions and types; else from the signature)."""
    (tmp_path / "my_tools.py").write_text(
        "def search(query: str, k: int = 3) -> str:\n"
        '    """Search the notes.\n\n    Args:\n        query: What to look for\n        k: How many hits\n    """\n\n'
        "def bare(a, b: float, *rest, flag: bool = False, **extra):\n"
        '    """Add things.\n    Second line.\n\n    Details nobody reads."""\n'
    )
    settings = {"tools": {"calc": "calculator", "search": f"{tmp_path}/my_tools.py:search", "bare": f"{tmp_path}/my_tools.py:bare"}}
    calc, search, bare = (s["function"] for s in ToolEnvironment.prompt_tools(settings))
    assert calc["name"] == "calc" and calc["description"].startswith("Evaluate an arithmetic expression")
    assert calc["parameters"]["required"] == ["expression"] and calc["parameters"]["properties"]["expression"]["type"] == "string"
    assert search == {
        "name": "search",
        "description": "Search the notes.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to look for"},
                "k": {"type": "integer", "description": "How many hits"},
            },
            "required": ["query"],
        },
    }
    # no Args section: the signature (types where annotated, *args/**kwargs left out) and the docstring's first paragraph
    assert bare == {
        "name": "bare",
        "description": "Add things. Second line.",
        "parameters": {
            "type": "object",
            "properties": {"a": {}, "b": {"type": "number"}, "flag": {"type": "boolean"}},
            "required": ["a", "b"],
        },
    }
    python = ToolEnvironment.prompt_tools({"tools": ["python"]})[0]["function"]
    assert python["name"] == "python" and python["parameters"]["required"] == ["code"]
    assert ToolEnvironment.prompt_tools({"tools": ["calculator"], "tools_in_prompt": False}) is None
    json.dumps(ToolEnvironment.prompt_tools(settings))  # what a template's tojson writes
    # What transformers' parser cannot take falls back to the signature: a hint that does not resolve (it raised a bare
    # NameError at start-up), a partial and a callable instance (described by their function's docstring, not
    # functools' or none), optional types (nullable, not untyped)
    (tmp_path / "odd_tools.py").write_text(
        "from __future__ import annotations\nimport functools\nfrom typing import TYPE_CHECKING, Optional\n"
        "if TYPE_CHECKING:\n    from decimal import Decimal\n\n"
        'def exact(x: Decimal) -> str:\n    """Exact value."""\n\n'
        'def scaled(x: float, factor: Optional[int] = None, tags: list[str] | None = None) -> str:\n    """Scale x."""\n\n'
        "half = functools.partial(scaled, factor=2)\n\n"
        'class Lookup:\n    def __call__(self, key: str) -> str:\n        """Look a key up."""\n\nlookup = Lookup()\n'
    )
    odd = {name: f"{tmp_path}/odd_tools.py:{name}" for name in ("exact", "half", "lookup")}
    exact, half, lookup = (s["function"] for s in ToolEnvironment.prompt_tools({"tools": odd}))
    assert exact["parameters"] == {"type": "object", "properties": {"x": {}}, "required": ["x"]}
    assert half["description"] == "Scale x." and half["parameters"]["properties"] == {
        "x": {"type": "number"},
        "factor": {"type": ["integer", "null"]},
        "tags": {"type": ["array", "null"]},
    }
    assert lookup["description"] == "Look a key up." and lookup["parameters"]["required"] == ["key"]


def test_a_long_result_is_cut_with_a_marker_and_counted_and_never_below_the_python_limit(tmp_path) -> None:
    """The registry cut every result to 4096 characters silently, the python tool's too, whatever its own
    python_max_output_bytes let through (an answer printed last was lost without a trace)."""
    (tmp_path / "long.py").write_text("def long(n: int) -> str:\n    return 'x' * (n - 3) + 'END'\n")
    registry = ToolRegistry.from_config([f"{tmp_path}/long.py:long"])
    short, cut = registry.call("long", {"n": 4096}), registry.call("long", {"n": 5000})
    assert short.ok and short.error_kind is None and short.text.endswith("END")
    assert cut.ok and cut.error_kind == "output_cut" and cut.text == "x" * 4096 + "\n[... 904 more characters cut]"
    assert ToolRegistry.from_config(["python"], python_max_output_bytes=65536).max_result_chars == 65536
    # ... the python tool's limit: without that tool the key must not lift the other tools' cut (it warns "no effect")
    assert ToolRegistry.from_config([f"{tmp_path}/long.py:long"], python_max_output_bytes=65536).max_result_chars == 4096
    env = ToolEnvironment(tools=[f"{tmp_path}/long.py:long"])
    step = env.step([conversation(call("long", n=5000))], [{"answer": "1"}])[0]
    assert step.observation["content"].endswith("[... 904 more characters cut]") and step.metrics["tool_errors"] == 0
    assert env.metrics()["tool_outputs_cut"] == 1.0
    # A failure's text is cut the same way (an exception quoting a whole page was an observation of any size), and a
    # tool that exits (sys.exit, argparse) is an error observation: SystemExit ended the environment actor
    (tmp_path / "bad.py").write_text(
        "import sys\ndef page(n: int) -> str:\n    raise RuntimeError('x' * n)\ndef quits(n: int) -> str:\n    sys.exit(n)\n"
    )
    bad = ToolRegistry.from_config([f"{tmp_path}/bad.py:page", f"{tmp_path}/bad.py:quits"])
    failed = bad.call("page", {"n": 60000})
    assert not failed.ok and failed.cut and failed.error_kind == "exception" and len(failed.text) < 4200
    assert failed.text.endswith("more characters cut]")
    quit_ = bad.call("quits", {"n": 2})
    assert (quit_.ok, quit_.error_kind, quit_.text) == (False, "exception", "quits: SystemExit: 2")
    env = ToolEnvironment(tools=[f"{tmp_path}/bad.py:page", f"{tmp_path}/bad.py:quits"])
    steps = env.step([conversation(call("page", n=60000)), conversation(call("quits", n=2))], [{"answer": "1"}] * 2)
    assert steps[1].observation["content"] == "error: quits: SystemExit: 2" and env.metrics()["tool_outputs_cut"] == 1.0


def test_what_a_model_or_a_tool_writes_never_raises_out_of_the_environment(tmp_path) -> None:
    """A lone surrogate (a JSON \\ud800 escape in a call's name) reached the observation and the tokenizer raised on it;
    a tool's int past 4300 digits raised in str() outside the registry's guard. Both ended the whole rollout."""
    from nemo_like.models.loading import load_tokenizer

    (tmp_path / "square.py").write_text("def square(x: int) -> int:\n    return x * x\n")
    env = ToolEnvironment(tools=["calculator", f"{tmp_path}/square.py:square"])
    turn = call("calculator", expression="2*3") + '<tool_call>{"name": "calc\\ud800", "arguments": {}}</tool_call>'
    (step,) = env.step([conversation(turn)], [{"answer": "6"}])
    content = step.observation["content"]
    assert content.startswith("calculator: 6\ncalc\\ud800: error: unknown tool")
    load_tokenizer("embedded:tiny-tool-qwen2")(content)  # encodes (it raised TypeError)
    (big,) = env.step([conversation(call("square", x=10**2500))], [{"answer": "6"}])
    assert big.observation["content"].startswith("error: square: ValueError: Exceeds the limit") and big.metrics["tool_errors"] == 1


def test_tool_env_is_a_registered_builtin_with_validated_keys() -> None:
    spec = resolve_environments(MasterConfig.model_validate({"env": {"tool": {"tools": ["calculator", "python"]}}}).env)["tool"]
    assert spec.class_path.endswith(":ToolEnvironment") and spec.kwargs["python_timeout_s"] == 5.0
    for section, message in [
        ({"tools": ["calculater"]}, "Did you mean 'calculator'"),
        ({"python_timeout_s": 0}, "greater than 0"),
        ({"answer_checker": "nowhere"}, r"answer_checker: must be one of \['integer'\] or 'module:function', got 'nowhere'"),
        ({"answer_checker": "json:dumps_nope"}, r"answer_checker: answer_checker: 'json' has no attribute"),  # not custom_reward_fn
        ({"tool": 1}, "unknown key"),
    ]:
        with pytest.raises(ConfigError, match=message):
            resolve_environments(MasterConfig.model_validate({"env": {"tool": section}}).env)


def conversation(*assistant_turns: str) -> list[dict[str, str]]:
    log = [{"role": "user", "content": "What is 347 times 28?"}]
    for turn in assistant_turns:
        log += [{"role": "assistant", "content": turn}, {"role": "tool", "content": "..."}]
    return log[:-1]


def test_tool_env_step_tool_turns_final_answers_and_counters() -> None:
    env = ToolEnvironment(tools=["calculator"])
    meta = {"answer": "9716"}
    logs = [
        conversation(call("calculator", expression="347*28") + "<|im_end|>"),  # a call: result, not terminated
        conversation(call("calculator", expression="347*28"), "9716<|im_end|>"),  # answer after the tool: reward 1
        conversation("9716"),  # direct right answer
        conversation("9717"),  # direct wrong answer
        conversation("<tool_call>{oops</tool_call>"),  # malformed: error observation, run continues
        conversation(call("calculator", expression="347*28"), call("search", query="x")),  # unknown tool, 2nd call of a user
        conversation(" ".join([call("calculator", expression="1+1")] * 5)),  # too many calls in one turn
        conversation(call("calculator", expression="1+1") + call("calculator", expression="2*3")),  # two calls: one line each
    ]
    steps = env.step(logs, [meta] * len(logs))
    assert [(s.reward, s.terminated) for s in steps] == [(0.0, False), (1.0, True), (1.0, True), (0.0, True)] + [(0.0, False)] * 4
    assert steps[0].observation == {"role": "tool", "content": "9716"}
    assert all(s.observation is None for s in steps[1:4])
    assert steps[4].observation["content"].startswith("error: malformed JSON")
    assert steps[5].observation["content"] == "error: unknown tool 'search'; available: calculator"
    assert steps[6].observation["content"] == "error: 5 tool calls in one turn; at most 4"
    assert steps[7].observation["content"] == "calculator: 2\ncalculator: 6"
    assert [s.metrics for s in steps] == [
        {"tool_calls": c, "tool_errors": e} for c, e in [(1, 0), (0, 0), (0, 0), (0, 0), (1, 1), (1, 1), (5, 1), (2, 0)]
    ]
    assert env.metrics() == {
        "tool_calls": 10.0,  # 1 + 1 (malformed) + 1 (unknown) + 5 + 2: calls the model made (the over-limit turn runs none)
        "tool_errors": 3.0,
        "tool_timeouts": 0.0,
        "tool_memory_errors": 0.0,
        "tool_outputs_cut": 0.0,
        "malformed_calls": 1.0,
        "unknown_tools": 1.0,
        "samples": 6.0,  # first turns: all logs but 1 and 5
        "samples_using_tool": 4.0,  # the first call of logs 0, 4, 6, 7 (logs 1 and 5 called earlier)
        "final_answers": 3.0,
        "correct": 2.0,
        "checker_errors": 0.0,
        "tool_turns_not_run": 0.0,  # no sample was in its final turn (metadata without FINAL_TURN)
    }
    assert env.metrics()["tool_calls"] == 0.0  # reset after reading
    assert env.score(["9716", call("calculator", expression="1")], [meta, meta]) == [1.0, 0.0]


def test_tool_turns_of_a_batch_run_concurrently_and_report_in_sample_order(tmp_path) -> None:
    """Each sample's tool turn waits at a 4-party barrier: run one at a time (as before), the first would wait alone
    until the barrier's timeout broke it and every call failed; with max_parallel_calls=4 all four meet. A sample's
    results and counters stay its own, in sample order; max_parallel_calls=1 keeps user tools one at a time."""
    (tmp_path / "meeting.py").write_text(
        "import threading\nBARRIER = threading.Barrier(4, timeout=20)\n"
        "def meet(tag: str) -> str:\n    BARRIER.wait()\n    return tag.upper()\n"
    )
    tool = f"{tmp_path}/meeting.py:meet"
    env = ToolEnvironment(tools={"meet": tool}, max_parallel_calls=4)
    logs = [conversation(call("meet", tag=f"s{i}")) for i in range(4)] + [conversation("9716")]
    steps = env.step(logs, [{"answer": "9716"}] * 5)
    assert [s.observation["content"] for s in steps[:4]] == ["S0", "S1", "S2", "S3"] and steps[4].reward == 1.0
    assert [s.metrics for s in steps[:4]] == [{"tool_calls": 1, "tool_errors": 0}] * 4
    assert env.metrics()["tool_calls"] == 4.0
    assert ToolEnvironment(tools={"meet": tool}, max_parallel_calls=1).max_parallel_calls == 1


def test_a_tool_turn_in_the_samples_final_turn_is_not_run(tmp_path) -> None:
    """metadata[FINAL_TURN]: the run ends the sample after this step, so its calls' results would never be read. They
    are not run (a python snippet looping to its timeout cost seconds for nothing): reward 0, terminated, counted; a
    final answer in the final turn is scored as ever."""
    ran = tmp_path / "ran.txt"
    (tmp_path / "tally.py").write_text(f"def note(tag: str) -> str:\n    open({str(ran)!r}, 'a').write(tag)\n    return tag\n")
    env = ToolEnvironment(tools={"note": f"{tmp_path}/tally.py:note"})
    logs = [conversation(call("note", tag="a")), conversation(call("note", tag="b")), conversation("9716")]
    metas = [{"answer": "9716", FINAL_TURN: final} for final in (False, True, True)]
    steps = env.step(logs, metas)
    # The run ends sample 1, not the environment (a sample out of room then still counts as length-truncated).
    assert [(s.reward, s.terminated) for s in steps] == [(0.0, False), (0.0, False), (1.0, True)]
    assert steps[0].observation == {"role": "tool", "content": "a"} and steps[1].observation is None
    # The call was made, so it counts in tool_calls as in samples_using_tool (tool_calls_sample_fraction agrees)
    assert steps[1].metrics == {"tool_calls": 1.0, "tool_errors": 0.0, "tool_turns_not_run": 1.0}
    assert ran.read_text() == "a"
    counters = env.metrics()
    assert (counters["tool_calls"], counters["tool_turns_not_run"], counters["samples_using_tool"]) == (2.0, 1.0, 2.0)


def test_python_limits_without_the_python_tool_warn() -> None:
    (line,) = ToolEnvironment.config_warnings("tool", {"tools": ["calculator"], "python_timeout_s": 60, "python_memory_mb": 512}, 3)
    assert line.startswith("env.tool.python_memory_mb, env.tool.python_timeout_s has no effect: env.tool.tools has no 'python'")
    assert ToolEnvironment.config_warnings("tool", {"tools": {"py": "python"}, "python_timeout_s": 60}, 3) == []
    assert ToolEnvironment.config_warnings("tool", {"tools": ["calculator"]}, 3) == []
    # The settings as the run hands them on (the validated dump, every default present) name no limit nobody set: every
    # multi-turn run without the python tool warned about all three
    dumped = check_constructor_kwargs(ToolEnvironment, {"tools": ["calculator"]}, "env.tool")
    assert "python_timeout_s" in dumped and ToolEnvironment.config_warnings("tool", dumped, 3) == []


def test_tool_use_counters_skip_a_few_shot_exchange_in_the_prompt() -> None:
    """A prompt demonstrating a tool call (assistant call, tool result, assistant answer, then the question): the
    counters read the whole log, so no turn was a first turn or a first call (samples_using_tool / samples was 0/0)."""
    shot = [{"role": "user", "content": "What is 2 times 3?"}, {"role": "assistant", "content": call("calculator", expression="2*3")},
            {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]  # fmt: skip
    env = ToolEnvironment()
    first = [*shot, *conversation(call("calculator", expression="347*28"))]
    second = [*first, {"role": "tool", "content": "9716"}, {"role": "assistant", "content": "9716"}]
    env.step([first], [{"answer": 9716}])
    env.step([second], [{"answer": 9716}])
    counters = env.metrics()
    assert (counters["samples"], counters["samples_using_tool"], counters["correct"]) == (1.0, 1.0, 1.0)


def test_tool_env_custom_answer_checker(tmp_path) -> None:
    (tmp_path / "checkers.py").write_text("def contains(text, answer):\n    return float(str(answer) in text)\n")
    env = ToolEnvironment(answer_checker=f"{tmp_path}/checkers.py:contains")
    (step,) = env.step([conversation("The answer is 9716.")], [{"answer": 9716}])
    assert step.reward == 1.0 and step.terminated
    assert json.loads(json.dumps(env.metrics()))["correct"] == 1.0
    # A checker that raises on a model's text (int("about 5")) scores it 0, counted: it stopped the training step
    (tmp_path / "strict.py").write_text("def exact(text, answer):\n    return float(int(text.strip()) == int(answer))\n")
    strict = ToolEnvironment(answer_checker=f"{tmp_path}/strict.py:exact")
    steps = strict.step([conversation("5"), conversation("about 5")], [{"answer": 5}, {"answer": 5}])
    assert [s.reward for s in steps] == [1.0, 0.0] and all(s.terminated for s in steps)
    counters = strict.metrics()
    assert counters["checker_errors"] == 1.0 and counters["correct"] == 1.0
    # A NaN (a model's "nan" through float()) is the checker failing too: it became the reward and failed the whole step
    (tmp_path / "close.py").write_text("def close(text, answer):\n    return max(1 - abs(float(text) - answer) / 100, 0.0)\n")
    near = ToolEnvironment(answer_checker=f"{tmp_path}/close.py:close")
    steps = near.step([conversation("5"), conversation("nan")], [{"answer": 5}, {"answer": 5}])
    assert [s.reward for s in steps] == [1.0, 0.0] and near.metrics()["checker_errors"] == 1.0
