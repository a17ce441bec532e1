"""The LLM-as-judge environment (``class: judge``): a judge model reads each (prompt, response) through a template,
writes a verdict, a parser turns the verdict into a score, and the score (normalised per sample,
:mod:`.score_normalization`) is the reward.

* Template (:mod:`.judge_template`): ``template`` inline or ``template_file``, a format string or Jinja
  (``template_format``), rendered as the judge's user turn through its chat template (``use_chat_template``).
* Engine (:mod:`.judge_engine`): the judge model in its own generation actors (the HF backend's worker), greedy by
  default, with a ``deadline_s`` per step.
* Parser (:mod:`.judge_parsers`): ``number``, ``regex``, ``json_field`` or ``'module:function'``, with
  ``parser_options``.
* Cache: identical judge prompts within one call (a step's responses of this actor) are judged once.
* Failures never crash the run: a verdict the parser cannot read, a deadline passed or an engine failure gives the
  sample ``parse_failure_reward`` and is counted.

Counters (``env/<task>/<name>``, summed over actors): ``judged`` (prompts sent to the engine), ``cache_hits``,
``parse_failures``, ``template_errors`` (a sample lacking a metadata key the template reads), ``timeouts`` and
``engine_errors`` (samples whose judge prompt passed the deadline, or was lost to a failed actor), ``engine_restarts``,
``truncated`` (judge prompts
whose response lost its middle to fit the judge model), ``prompt_missing``, ``out_of_range`` (verdicts outside
``score_range``), ``scored``, ``score_sum`` (parsed scores, before normalisation).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.config.sections.base import changed_from_defaults
from nemo_like.config.types import Float, Int
from nemo_like.environments.interface import HELPER_PLACEMENT, ActorNeeds, EnvironmentInterface, HelperActors
from nemo_like.environments.judge_engine import JudgeEngine, JudgeEngineSpec
from nemo_like.environments.judge_parsers import resolve_parser
from nemo_like.environments.judge_template import DEFAULT_SCORE_RANGE, JudgeTemplate, TemplateFormat, load_template_text
from nemo_like.environments.learned_inputs import ModelName, cut_from_left, prompt_of
from nemo_like.environments.score_normalization import ScoreNormalization
from nemo_like.environments.scored_text import chat_ids_of_untrusted_text, control_token_ids, ids_of_pieces, template_pieces
from nemo_like.models.generation.interface import SamplingParams
from nemo_like.models.generation.lean_decoder import model_sampling_problem
from nemo_like.models.loading import local_config_file, policy_model
from nemo_like.utils.seeds import judge_seed

COUNTERS = (
    "judged",
    "cache_hits",
    "parse_failures",
    "out_of_range",
    "template_errors",
    "timeouts",
    "engine_errors",
    "engine_restarts",
    "truncated",
    "prompt_missing",
    "scored",
    "score_sum",
)


#: Stand-ins for a judge template's fields while its own text is found (private-use characters: in no template).
_FIELD_MARK = "\ue000judge-field-{}\ue001"


class JudgeEnvConfig(BaseModel):
    """Keys of a judge section (``env.<task>`` with ``class: judge``)."""

    model_config = ConfigDict(extra="forbid")

    model_name: ModelName = Field(
        "embedded:tiny-arith-qwen2", description="The judge model (a causal LM): hub id, local directory or shipped name."
    )
    precision: str = Field("float32", pattern="^(float32|bfloat16)$", description="The judge's dtype.")
    template: str | None = Field(None, description="Inline template (see template_format); null: template_file or the default.")
    template_file: str | None = Field(None, description="File holding the template (instead of template).")
    template_format: TemplateFormat = Field("format", description="'format': Python str.format fields; 'jinja': a Jinja template.")
    use_chat_template: bool = Field(True, description="Send the rendered template as a user turn through the judge's chat template.")
    parser: str = Field("number", description="Verdict parser: 'number', 'regex', 'json_field' or 'module:function'.")
    parser_options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the parser (regex: pattern, group; ...)."
    )
    parse_failure_reward: Float = Field(
        0.0,
        description="Reward of a sample whose verdict is unreadable, out of score_range, late, or lost to an engine failure.",
    )
    score_range: tuple[Float, Float] | None = Field(
        None,
        description="[low, high] of the scale the template asks for: a parsed score outside it is unreadable "
        "(parse_failure_reward, counted out_of_range); null: the default template's 0-10, no bound with your own template.",
    )
    normalize: ScoreNormalization = Field(default_factory=ScoreNormalization, description="Parsed score -> reward (per sample).")
    max_new_tokens: Int = Field(16, gt=0, description="Longest verdict.")
    greedy: bool = Field(True, description="Greedy verdicts (deterministic); false samples at temperature.")
    temperature: Float = Field(1.0, gt=0, description="Sampling temperature when greedy is false.")
    seed: Int = Field(
        0, description="Sampling seed (greedy: false): each judge prompt is read with a hash of it and this (utils/seeds.py judge_seed)."
    )
    deadline_s: Float = Field(
        60.0,
        ge=0.001,
        description="Seconds a step waits for the judge (Ray waits in whole milliseconds); later verdicts count as timeouts.",
    )
    max_batch_size: Int = Field(16, gt=0, description="Judge prompts per engine call (a deadline keeps the chunks done in time).")
    num_engine_workers: Int = Field(1, gt=0, description="Generation actors of the judge (per environment actor).")
    engine_num_cpus: Float = Field(0.25, gt=0, description="CPUs each judge actor reserves.")
    engine_num_gpus: Float = Field(
        0.0,
        ge=0,
        le=1,
        description="GPUs each judge actor reserves (its engine runs on one GPU: at most 1; a share below 1 packs several).",
    )
    engine_num_threads: Int = Field(1, gt=0, description="torch threads of each judge actor on CPU.")
    engine_backend: Literal["hf", "vllm"] = Field(
        "hf", description="The judge's engine: 'hf' (transformers generate) or 'vllm' (vLLM, its CPU build here; faster for long verdicts)."
    )
    engine_max_model_len: Int | None = Field(
        None,
        gt=0,
        description="Longest judge prompt + verdict in tokens (longer prompts are cut from the left, counted as "
        "'truncated'); null: the judge tokenizer's model_max_length. vLLM sizes its engine with it.",
    )
    engine_kv_cache_space_gib: Int = Field(1, gt=0, description="vLLM on CPU: KV cache of each judge actor (GiB).")
    engine_gpu_memory_utilization: Float = Field(0.3, gt=0, le=1, description="vLLM on GPU: share of the device each judge actor takes.")

    @model_validator(mode="after")
    def _check(self) -> JudgeEnvConfig:
        JudgeTemplate(load_template_text(self.template, self.template_file), self.template_format)
        resolve_parser(self.parser, self.parser_options)
        if self.score_range is not None and not self.score_range[0] <= self.score_range[1]:
            raise ValueError(f"score_range must be [low, high] with low <= high, got {list(self.score_range)}")
        if self.engine_max_model_len is not None:
            check_verdict_room(self.max_new_tokens, self.engine_max_model_len, "engine_max_model_len")
        if self.engine_backend == "hf":
            # the actor refused it at every call: every sample got parse_failure_reward, the engine restarted each step
            if local_config_file(self.model_name) and (problem := model_sampling_problem(self.model_name, local_only=True)):
                raise ValueError(
                    f"engine_backend='hf' cannot sample the judge {self.model_name!r}: {problem}; engine_backend='vllm' "
                    "samples the architectures vLLM supports"
                )
            for key in changed_from_defaults(self, ("engine_kv_cache_space_gib", "engine_gpu_memory_utilization")):
                warnings.warn(f"{key} has no effect with engine_backend='hf' (a vLLM setting)", UserWarning, stacklevel=2)
        elif local_config_file(self.model_name):
            # the engine started, then failed every call: every sample got parse_failure_reward, nothing on the console
            if not self.engine_num_gpus and (problem := policy_model(self.model_name, local_only=True).vllm_cpu_problem(self.precision)):
                raise ValueError(
                    f"engine_backend='vllm' on a CPU cannot run the judge {self.model_name!r}: {problem}; use engine_backend='hf'"
                )
            tokenizer = None if self.engine_max_model_len is not None else loaded_tokenizer(self.model_name)
            if tokenizer is not None and judge_context(self, getattr(tokenizer, "model_max_length", None)) is None:
                raise ValueError(  # the environment actor refused it, after Ray and every other actor had started
                    f"the tokenizer of the judge {self.model_name!r} states no context length (model_max_length): set "
                    "engine_max_model_len for engine_backend='vllm'"
                )
        if self.greedy and self.temperature != 1.0:
            warnings.warn(
                f"temperature={self.temperature} has no effect with greedy=true (the judge decodes greedily)", UserWarning, stacklevel=2
            )
        return self

    @property
    def score_bounds(self) -> tuple[float, float] | None:
        """The scores a verdict may take: ``score_range``, else the default template's scale (no bound for another)."""
        if self.score_range is not None:
            return self.score_range
        return DEFAULT_SCORE_RANGE if self.template is None and self.template_file is None else None


