"""The tool environment (built-in ``tool``): the model answers, or first calls tools and reads their results.

Per step and sample, the model's latest turn (``message_logs[i][-1]``) decides:

* it holds a ``<tool_call>`` (well-formed or not): every call is run through the
  :class:`~nemo_like.environments.tools.registry.ToolRegistry`; the observation is
  ``{"role": "tool", "content": ...}`` with the result (several calls: one ``name: result`` line each; a failed
  call's text starts with ``error: ``); reward 0, not terminated. A turn with more than
  ``max_calls_per_turn`` calls gets one error observation instead. In the sample's final turn
  (``metadata[FINAL_TURN]``: the run ends the sample after this step) the calls are not run, since no turn would
  read their results: reward 0, no observation, counted in ``tool_turns_not_run`` (and in ``tool_calls``: the model
  made them);
* it holds no tool call: it is the final answer, scored by the answer checker against
  ``metadata["answer"]`` and the episode terminates.

Answer checkers: ``integer`` (the arithmetic task's exact integer match,
:func:`~nemo_like.environments.arithmetic_reward.score_response`) or ``'module:function'`` with signature
``(response_text, answer) -> float``. Nothing here raises on model output; failures are observations and
counters (:meth:`ToolEnvironment.metrics`). Each step also carries per-sample ``metrics``
(``tool_calls``, ``tool_errors``), which the rollout logs as ``multi_turn/tool_calls_per_sample`` and
``multi_turn/tool_calls_sample_fraction`` (the share of samples that called a tool).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nemo_like.config.sections.base import changed_from_defaults
from nemo_like.config.types import Float, Int
from nemo_like.environments.arithmetic import import_reward_fn
from nemo_like.environments.arithmetic_reward import _strip_end_markers, not_an_integer, score_response
from nemo_like.environments.interface import CORRECT_REWARD, FINAL_TURN, EnvironmentInterface, EnvironmentStep
from nemo_like.environments.tools.parsing import ToolCallError, has_tool_call, parse_tool_calls
from nemo_like.environments.tools.registry import ToolRegistry

#: Counters reported by :meth:`ToolEnvironment.metrics` (every key, every call).
COUNTERS = (
    "tool_calls",
    "tool_errors",
    "tool_timeouts",
    "tool_memory_errors",
    "tool_outputs_cut",
    "malformed_calls",
    "unknown_tools",
    "samples",
    "samples_using_tool",
    "final_answers",
    "correct",
    "checker_errors",
    "tool_turns_not_run",
)
ANSWER_CHECKERS = ("integer",)


def _own_turns(log: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages after the prompt's: after its last user message (tool results are role ``tool``)."""
    last_user = max((i for i, m in enumerate(log) if m.get("role") == "user"), default=-1)
    return log[last_user + 1 :]


class ToolEnvConfig(BaseModel):
    """Keys of a tool environment's section (``env.<task>`` with ``class: tool``)."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] | dict[str, str] = Field(
        default_factory=lambda: ["calculator"],
        description="Tools offered: built-in names ('calculator', 'python') and/or 'module:function' / 'file.py:function' paths; "
        "a mapping {name: spec} names them explicitly.",
    )
    answer_checker: str = Field(
        "integer",
        description="Scores the final answer: 'integer' (exact integer match) or 'module:function' (response_text, answer) -> float.",
    )
    tools_in_prompt: bool = Field(
        True,
        description="Hand the tools' JSON schemas to the chat template with each prompt (apply_chat_template's tools=), "
        "which lists them for the model where the template renders tools (Qwen 2.5/3, Llama 3.1+, Hermes); false: the "
        "prompt as the data writes it (a model that learned its tools in training, or a system prompt that describes them).",
    )
    max_calls_per_turn: Int = Field(4, ge=1, description="More tool calls than this in one turn give one error observation.")
    max_parallel_calls: Int = Field(
        8,
        ge=1,
        description="Samples whose tool calls run at the same time (each python call is a process of its own); a sample's "
        "own calls run in order. A user tool ('module:function') must be thread-safe, or set 1.",
    )
    python_timeout_s: Float = Field(5.0, gt=0, le=300, description="python tool: wall-clock limit per call (seconds).")
    python_memory_mb: Int = Field(256, ge=32, le=65536, description="python tool: address-space limit of the sandbox process (MiB).")
    python_max_output_bytes: Int = Field(4096, ge=16, le=1 << 20, description="python tool: stdout larger than this is an error.")

    @field_validator("answer_checker")
    @classmethod
    def _checker_importable(cls, value: str) -> str:
        if value not in ANSWER_CHECKERS and ":" not in value:
            raise ValueError(f"must be one of {sorted(ANSWER_CHECKERS)} or 'module:function', got {value!r}")
        if value not in ANSWER_CHECKERS:
            import_reward_fn(value, "answer_checker")  # a ConfigError in the driver, not in an actor
        return value

    @field_validator("tools")
    @classmethod
    def _some_tool(cls, value: list[str] | dict[str, str]) -> list[str] | dict[str, str]:
        if not value:
            raise ValueError("offer at least one tool (e.g. ['calculator']): with none, every call is an unknown tool")
        return value

    def model_post_init(self, _context: Any) -> None:
        ToolRegistry.from_config(self.tools, "tools", **self.sandbox_settings())  # unknown tool names fail in the driver

    def sandbox_settings(self) -> dict[str, Any]:
        """The python tool's limits, as :meth:`ToolRegistry.from_config` takes them."""
        return {
            "python_timeout_s": self.python_timeout_s,
            "python_memory_mb": self.python_memory_mb,
            "python_max_output_bytes": self.python_max_output_bytes,
        }


