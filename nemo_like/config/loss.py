"""Configuration of the clipped policy-gradient loss (the ``loss_fn`` section of a GRPO config).

Key names follow NeMo-RL's ``ClippedPGLossConfig`` so that its recipes port over. The field
descriptions double as user documentation; ``docs/guides/grpo.md`` explains the maths.

Validation policy: a combination that is contradictory (options that cannot both hold) is an
error. A parameter changed from its default that the rest of the configuration makes ineffective
is only a warning (:meth:`ClippedPGLossConfig.no_effect_warnings`, printed once at start-up).

Plug-in choices (``surrogate``, ``reference_policy_kl_type``, ``truncated_importance_sampling_type``,
``trust_region_type``) accept any name registered in :mod:`nemo_like.algorithms.loss_functions` /
:mod:`nemo_like.algorithms.kl`, or a ``module:function`` import path to user code. This module keeps them as
plain names; they are checked after loading, before any actor starts, by
:func:`nemo_like.algorithms.names.check_plugin_names`.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nemo_like.config.types import Float, OptStr

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
TOKEN_LEVEL_AGGREGATIONS = ("token-mean", "token-sum")
_LEGACY_TOKEN_LEVEL = {True: "token-mean", False: "seq-mean-token-mean"}

_CLIP_KEYS = ("ratio_clip_min", "ratio_clip_max")
ONE_STEP_REASON = (
    "the run takes one optimizer step per rollout (policy.train_global_batch_size = grpo.num_prompts_per_step x "
    "grpo.num_generations_per_prompt), so pi/pi_prev = 1 on every token"
)
_KL_PARAM_KEYS = ("reference_policy_kl_type", "kl_input_clamp_value", "kl_output_clamp_value")
_TRUST_REGION_KEYS = ("trust_region_low", "trust_region_high")


class ClippedPGLossConfig(BaseModel):
    """Options of :class:`nemo_like.algorithms.loss_functions.ClippedPGLossFn`."""

    model_config = ConfigDict(extra="forbid")

    ratio_clip_min: Float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="PPO epsilon_low: the ratio pi_curr/pi_prev is clamped below at 1 - ratio_clip_min.",
    )
    ratio_clip_max: Float = Field(
        0.2,
        ge=0.0,
        description=(
            "PPO epsilon_high: the ratio is clamped above at 1 + ratio_clip_max. Set it above "
            "ratio_clip_min for DAPO's clip-higher (e.g. 0.28)."
        ),
    )
    ratio_clip_c: Float | None = Field(
        None,
        gt=1.0,
        description=(
            "Dual-clip constant c (> 1 + ratio_clip_max, typically 3). For tokens with a negative advantage the "
            "per-token loss is capped at -A*c, so a huge ratio cannot produce an unbounded "
            "update. None disables dual clipping."
        ),
    )
    reference_policy_kl_penalty: Float = Field(
        0.0,
        ge=0.0,
        description=(
            "beta: weight of the KL(pi_curr || pi_ref) penalty added to the loss. 0 disables the "
            "penalty, and no reference model or reference logprobs are needed."
        ),
    )
    reference_policy_kl_type: str = Field(
        "k3",
        description=(
            "Per-token estimator of KL(pi_curr || pi_ref), with log_ratio = log pi_ref - log pi_curr: "
            "k1 = -log_ratio (unbiased, can be negative), k2 = log_ratio^2/2 (biased, >= 0), "
            "k3 = exp(log_ratio) - 1 - log_ratio (unbiased, >= 0). Any name registered in "
            "nemo_like.algorithms.kl.KL_ESTIMATORS, or 'module:function' (log_ratio -> per-token KL)."
        ),
    )
    kl_input_clamp_value: Float | None = Field(
        20.0,
        gt=0.0,
        description="Clamp log(pi_ref/pi_curr) to [-v, v] before the KL estimator. None disables.",
    )
    kl_output_clamp_value: Float | None = Field(
        10.0,
        gt=0.0,
        description=("Clamp the (importance-weighted) per-token KL to [-v, v]. Clamped tokens give no KL gradient. None disables."),
    )
    use_on_policy_kl_approximation: bool = Field(
        False,
        description=(
            "Weight the per-token reference KL by pi_curr/pi_gen (with gradient, detached for k2), so that the "
            "penalty estimates KL(pi_curr || pi_ref) although the tokens were sampled from the "
            "generation policy. Without it the weight is exp(logp - stopgrad(logp)) = 1, which "
            "keeps the score-function part of the KL gradient."
        ),
    )
    use_importance_sampling_correction: bool = Field(
        False,
        description=(
            "Multiply each token's policy-gradient loss by the detached weight pi_prev/pi_gen, "
            "correcting for the generation engine's logprobs differing from the trainer's "
            "(async GRPO, fp8 or otherwise mismatched inference)."
        ),
    )
    truncated_importance_sampling_type: OptStr = Field(
        None,
        description=(
            "How the importance weights are truncated: 'tis' clamps them to [min, max]; 'icepop' "
            "zeroes weights outside [min, max]; 'seq-mask-tis' zeroes whole sequences whose "
            "geometric-mean ratio is outside [min, max]. Requires "
            "use_importance_sampling_correction and truncated_importance_sampling_ratio. Any name "
            "registered in loss_functions.TRUNCATIONS, or 'module:function'."
        ),
    )
    truncated_importance_sampling_ratio: Float | None = Field(
        None,
        gt=0.0,
        description="Upper bound 'max' of the truncation (e.g. 2.0 or 5.0).",
    )
    truncated_importance_sampling_ratio_min: Float | None = Field(
        None,
        ge=0.0,
        description=(
            "Lower bound 'min' of the truncation. Optional for 'tis' (default 0), required for "
            "'icepop' and 'seq-mask-tis' (e.g. 0.5). Must not exceed the upper bound."
        ),
    )
    sequence_level_importance_ratios: bool = Field(
        False,
        description=(
            "GSPO: one ratio per sequence, exp(mean_t log(pi_curr/pi_prev)), clipped like a token "
            "ratio; importance weights become per-sequence products. Requires token_level_loss=False."
        ),
    )
    token_level_loss: bool | None = Field(
        None,
        description=(
            "NeMo-RL's switch, kept for its recipes: True = loss_aggregation 'token-mean', False = "
            "'seq-mean-token-mean'. null follows loss_aggregation. Setting both inconsistently is "
            "an error."
        ),
    )
    loss_aggregation: LossAggregation | None = Field(
        None,
        description=(
            "How per-token losses become one number (verl's loss_agg_mode), always normalised by "
            "counts over the whole global batch: 'token-mean' = sum / valid tokens; "
            "'seq-mean-token-mean' = mean over sequences of each sequence's token mean; "
            "'seq-mean-token-sum' = mean over sequences of each sequence's token sum; "
            "'seq-mean-token-sum-norm' = Dr. GRPO: sum / (valid sequences * "
            "loss_aggregation_normalizer); 'token-sum' = plain sum. null: from token_level_loss "
            "(default token-mean)."
        ),
    )
    loss_aggregation_normalizer: Float | None = Field(
        None,
        gt=0.0,
        description=(
            "The constant C of 'seq-mean-token-sum-norm' (Dr. GRPO divides each sequence's token "
            "sum by the maximum response length). null: policy.generation.max_new_tokens."
        ),
    )
    surrogate: OptStr = Field(
        None,
        description=(
            "Policy-gradient surrogate by name: 'ppo_clip', 'unclipped', 'cispo', 'reinforce', any "
            "name registered in loss_functions.SURROGATES, or 'module:function'. null: chosen by "
            "use_cispo / disable_ppo_ratio / trust_region_type (ppo_clip otherwise)."
        ),
    )
    disable_ppo_ratio: bool = Field(
        False,
        description=("REINFORCE: the per-token loss is -A * log pi_curr, with no ratio and no clipping."),
    )
    force_on_policy_ratio: bool = Field(
        False,
        description=(
            "Use stopgrad(log pi_curr) as prev logprobs, so the ratio is identically 1 with the "
            "on-policy gradient. Only correct with one optimizer step per rollout batch; the "
            "trainer may then skip the prev-logprob pass."
        ),
    )
    use_cispo: bool = Field(
        False,
        description=(
            "CISPO: the per-token loss is -A * stopgrad(clamp(ratio)) * log pi_curr, so clipped "
            "tokens keep a (bounded) gradient instead of losing it."
        ),
    )
    trust_region_type: OptStr = Field(
        None,
        description=(
            "'dppo_binary_tv' replaces ratio clipping by a trust region on probabilities: a token "
            "is dropped when pi_curr - pi_gen moved past the band in the direction its advantage "
            "pushes (above trust_region_high for A > 0, below -trust_region_low for A < 0). "
            "Kept tokens use the unclipped ratio. Any name registered in "
            "loss_functions.TRUST_REGIONS, or 'module:function' returning the kept-token mask."
        ),
    )
    trust_region_low: Float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="Band below pi_gen: A < 0 tokens with pi_curr - pi_gen < -trust_region_low are dropped.",
    )
    trust_region_high: Float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="Band above pi_gen: A > 0 tokens with pi_curr - pi_gen > trust_region_high are dropped.",
    )
    kl_tau: Float = Field(
        0.0,
        ge=0.0,
        description=(
            "Weight of kl_tau * (log pi_curr - log pi_gen)^2, a training/inference mismatch "
            "penalty applied over kept tokens only (never over trust-region-dropped ones; over "
            "all valid tokens when no trust region is set). 0 disables."
        ),
    )

    @property
    def aggregation(self) -> str:
        """The effective loss aggregation (``loss_aggregation``, else from ``token_level_loss``)."""
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        return _LEGACY_TOKEN_LEVEL[True if self.token_level_loss is None else self.token_level_loss]

    @property
    def surrogate_name(self) -> str:
        """The surrogate to use: ``surrogate``, else the one the flags select."""
        return self.surrogate or self._flag_surrogate()

    def _flag_surrogate(self) -> str:
        if self.disable_ppo_ratio:
            return "reinforce"
        if self.use_cispo:
            return "cispo"
        if self.trust_region_type is not None:
            return "unclipped"
        return "ppo_clip"

    @model_validator(mode="after")
    def _check_combinations(self) -> ClippedPGLossConfig:
        problems = self._contradictions()
        if problems:
            raise ValueError("invalid loss_fn config: " + "; ".join(problems))
        return self

    def _contradictions(self) -> list[str]:
        rules = [*self._ratio_rules(), *self._trust_region_and_truncation_rules()]
        return [message for broken, message in rules if broken]

    def _chosen(self, surrogate: str, flag: str) -> tuple[bool, str]:
        """Whether ``surrogate`` is the one in use, and the key that chose it (its flag, or ``loss_fn.surrogate``)."""
        if getattr(self, flag):
            return True, f"loss_fn.{flag}"
        return self.surrogate == surrogate, f"loss_fn.surrogate={surrogate!r}"

    def _ratio_rules(self) -> list[tuple[bool, str]]:
        """Contradictions among the aggregation, the surrogate flags and the ratio options."""
        token_level = self.aggregation in TOKEN_LEVEL_AGGREGATIONS
        agg = self.loss_aggregation
        tll = self.token_level_loss
        flag_surrogate = "cispo" if self.use_cispo else "reinforce" if self.disable_ppo_ratio else None
        # The surrogate in use, however chosen (a flag or loss_fn.surrogate), and the key that chose it.
        cispo, cispo_key = self._chosen("cispo", "use_cispo")
        reinforce, reinforce_key = self._chosen("reinforce", "disable_ppo_ratio")
        return [
            (
                agg is not None and tll is not None and _LEGACY_TOKEN_LEVEL[tll] != agg,
                f"loss_fn.token_level_loss={str(tll).lower()} means loss_aggregation "
                f"'{_LEGACY_TOKEN_LEVEL[bool(tll)]}' but loss_fn.loss_aggregation={agg!r}; set only one",
            ),
            (
                self.surrogate is not None and flag_surrogate is not None and self.surrogate != flag_surrogate,
                f"loss_fn.surrogate={self.surrogate!r} contradicts "
                f"loss_fn.{'use_cispo' if self.use_cispo else 'disable_ppo_ratio'}=true (which selects "
                f"{flag_surrogate!r}); set only one",
            ),
            (
                cispo and self.ratio_clip_c is not None,
                f"{cispo_key} and loss_fn.ratio_clip_c are exclusive (CISPO's weight is "
                "already clamped to at most 1 + ratio_clip_max and its loss is not a ratio)",
            ),
            (
                self.ratio_clip_c is not None
                and self.ratio_clip_c <= 1 + self.ratio_clip_max
                and not (
                    self.surrogate_name in ("unclipped", "reinforce") or self.disable_ppo_ratio or self.force_on_policy_ratio
                ),  # no effect there: warned
                f"loss_fn.ratio_clip_c={self.ratio_clip_c} must exceed 1 + loss_fn.ratio_clip_max = {1 + self.ratio_clip_max:g}: "
                "the dual clip would cap tokens whose ratio is still inside the PPO band (no gradient, counted as clipped)",
            ),
            (
                self.use_cispo and self.disable_ppo_ratio,
                "loss_fn.use_cispo and loss_fn.disable_ppo_ratio are exclusive (CISPO needs the ratio)",
            ),
            (
                cispo and self.force_on_policy_ratio,
                f"{cispo_key} and loss_fn.force_on_policy_ratio are exclusive (with a ratio of 1 CISPO is plain REINFORCE)",
            ),
            (
                cispo and self.sequence_level_importance_ratios,
                f"{cispo_key} and loss_fn.sequence_level_importance_ratios are exclusive",
            ),
            (
                cispo and not token_level,
                f"{cispo_key} requires a token-level loss (loss_fn.token_level_loss=true or "
                f"loss_fn.loss_aggregation in {list(TOKEN_LEVEL_AGGREGATIONS)}); got {self.aggregation!r}",
            ),
            (
                self.sequence_level_importance_ratios and token_level,
                "loss_fn.sequence_level_importance_ratios (GSPO) requires a sequence-level loss "
                "(loss_fn.token_level_loss=false or a 'seq-mean-*' loss_fn.loss_aggregation); got "
                f"{self.aggregation!r}",
            ),
            (
                self.sequence_level_importance_ratios and reinforce,
                f"loss_fn.sequence_level_importance_ratios and {reinforce_key} are exclusive (there is no ratio to make sequence-level)",
            ),
            (
                reinforce and self.force_on_policy_ratio,
                f"{reinforce_key} and loss_fn.force_on_policy_ratio both replace the ratio; choose one (their gradients are identical)",
            ),
        ]

    def _trust_region_and_truncation_rules(self) -> list[tuple[bool, str]]:
        """Contradictions of the trust region and of importance-weight truncation with the rest."""
        tis_type = self.truncated_importance_sampling_type
        tis_max = self.truncated_importance_sampling_ratio
        tis_min = self.truncated_importance_sampling_ratio_min
        builtin_tis = tis_type in ("tis", "icepop", "seq-mask-tis")
        cispo, cispo_key = self._chosen("cispo", "use_cispo")
        reinforce, reinforce_key = self._chosen("reinforce", "disable_ppo_ratio")
        return [
            (
                self.trust_region_type is not None and cispo,
                f"loss_fn.trust_region_type and {cispo_key} are exclusive",
            ),
            (
                self.trust_region_type is not None and self.ratio_clip_c is not None and self.surrogate_name == "unclipped",
                "loss_fn.trust_region_type and loss_fn.ratio_clip_c are exclusive (the trust region replaces clipping; "
                "loss_fn.surrogate='ppo_clip' keeps the clip, dual clip included, inside the trust region)",
            ),
            (
                self.trust_region_type is not None and reinforce,
                f"loss_fn.trust_region_type and {reinforce_key} are exclusive",
            ),
            (
                self.trust_region_type is not None and self.sequence_level_importance_ratios,
                "loss_fn.trust_region_type (a per-token trust region) and loss_fn.sequence_level_importance_ratios are exclusive",
            ),
            (
                tis_type == "seq-mask-tis" and self.sequence_level_importance_ratios,
                "loss_fn.truncated_importance_sampling_type='seq-mask-tis' and loss_fn.sequence_level_importance_ratios are "
                "exclusive: GSPO's importance weight is the sequence's product of token ratios, which a mask on their geometric "
                "mean does not bound (a 200-token sequence at a mean ratio of 1.1 weighs e^20); use 'tis' or 'icepop'",
            ),
            (
                builtin_tis and tis_max is None,
                "loss_fn.truncated_importance_sampling_type requires loss_fn.truncated_importance_sampling_ratio",
            ),
            (
                tis_type in ("icepop", "seq-mask-tis") and tis_min is None,
                f"loss_fn.truncated_importance_sampling_type={tis_type!r} requires loss_fn.truncated_importance_sampling_ratio_min",
            ),
            (
                tis_min is not None and tis_max is not None and tis_min > tis_max,
                f"loss_fn.truncated_importance_sampling_ratio_min ({tis_min}) exceeds "
                f"loss_fn.truncated_importance_sampling_ratio ({tis_max})",
            ),
            (
                builtin_tis and ((tis_max is not None and tis_max < 1) or (tis_min is not None and tis_min > 1)),
                f"loss_fn.truncated_importance_sampling_ratio_min/_ratio ([{tis_min}, {tis_max}]) must contain 1: they bound "
                "the ratio pi_prev/pi_gen itself (e.g. [0.5, 2.0]), not its distance from 1, and a token sampled by the "
                f"weights it is trained on has a ratio of 1 ({tis_type!r} would "
                + ("scale every such token's weight down" if tis_type == "tis" else "drop every such token")
                + ")",
            ),
        ]

    def no_effect_warnings(self, one_step_per_rollout: bool = False, per_token_advantages: bool = False) -> list[str]:
        """One line per parameter changed from its default that the configuration ignores.

        ``one_step_per_rollout``: the run takes one optimizer step per rollout (the run config knows), so every ratio
        pi/pi_prev is exactly 1 when the loss is computed, as with ``force_on_policy_ratio``: the clip bounds, the dual
        clip and CISPO (REINFORCE at a ratio of 1) change nothing, nor does GSPO's sequence ratio where every token of a
        sequence has its sequence's advantage (``per_token_advantages`` false: no teacher term) and no importance-sampling
        correction weighs the sequence.

        Writing a default value out explicitly never warns, so recipes that spell out every key
        stay quiet. Contradictions are errors instead (raised at validation).
        """
        tis_type = self.truncated_importance_sampling_type
        beta_zero = self.reference_policy_kl_penalty == 0
        reinforce, reinforce_key = self._chosen("reinforce", "disable_ppo_ratio")
        # The surrogate in use decides whether the clip options count (loss_fn.surrogate='ppo_clip' keeps the clip beside
        # a trust region; 'unclipped' chosen by name ignores it without one); a plug-in surrogate may read them all.
        unclipped = self.surrogate_name == "unclipped"
        unclipped_by = "loss_fn.surrogate='unclipped'" if self.surrogate else f"loss_fn.trust_region_type={self.trust_region_type!r}"
        groups: list[tuple[bool, str, tuple[str, ...]]] = [
            (unclipped, unclipped_by, (*_CLIP_KEYS, "ratio_clip_c")),
            (reinforce, f"{reinforce_key}=true" if self.disable_ppo_ratio else reinforce_key, (*_CLIP_KEYS, "ratio_clip_c")),
            (self.force_on_policy_ratio, "loss_fn.force_on_policy_ratio=true", (*_CLIP_KEYS, "ratio_clip_c")),
            (one_step_per_rollout, ONE_STEP_REASON, (*_CLIP_KEYS, "ratio_clip_c")),
            (self.trust_region_type is None, "loss_fn.trust_region_type is null", _TRUST_REGION_KEYS),
            (beta_zero, "loss_fn.reference_policy_kl_penalty=0", (*_KL_PARAM_KEYS, "use_on_policy_kl_approximation")),
            (
                tis_type is None,
                "loss_fn.truncated_importance_sampling_type is null",
                ("truncated_importance_sampling_ratio", "truncated_importance_sampling_ratio_min"),
            ),
            (
                not self.use_importance_sampling_correction,
                "loss_fn.use_importance_sampling_correction=false",
                ("truncated_importance_sampling_type",),
            ),
            (
                self.aggregation != "seq-mean-token-sum-norm",
                f"loss_fn.loss_aggregation={self.aggregation!r}",
                ("loss_aggregation_normalizer",),
            ),
        ]
        warnings: dict[str, str] = {}  # key -> its line: one line per option, first reason wins
        for active, reason, keys in groups:
            for key in keys:
                if active and key not in warnings and self._changed_from_default(key):
                    warnings[key] = f"loss_fn.{key} has no effect because {reason} (ignored)"
        cispo, cispo_key = self._chosen("cispo", "use_cispo")
        if cispo and one_step_per_rollout and not self.force_on_policy_ratio:  # with the flag: an error (_ratio_rules)
            warnings["use_cispo"] = f"{cispo_key} has no effect because {ONE_STEP_REASON}: CISPO is plain REINFORCE at a ratio of 1"
        # At a ratio of 1 every built-in surrogate has PPO's gradient, -A grad log pi (no ratio leaves the clip band): an
        # ablation flipping one of them trained the same weights, and only train/loss's value told them apart.
        if one_step_per_rollout and reinforce:
            warnings["disable_ppo_ratio"] = (
                f"{reinforce_key} has no effect on the update because {ONE_STEP_REASON}: PPO's gradient at a ratio of 1 is "
                "REINFORCE's (train/loss differs: -A log pi against -A r)"
            )
        if one_step_per_rollout and self.surrogate == "unclipped":
            warnings["surrogate"] = f"loss_fn.surrogate='unclipped' has no effect because {ONE_STEP_REASON}: no ratio leaves the clip band"
        if one_step_per_rollout and self.force_on_policy_ratio:
            warnings["force_on_policy_ratio"] = f"loss_fn.force_on_policy_ratio has no effect because {ONE_STEP_REASON} already"
        ratio_one = one_step_per_rollout or self.force_on_policy_ratio
        if self.sequence_level_importance_ratios and ratio_one and not per_token_advantages and not self.use_importance_sampling_correction:
            reason = ONE_STEP_REASON if one_step_per_rollout else "loss_fn.force_on_policy_ratio=true"
            warnings["sequence_level_importance_ratios"] = (
                f"loss_fn.sequence_level_importance_ratios has no effect because {reason}: at a ratio of 1 GSPO's loss and "
                "gradient are the token-level ones (each token carries its sequence's advantage)"
            )
        return list(warnings.values())

    def _changed_from_default(self, key: str) -> bool:
        default = type(self).model_fields[key].default
        return key in self.model_fields_set and getattr(self, key) != default