def with_special_tokens(tokenizer: Any, ids: list[int]) -> list[int]:
    """``ids`` with the special tokens ``tokenizer`` adds around a text (a BOS, CLS ... SEP), as ``tokenizer(text)``
    would give them (transformers 5's tokenizers have no ``build_inputs_with_special_tokens``)."""
    from nemo_like.models.loading import added_around

    before, after = added_around(tokenizer)
    return [*before, *ids, *after]


def plain_template_ids(
    template: JudgeTemplate, tokenizer: Any, text: str, prompt: str, response: str, metadata: dict[str, Any]
) -> list[int]:
    """``text`` (``template`` rendered for one sample, no chat template) as ids: the template's own text tokenized as
    usual (chat markup written in it is real: use_chat_template=false is how a template writes its own; it had been
    read as plain text too), the sample's fields as plain text (special-token strings the policy wrote stay text): the
    whole text's ids where no field forms a special token (:func:`~.scored_text.ids_of_pieces`). A template that
    transforms a field past its surrounding whitespace is tokenized whole when that forms no control token beyond the
    template's own, else read as plain text whole."""
    answer = metadata.get("answer")
    values = [prompt, response, "" if answer is None else str(answer)]
    marks = [_FIELD_MARK.format(i) for i in range(len(values))]
    marked = template.render(marks[0], marks[1], {**metadata, "answer": marks[2]})
    pieces = template_pieces(marked, text, marks, values)
    if pieces is None:  # where each field lies is unknown: whole, when it holds no control token beyond the template's own
        whole = tokenizer(text, add_special_tokens=False)["input_ids"]
        control = control_token_ids(tokenizer)
        own = sum(i in control for i in tokenizer(marked, add_special_tokens=False)["input_ids"])
        if sum(i in control for i in whole) == own:  # (a search of the fields missed what '| lower' made of them)
            return whole
        pieces = [(text, True)]
    return ids_of_pieces(tokenizer, pieces)


