"""The environment contract: score responses, one reward per response.

An environment is a plain Python class; the run hosts it in Ray actors (``env.<task>.num_workers`` of
them, see :mod:`nemo_like.environments.worker`) and sends it the responses of its task only (samples
are routed by ``metadata["task_name"]``, see :mod:`nemo_like.environments.registry`).

Constructor: receives the keys of its config section (``env.<task>``) other than ``class`` and
``num_workers`` as keyword arguments. A class may declare ``config_model`` (a pydantic model) to have
those keys validated in the driver before any actor starts.

Rewards: a sample counts as *correct* (accuracy, pass@k) when its reward is at least
:data:`CORRECT_REWARD`; shaping bonuses (e.g. a format reward) must stay below it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel

from nemo_like.plan.multi_turn import ANY_REPLY_ROLES

#: Reward at or above which a sample counts as correct (accuracy and pass@k).
CORRECT_REWARD = 1.0
#: Key of the metadata a multi-turn step receives: ``True`` when the run ends the sample after this step whatever the
#: environment answers (the last of ``grpo.max_rollout_turns``, a turn cut by its token budget, or a sequence with no
#: room left for an observation and one more sampled token), so an observation would never be read (the tool
#: environment then does not run the turn's calls). Not kept in the sample's metadata.
FINAL_TURN = "final_turn"
#: CPU an environment actor reserves unless its class says otherwise (most environments mostly wait).
DEFAULT_ENV_CPUS = 0.1


#: How long an environment's own helper actors (a judge's engines) may wait for their placement: the run's
#: ``cluster.placement_timeout_s``, set in each environment actor before its environment is built
#: (:class:`~.worker.EnvironmentWorker`); the default where no run set it (an environment built in a test or a tool).
HELPER_PLACEMENT = {"timeout_s": 60.0}

#: Counter names the run keeps for itself (``env/<task>/reward`` over the trained samples and ``num_samples``, their
#: count; a composite's per-source ones; ``reward_sum`` would derive a ``reward`` of its own,
#: :func:`~nemo_like.experience.rollouts.env_metrics_with_means`): an environment's or a reward source's ``metrics()``
#: may not use them.
RESERVED_COUNTERS = frozenset({"reward", "num_samples", "reward_sum"})


# The turn loop's own step counters (:mod:`nemo_like.experience.multi_turn`), summed per row like an environment's
# ``EnvironmentStep.metrics``:
#: Step counter (``multi_turn/foreign_end_of_turn_per_sample`` and ``_sample_fraction``): branches (:func:`start_row`)
#: where a turn ended on an end-of-turn id the chat template does not write back (Qwen's ``<|endoftext|>`` beside
#: ``<|im_end|>``) and the environment went on.
FOREIGN_END = "foreign_end_of_turn"
#: Step counter (``multi_turn/template_whitespace_rewrite_per_sample``): branches where the chat template writes the
#: last turn back with other whitespace around its content than the sequence holds (``| trim``: Llama 3.x, Gemma,
#: Mistral; a space it adds: Mistral's and Llama 2's).
WHITESPACE_REWRITE = "template_whitespace_rewrite"
#: Step counter (``multi_turn/template_rewrite_per_sample``): branches where the chat template renders the conversation
#: so far otherwise than the sequence holds it (Qwen3's and DeepSeek-R1's drop earlier turns' reasoning once a user
#: message follows; Mistral's move the system message).
TEMPLATE_REWRITE = "template_rewrite"
#: Step counter (``multi_turn/observation_dropped_for_length_per_sample``): observations built by an environment
#: told the turn was not final, then dropped because they did not fit ``policy.max_total_sequence_length``.
OBSERVATION_DROPPED = "observation_dropped_for_length"
#: Step metric names an environment's ``EnvironmentStep.metrics`` may not use: the loop's counters above and the names
#: whose ``multi_turn/<name>_per_sample`` the loop logs itself (rows and observation tokens per episode).
RESERVED_STEP_METRICS = frozenset({FOREIGN_END, WHITESPACE_REWRITE, TEMPLATE_REWRITE, OBSERVATION_DROPPED, "rows", "observation_tokens"})


def preview(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters: enough to find a sample in the data."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def as_number(value: Any, who: str, what: str) -> float:
    """``float(value)``, or a ValueError naming ``who`` (an environment, a composite's source) and ``what`` (a None
    reward was a bare TypeError from float(), naming neither)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{who} returned {preview(value)}, not a number, as a {what}") from None


def check_finite_rewards(who: str, rewards: list[float], responses: list[str], metadata: list[dict[str, Any]]) -> None:
    """``ValueError`` naming ``who`` (an environment, a composite's source) and the first sample when a reward is NaN or
    infinite (a weight-0 source's NaN still made its composite's reward NaN: ``0 * nan`` is NaN)."""
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        first = bad[0]
        raise ValueError(
            f"{who} returned non-finite rewards for {len(bad)} of {len(responses)} responses, e.g. "
            f"{rewards[first]} for response {preview(responses[first])} (metadata {preview(metadata[first])})"
        )