def _calls_tool(message: dict[str, str]) -> bool:
    return message.get("role") == "assistant" and has_tool_call(message.get("content", ""))


def encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate from a JSON ``\\ud800`` in a call's name, or a tool's
    result) written as its backslash escape: the tokenizer raised on it, ending the whole rollout."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ToolEnvironment(EnvironmentInterface):
    """See the module docstring."""

    config_model = ToolEnvConfig

    @classmethod
    def answer_problem(cls, settings: dict[str, Any], answer: Any) -> str | None:
        """The 'integer' answer checker compares integers; a user checker takes any answer."""
        if settings.get("answer_checker", "integer") != "integer":
            return None
        return not_an_integer(answer, "env.<task>.answer_checker 'integer' compares integers; set a 'module:function' for other answers")

    @classmethod
    def prompt_tools(cls, settings: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The offered tools' schemas (:meth:`ToolRegistry.schemas`), unless ``tools_in_prompt`` is false."""
        cfg = ToolEnvConfig.model_validate(settings)
        return ToolRegistry.from_config(cfg.tools, "tools", **cfg.sandbox_settings()).schemas() if cfg.tools_in_prompt else None

    def __init__(self, **kwargs: Any) -> None:
        cfg = ToolEnvConfig.model_validate(kwargs)
        self.registry = ToolRegistry.from_config(cfg.tools, "tools", **cfg.sandbox_settings())
        self.max_calls_per_turn = cfg.max_calls_per_turn
        self.max_parallel_calls = cfg.max_parallel_calls
        self.checker: Callable[[str, Any], float] = (
            score_response if cfg.answer_checker == "integer" else import_reward_fn(cfg.answer_checker, "answer_checker")
        )
        self._counts = dict.fromkeys(COUNTERS, 0.0)

    @classmethod
    def reply_roles(cls, settings: dict[str, Any]) -> tuple[str, ...]:
        """A tool's: its observations are the tools' results."""
        return ("tool",)

    @classmethod
    def config_warnings(cls, task: str, settings: dict[str, Any], max_rollout_turns: int) -> list[str]:
        """The ``python_*`` limits set while no tool is the built-in ``python`` sandbox."""
        cfg = ToolEnvConfig.model_validate(settings)
        limits = sorted(k for k in changed_from_defaults(cfg) if k.startswith("python_"))
        names = cfg.tools.values() if isinstance(cfg.tools, dict) else cfg.tools
        if not limits or "python" in names:
            return []
        keys = ", ".join(f"env.{task}.{k}" for k in limits)
        return [f"{keys} has no effect: env.{task}.tools has no 'python' tool (the limits are the python sandbox's)"]

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        """Single-turn use: score each response as a final answer (tool calls in it earn nothing)."""
        return [self._final(text, meta) for text, meta in zip(responses, metadata)]

    def _final(self, text: str, meta: dict[str, Any]) -> float:
        self._counts["final_answers"] += 1
        if has_tool_call(text):
            return 0.0
        try:
            reward = float(self.checker(text, meta["answer"]))
            if not math.isfinite(reward):  # a model's "nan" through float(): it failed the whole step's reward check
                raise ValueError(f"returned {reward}, not a finite reward")
        except Exception as exc:  # noqa: BLE001 - a user checker failing on a model's text scores it 0, counted
            if not self._counts["checker_errors"]:
                print(f"[env] answer_checker raised {type(exc).__name__}: {str(exc)[:200]} (scored 0; counted in checker_errors)")
            self._counts["checker_errors"] += 1
            return 0.0
        self._counts["correct"] += reward >= CORRECT_REWARD
        return reward

    def step(self, message_logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]) -> list[EnvironmentStep]:
        """One turn of every sample: final answers are scored; the samples' tool turns run concurrently, at most
        ``max_parallel_calls`` at a time (a python call is a process of its own: one at a time, a batch whose snippets
        loop until their timeout took minutes)."""
        steps: list[EnvironmentStep | None] = []
        tool_turns: list[tuple[int, str]] = []
        for log, meta in zip(message_logs, metadata):
            text = _strip_end_markers(log[-1]["content"]) if log else ""
            own = _own_turns(log)  # not the prompt's messages (a few-shot tool exchange kept both counters at 0)
            if sum(m.get("role") == "assistant" for m in own) <= 1:
                self._counts["samples"] += 1  # the sample's first turn: share using a tool = samples_using_tool / samples
            if not has_tool_call(text):
                steps.append(EnvironmentStep(self._final(text, meta), terminated=True, metrics={"tool_calls": 0.0, "tool_errors": 0.0}))
                continue
            if not any(_calls_tool(m) for m in own[:-1]):
                self._counts["samples_using_tool"] += 1
            if meta.get(FINAL_TURN):  # the run ends this sample after this step: nothing would read the results
                # The calls the model made still count (tool_calls, as in samples_using_tool); the run, not this
                # environment, ends the sample (so a sample out of room is still counted as length-truncated).
                made = float(len(parse_tool_calls(text)))
                self._counts["tool_calls"] += made
                self._counts["tool_turns_not_run"] += 1
                not_run = {"tool_calls": made, "tool_errors": 0.0, "tool_turns_not_run": 1.0}
                steps.append(EnvironmentStep(0.0, terminated=False, metrics=not_run))
                continue
            tool_turns.append((len(steps), text))
            steps.append(None)
        if tool_turns:
            with ThreadPoolExecutor(min(self.max_parallel_calls, len(tool_turns))) as pool:
                outcomes = list(pool.map(self._run_calls, [text for _, text in tool_turns]))
            for (index, _), (content, counts) in zip(tool_turns, outcomes):
                for key, value in counts.items():
                    self._counts[key] += value
                per_sample = {"tool_calls": counts["tool_calls"], "tool_errors": counts["tool_errors"]}
                steps[index] = EnvironmentStep(0.0, terminated=False, observation={"role": "tool", "content": content}, metrics=per_sample)
        return [step for step in steps if step is not None]

    def _run_calls(self, text: str) -> tuple[str, Counter[str]]:
        """The observation for one turn's calls and the counters they add (summed by :meth:`step`, in sample order)."""
        counts: Counter[str] = Counter(tool_calls=0, tool_errors=0)
        calls = parse_tool_calls(text)
        if len(calls) > self.max_calls_per_turn:  # none runs, but the model made them (as a final turn counts them)
            counts["tool_calls"] += len(calls)
            counts["tool_errors"] += 1
            return f"error: {len(calls)} tool calls in one turn; at most {self.max_calls_per_turn}", counts
        lines = []
        for call in calls:
            counts["tool_calls"] += 1
            if isinstance(call, ToolCallError):
                counts["tool_errors"] += 1
                counts["malformed_calls"] += 1
                lines.append(("tool_call", f"error: {call.message}"))
                continue
            result = self.registry.call(call.name, call.arguments)
            if result.cut:
                counts["tool_outputs_cut"] += 1
            if not result.ok:
                counts["tool_errors"] += 1
                kind_counter = {"timeout": "tool_timeouts", "memory": "tool_memory_errors", "unknown_tool": "unknown_tools"}
                if result.error_kind in kind_counter:
                    counts[kind_counter[result.error_kind]] += 1
            lines.append((call.name, result.text if result.ok else f"error: {result.text}"))
        text = lines[0][1] if len(lines) == 1 else "\n".join(f"{name}: {text}" for name, text in lines)
        return encodable(text), counts

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, dict.fromkeys(COUNTERS, 0.0)
        return counts