#: Stands where a response too long for the judge's context lost its middle.
CUT_MARK = " [...] "


def without_middle(text: str, kept: int) -> str:
    """``text`` with its middle replaced by :data:`CUT_MARK`, ``kept`` of its characters left (half from each end)."""
    if kept >= len(text):
        return text
    head = kept // 2
    return text[:head] + CUT_MARK + text[len(text) - (kept - head) :]


def check_verdict_room(max_new_tokens: int, context: int, source: str) -> None:
    """A judge prompt needs at least one token beside the verdict's ``max_new_tokens``: every prompt was cut to nothing
    (each sample an engine error at the parse-failure reward, the engine restarted every step)."""
    if max_new_tokens >= context:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for the judge's prompt in its context of {context} tokens "
            f"({source}); lower max_new_tokens or raise engine_max_model_len"
        )


def checked_context(cfg: JudgeEnvConfig, tokenizer: Any) -> int | None:
    """The judge's context (:func:`judge_context`) once it is known to hold a prompt beside the verdict; warns when
    ``use_chat_template`` has no effect (the judge's tokenizer has none)."""
    context = judge_context(cfg, getattr(tokenizer, "model_max_length", None))
    if context is not None:
        check_verdict_room(cfg.max_new_tokens, context, "engine_max_model_len, else the judge tokenizer's model_max_length")
    if cfg.use_chat_template and not tokenizer.chat_template:
        warnings.warn(
            f"use_chat_template has no effect: the judge {cfg.model_name!r}'s tokenizer has no chat template (the rendered "
            "judge template is sent as it is)",
            UserWarning,
            stacklevel=2,
        )
    return context