@dataclass(frozen=True)
class HelperActors:
    """Actors that each environment actor starts for itself (e.g. a judge's generation engine): ``count`` per
    environment actor, each reserving ``num_cpus`` / ``num_gpus``; the capacity check counts them as role
    ``<role>:<task>``."""

    role: str
    count: int
    num_cpus: float
    num_gpus: float = 0.0


@dataclass(frozen=True)
class ActorNeeds:
    """What each actor of an environment reserves, and the helper actors it starts (:meth:`EnvironmentInterface.actor_needs`)."""

    num_cpus: float = DEFAULT_ENV_CPUS
    num_gpus: float = 0.0
    helpers: tuple[HelperActors, ...] = ()


@dataclass(frozen=True)
class EnvironmentStep:
    """One environment turn for one sample (NeMo-RL's shape).

    * ``reward``: reward of this turn; a sample's reward is the sum over its turns.
    * ``terminated``: the episode ended (no further model turn).
    * ``observation``: message appended before the next model turn, e.g. ``{"role": "tool", "content": "42"}``
      (``None`` when terminated or when there is nothing to say).
    * ``metadata``: the sample's updated metadata for the next turn (``None`` keeps it unchanged).
    * ``stop_strings``: extra stop strings for the sample's next model turn, besides the recipe's own
      (``policy.generation.stop_strings``); ``None``: only the recipe's.
    * ``metrics``: per-sample numbers of this step, e.g. ``{"tool_calls": 1.0, "tool_errors": 0.0}``; summed over a
      sample's steps, the run logs their mean per sample (``multi_turn/<name>_per_sample``) and the share of samples
      where the sum is non-zero (``multi_turn/<name>_sample_fraction``).
    """

    reward: float
    terminated: bool = True
    observation: dict[str, str] | None = None
    metadata: dict[str, Any] | None = None
    stop_strings: list[str] | None = None
    metrics: dict[str, float] | None = None


class EnvironmentInterface(ABC):
    """A reward function behind Ray actors. Rewards are finite floats; built-in tasks use 0/1."""

    #: Optional pydantic model validating the constructor's keyword arguments (the env's config section).
    config_model: ClassVar[type[BaseModel] | None] = None

    @classmethod
    def actor_needs(cls, settings: dict[str, Any]) -> ActorNeeds:
        """What each actor hosting this environment reserves, given its validated section ``settings`` (the
        constructor's keyword arguments). The default: :data:`DEFAULT_ENV_CPUS` and no helper actors."""
        return ActorNeeds()

    @classmethod
    def config_warnings(cls, task: str, settings: dict[str, Any], max_rollout_turns: int) -> list[str]:
        """Lines for keys of the section ``env.<task>`` (``settings``: the constructor's keyword arguments as the recipe
        sets them) that have no effect in this run (printed at start-up, never an error). The default: none."""
        return []

    @classmethod
    def reply_roles(cls, settings: dict[str, Any]) -> tuple[str, ...]:
        """The roles of the observations this environment's ``step`` returns, given its section ``settings``. Where a
        sample's sequence is full, the turn loop tells the environment the turn is final unless a reply of one of these
        roles would make the chat template rewrite the history into a new row with room (a Qwen3-style template does
        for a user's reply, not for a tool's). The default: a user's or a tool's (not known)."""
        return ANY_REPLY_ROLES

    @classmethod
    def prompt_tools(cls, settings: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The JSON schemas of the tools this environment's prompts offer (``settings``: its section's keyword
        arguments), handed to the chat template with each of its prompts (``apply_chat_template(..., tools=...)``) so
        the model reads them; ``None`` (the default): the prompts as the data writes them."""
        return None

    @classmethod
    def answer_problem(cls, settings: dict[str, Any], answer: Any) -> str | None:
        """Why a prompt's gold answer (``metadata["answer"]``) is one this environment cannot score against, given its
        section ``settings``; ``None`` when it can. Checked for every prompt before any actor starts (a bad answer
        scored 0 for the whole run, or failed an actor at a random step). The default: any answer."""
        return None

    @abstractmethod
    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        """Reward of ``responses[i]`` given the prompt's ``metadata[i]`` (gold answer in ``metadata[i]["answer"]``)."""

    def metrics(self) -> dict[str, float]:
        """Counters accumulated since the previous call, then reset (e.g. ``{"timeouts": 2.0}``).

        Called right after each :meth:`score` (or :meth:`step`, in multi-turn runs) on the same actor; the run
        logs them summed over actors as ``env/<task>/<name>``. The default reports nothing."""
        return {}

    def step(self, message_logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]) -> list[EnvironmentStep]:
        """Multi-turn hook: one :class:`EnvironmentStep` per sample. ``message_logs[i]`` is the sample's
        conversation so far (OpenAI-style messages, the model's latest turn last); ``metadata[i]`` its
        metadata (as updated by earlier steps), with ``metadata[i][FINAL_TURN]`` set (:data:`FINAL_TURN`). The
        default is the single-turn case: score the last message with :meth:`score` and terminate. Multi-turn environments override it; single-turn ones need not.
        Used when ``grpo.max_rollout_turns > 1`` (docs/guides/multi-turn.md); with 1 the run calls :meth:`score`."""
        responses = [conversation[-1]["content"] if conversation else "" for conversation in message_logs]
        return [EnvironmentStep(reward) for reward in self.score(responses, metadata)]
