"""The reward-model environment (``class: reward_model``): a Hugging Face sequence-classification model scores each
(prompt, response) pair; the reward is its score, normalised per sample (:mod:`.score_normalization`).

The model lives in the environment's own actors (``env.<task>.num_workers`` of them, each with ``num_cpus`` /
``num_gpus``), loaded once, and scores in batches of at most ``max_tokens_per_batch`` padded tokens
(:mod:`.reward_model_scorer`): in float32 a sample's reward does not depend on the batch it came in, the split over
actors or the order (bfloat16 rounds differently in a padded batch). The prompt comes from the sample's metadata
(:func:`.learned_inputs.prompt_of`).

Counters (``env/<task>/<name>``, summed over actors): ``scored``, ``score_sum`` (raw scores), ``truncated``
(inputs cut to the model's ``max_length`` from the left, keeping the response and a leading CLS/BOS), ``prompt_missing``, ``batches``,
``template_errors`` (responses the model's chat template rewrites past recognition, e.g. one that drops the text before
``</think>``: not scored, they get ``template_error_reward``).
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nemo_like.config.types import Float, Int
from nemo_like.environments.interface import ActorNeeds, EnvironmentInterface
from nemo_like.environments.learned_inputs import ModelName, cut_from_left, prompt_of, resolve_reward_model_path
from nemo_like.environments.score_normalization import ScoreNormalization
from nemo_like.environments.scored_text import ContentRewrittenError

#: The shipped tiny reward model (``scripts/build_tiny_reward_model.py``).
TINY_REWARD_MODEL = "embedded:tiny-reward-qwen2"
COUNTERS = ("scored", "score_sum", "truncated", "prompt_missing", "batches", "template_errors")


class RewardModelEnvConfig(BaseModel):
    """Keys of a reward-model section (``env.<task>`` with ``class: reward_model``)."""

    model_config = ConfigDict(extra="forbid")

    model_name: ModelName = Field(
        TINY_REWARD_MODEL, description="AutoModelForSequenceClassification: a local directory, hub id or shipped name."
    )
    precision: str = Field("float32", pattern="^(float32|bfloat16)$", description="Weights and compute dtype.")
    label_index: Int = Field(0, ge=0, description="Which logit is the score (0 for a num_labels=1 model).")
    max_tokens_per_batch: Int = Field(4096, gt=0, description="Padded tokens (rows x longest row) per forward pass.")
    max_length: Int | None = Field(None, gt=0, description="Longest input; longer ones keep their last tokens. null: the model's limit.")
    use_chat_template: bool = Field(True, description="Render (prompt, response) as a user and an assistant turn; else concatenate.")
    text_pair: bool = Field(
        False,
        description="Feed (prompt, response) as the tokenizer's text pair, tokenizer(prompt, response): [CLS] prompt [SEP] "
        "response [SEP] with token type ids, as encoders trained on pairs read them (OpenAssistant's DeBERTa). "
        "Takes the chat template's place.",
    )
    normalize: ScoreNormalization = Field(default_factory=ScoreNormalization, description="Raw score -> reward (per sample).")
    template_error_reward: Float = Field(
        0.0,
        description="Reward of a response the model's chat template rewrites past recognition (counted template_errors; "
        "not normalised). use_chat_template: false scores such responses as plain text.",
    )
    num_cpus: Float = Field(0.25, gt=0, description="CPUs each actor of this environment reserves.")
    num_gpus: Float = Field(0.0, ge=0, le=1, description="GPUs each actor reserves (the model runs on one GPU: at most 1).")
    num_threads: Int = Field(1, gt=0, description="torch threads of each actor on CPU.")

    @field_validator("model_name")
    @classmethod
    def _names_a_scorer(cls, name: str) -> str:
        """A checkpoint that says it is a causal LM only (a policy or instruct model named by mistake) is refused in the
        driver; the actor's load refuses any checkpoint without a trained score head (:class:`.RewardModelScorer`)."""
        architectures = checkpoint_architectures(name)
        if architectures and all(a.endswith("ForCausalLM") for a in architectures):
            raise ValueError(
                f"{name!r} is a causal language model ({', '.join(architectures)}), not a reward model: its checkpoint has "
                "no trained score head, so every score would come from weights drawn at random. Name a "
                "*ForSequenceClassification checkpoint (a trained reward model)"
            )
        return name

    @model_validator(mode="after")
    def _label_in_range(self) -> RewardModelEnvConfig:
        """An out-of-range ``label_index`` is refused in the driver, under its key (each actor refused it as it loaded)."""
        labels = checkpoint_num_labels(self.model_name)
        if labels is not None and self.label_index >= labels:
            raise ValueError(f"label_index={self.label_index} but the reward model {self.model_name} has {labels} label(s)")
        return self