def loaded_tokenizer(model_name: str) -> Any:
    """The tokenizer of ``model_name``, or ``None`` where it does not load (the run's own load names the problem)."""
    from nemo_like.models.loading import load_tokenizer

    try:
        return load_tokenizer(model_name)
    except (OSError, ValueError):
        return None


def judge_context(cfg: JudgeEnvConfig, tokenizer_limit: Any) -> int | None:
    """Tokens the judge reads and writes: ``engine_max_model_len``, else the tokenizer's stated limit (``None``: none)."""
    if cfg.engine_max_model_len is not None:
        return cfg.engine_max_model_len
    return tokenizer_limit if isinstance(tokenizer_limit, int) and tokenizer_limit < 10**9 else None


def judge_engine_spec(cfg: JudgeEnvConfig, tokenizer: Any, context: int | None) -> JudgeEngineSpec:
    """The judge engine's settings. It stops on the judge's end-of-sequence ids as the run's own engines do: the
    tokenizer's eos and its ``generation_config.json``'s (Gemma-it and Llama-3-Instruct end a turn with a token listed
    only there; without it a verdict ran past its turn, and ``19`` + junk parsed as ``1919``)."""
    from nemo_like.models.loading import end_of_sequence_ids

    if cfg.engine_backend == "vllm" and context is None:
        raise ValueError(
            f"the judge {cfg.model_name!r} does not state its context length: set engine_max_model_len for engine_backend='vllm'"
        )
    return JudgeEngineSpec(
        cfg.model_name,
        cfg.precision,
        cfg.num_engine_workers,
        cfg.engine_num_cpus,
        cfg.engine_num_gpus,
        cfg.engine_num_threads,
        int(tokenizer.pad_token_id),
        tuple(end_of_sequence_ids(tokenizer, cfg.model_name)),
        placement_timeout_s=HELPER_PLACEMENT["timeout_s"],  # the run's cluster.placement_timeout_s
        backend=cfg.engine_backend,
        max_model_len=context,
        kv_cache_space_gib=cfg.engine_kv_cache_space_gib,
        gpu_memory_utilization=cfg.engine_gpu_memory_utilization,
    )


class JudgeEnvironment(EnvironmentInterface):
    """See the module docstring."""

    config_model: ClassVar[type[BaseModel]] = JudgeEnvConfig

    @classmethod
    def actor_needs(cls, settings: dict[str, Any]) -> ActorNeeds:
        cfg = JudgeEnvConfig.model_validate(settings)
        return ActorNeeds(helpers=(HelperActors("judge", cfg.num_engine_workers, cfg.engine_num_cpus, cfg.engine_num_gpus),))

    def __init__(self, **settings: Any) -> None:
        from nemo_like.models.loading import load_tokenizer

        self.cfg = cfg = JudgeEnvConfig.model_validate(settings)
        self.template = JudgeTemplate(load_template_text(cfg.template, cfg.template_file), cfg.template_format)
        self.parser = resolve_parser(cfg.parser, cfg.parser_options)
        self.tokenizer = load_tokenizer(cfg.model_name)
        context = checked_context(cfg, self.tokenizer)
        self.engine = JudgeEngine(judge_engine_spec(cfg, self.tokenizer, context), cfg.max_batch_size)
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, greedy=cfg.greedy)
        self.max_prompt_tokens = context - cfg.max_new_tokens if context is not None else None
        self._counts = dict.fromkeys(COUNTERS, 0.0)

    def judge_prompt_ids(self, response: str, metadata: dict[str, Any]) -> list[int]:
        """The token ids the judge reads for one sample (template, then the judge's chat template). Past the judge's
        context the response loses its middle (its head and its tail, where an answer usually stands, stay: the
        binary search keeps as many of its characters as fit); the question and the template's text stay whole (a
        cut from the left had dropped them, so a padded response was judged without its question). Only when they
        alone do not fit is the prompt cut from the left."""
        prompt = prompt_of(metadata)
        if prompt is None:
            self._counts["prompt_missing"] += 1
        ids = self._prompt_ids(prompt or "", response, metadata)
        limit = self.max_prompt_tokens
        if limit is None or len(ids) <= limit:
            return ids
        self._counts["truncated"] += 1
        fitting, low, high = None, 0, len(response)  # characters of the response kept
        while low <= high:
            kept = (low + high) // 2
            candidate = self._prompt_ids(prompt or "", without_middle(response, kept), metadata)
            if len(candidate) <= limit:
                fitting, low = candidate, kept + 1
            else:
                high = kept - 1
        return fitting if fitting is not None else cut_from_left(ids, limit, self.tokenizer)

    def _prompt_ids(self, prompt: str, response: str, metadata: dict[str, Any]) -> list[int]:
        text = self.template.render(prompt, response, metadata)
        tok = self.tokenizer
        if self.cfg.use_chat_template and tok.chat_template:  # the policy's text stays text (scored_text)
            return chat_ids_of_untrusted_text(tok, [{"role": "user", "content": text}], add_generation_prompt=True)
        return with_special_tokens(tok, plain_template_ids(self.template, tok, text, prompt, response, metadata))

    def verdicts(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[str | None]:
        """The judge's text for each sample (``None``: timed out or lost), each distinct judge prompt judged once."""
        keys: list[tuple[int, ...] | None] = []
        for response, meta in zip(responses, metadata):
            try:
                keys.append(tuple(self.judge_prompt_ids(response, meta)))
            except Exception:  # noqa: BLE001 - e.g. {metadata[x]} missing for this sample: a counted judge failure
                self._counts["template_errors"] += 1
                keys.append(None)
        unique = [k for k in dict.fromkeys(keys) if k is not None]
        self._counts["cache_hits"] += sum(k is not None for k in keys) - len(unique)
        self._counts["judged"] += len(unique)
        restarts_before = self.engine.restarts
        seeds = [judge_seed(self.cfg.seed, k) for k in unique]  # a verdict depends on what is judged, not on when
        result = self.engine.generate([list(k) for k in unique], self.params, seeds, self.cfg.deadline_s)
        self._counts["engine_restarts"] += self.engine.restarts - restarts_before
        failure = dict(zip(unique, result.failures))
        for k in keys:  # per sample, as the other failure counters: a cached prompt's samples all lost their verdict
            if k is not None and failure[k] is not None:
                self._counts["timeouts" if failure[k] == "timeout" else "engine_errors"] += 1
        texts = {
            k: None if ids is None else self.tokenizer.decode(ids, skip_special_tokens=True) for k, ids in zip(unique, result.responses)
        }
        return [None if k is None else texts[k] for k in keys]

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        rewards = []
        bounds = self.cfg.score_bounds
        for text in self.verdicts(responses, metadata):
            if text is None:
                rewards.append(self.cfg.parse_failure_reward)
                continue
            try:
                value = float(self.parser(text, **self.cfg.parser_options))
                if not math.isfinite(value):
                    raise ValueError(f"non-finite score {value}")
                if bounds is not None and not bounds[0] <= value <= bounds[1]:  # "2024 was a good year; 7" reads 2024
                    self._counts["out_of_range"] += 1
                    rewards.append(self.cfg.parse_failure_reward)
                    continue
                reward = self.cfg.normalize(value)  # a finite score may still normalise past float range
            except Exception:  # noqa: BLE001 - any parser failure (plug-ins included) is a counted parse failure
                self._counts["parse_failures"] += 1
                rewards.append(self.cfg.parse_failure_reward)
                continue
            self._counts["scored"] += 1
            self._counts["score_sum"] += value
            rewards.append(reward)
        return rewards

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, dict.fromkeys(COUNTERS, 0.0)
        return counts

    def close(self) -> None:
        """Release the judge's actors."""
        self.engine.shutdown()