def _config_here(name: str) -> dict[str, Any] | None:
    """Model ``name``'s ``config.json`` (a local directory, a shipped model or a hub id in the local cache); ``None``
    when there is none here."""
    import json

    from nemo_like.models.loading import local_config_file

    config = local_config_file(name)
    return json.loads(config.read_text()) if config is not None else None


def checkpoint_num_labels(name: str) -> int | None:
    """How many logits model ``name``'s score head has, from its ``config.json`` here (``id2label``, else
    ``num_labels``, else transformers' default 2); ``None`` without a config here."""
    raw = _config_here(name)
    if raw is None:
        return None
    return len(raw["id2label"]) if raw.get("id2label") else int(raw.get("num_labels", 2))


def checkpoint_architectures(name: str) -> list[str]:
    """The ``architectures`` model ``name``'s ``config.json`` here lists (empty when it lists none or there is none)."""
    raw = _config_here(name)
    return list(raw.get("architectures") or []) if raw is not None else []


class RewardModelEnvironment(EnvironmentInterface):
    """See the module docstring."""

    config_model: ClassVar[type[BaseModel]] = RewardModelEnvConfig
    #: Loads its model in the actor's own process: a composite hands it the device of its share of the actor's GPUs.
    takes_device: ClassVar[bool] = True

    @classmethod
    def actor_needs(cls, settings: dict[str, Any]) -> ActorNeeds:
        cfg = RewardModelEnvConfig.model_validate(settings)
        return ActorNeeds(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)

    def __init__(self, device: str | None = None, **settings: Any) -> None:
        """``device``: where the model runs; default the CPU with ``num_gpus: 0``, else the actor's (first) GPU."""
        import torch

        from nemo_like.environments.reward_model_scorer import RewardModelScorer

        self.cfg = RewardModelEnvConfig.model_validate(settings)
        device = device or ("cpu" if self.cfg.num_gpus == 0 else None)
        if device == "cpu" or not torch.cuda.is_available():
            torch.set_num_threads(self.cfg.num_threads)
        self.scorer = RewardModelScorer(resolve_reward_model_path(self.cfg.model_name), self.cfg.precision, self.cfg.label_index, device)
        self.max_length = min(filter(None, (self.cfg.max_length, self.scorer.max_length)), default=None)
        if self.cfg.text_pair and "use_chat_template" in self.cfg.model_fields_set and self.cfg.use_chat_template:
            warnings.warn(
                "use_chat_template has no effect with text_pair: true (the pair is the tokenizer's, without a chat template)",
                UserWarning,
                stacklevel=2,
            )
        elif self.cfg.use_chat_template and not self.cfg.text_pair and not self.scorer.tokenizer.chat_template:
            warnings.warn(
                f"use_chat_template has no effect: the reward model {self.cfg.model_name}'s tokenizer has no chat template "
                "(prompt and response are concatenated with its special tokens)",
                UserWarning,
                stacklevel=2,
            )
        self._counts = dict.fromkeys(COUNTERS, 0.0)

    def raw_scores(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float | None]:
        """The model's raw score of each (prompt, response) pair (before normalisation); ``None`` for a template error."""
        sequences, type_ids, typed, failed = [], [], False, set()
        for i, (response, meta) in enumerate(zip(responses, metadata)):
            prompt = prompt_of(meta)
            if prompt is None:
                self._counts["prompt_missing"] += 1
            if self.cfg.text_pair:
                encoded = self.scorer.encode_text_pair(prompt or "", response)
                ids, types = encoded.ids, encoded.token_type_ids
            else:
                try:
                    ids, types = self.scorer.encode(prompt or "", response, self.cfg.use_chat_template), None
                except ContentRewrittenError:
                    self._counts["template_errors"] += 1
                    failed.add(i)
                    continue
            typed |= types is not None
            if self.max_length is not None and len(ids) > self.max_length:
                if types is not None:  # cut where the ids are cut
                    types = cut_from_left(ids, self.max_length, self.scorer.tokenizer, aligned=types)
                ids = cut_from_left(ids, self.max_length, self.scorer.tokenizer)
                self._counts["truncated"] += 1
            sequences.append(ids or [self.scorer.pad_token_id])
            type_ids.append(types or [0] * len(sequences[-1]))
        if not sequences:  # every response a template error: nothing to run
            return [None] * len(responses)
        scores = iter(self.scorer.score(sequences, self.cfg.max_tokens_per_batch, type_ids if typed else None))
        self._counts["batches"] += self.scorer.batches_run
        return [None if i in failed else next(scores) for i in range(len(responses))]

    def score(self, responses: list[str], metadata: list[dict[str, Any]]) -> list[float]:
        raw = self.raw_scores(responses, metadata)
        scored = [value for value in raw if value is not None]
        self._counts["scored"] += len(scored)
        self._counts["score_sum"] += sum(scored)
        return [self.cfg.template_error_reward if value is None else self.cfg.normalize(value) for value in raw]

    def metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, dict.fromkeys(COUNTERS, 0.0)
        return counts
