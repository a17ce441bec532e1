"""Configuration of the clipped policy-gradient loss (the ``loss_fn`` section of a GRPO config).

Key names follow NeMo-RL's ``ClippedPGLossConfig`` so that its recipes port over. The field
descriptions double as user documentation; ``docs/guides/grpo.md`` explains the maths.

Validation policy: a combination is rejected when it is contradictory, or when the user changed a
parameter (set it to a non-default value) that the rest of the configuration makes ineffective.
Writing a default value out explicitly is always accepted, so recipes that spell out every key work.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

KLType = Literal["k1", "k2", "k3"]
TruncationType = Literal["tis", "icepop", "seq-mask-tis"]
TrustRegionType = Literal["dppo_binary_tv"]

_CLIP_KEYS = ("ratio_clip_min", "ratio_clip_max")
_KL_PARAM_KEYS = ("reference_policy_kl_type", "kl_input_clamp_value", "kl_output_clamp_value")
_TRUST_REGION_KEYS = ("trust_region_low", "trust_region_high")


class ClippedPGLossConfig(BaseModel):
    """Options of :class:`nemo_like.algorithms.loss_functions.ClippedPGLossFn`."""

    model_config = ConfigDict(extra="forbid")

    ratio_clip_min: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="PPO epsilon_low: the ratio pi_curr/pi_prev is clamped below at 1 - ratio_clip_min.",
    )
    ratio_clip_max: float = Field(
        0.2,
        ge=0.0,
        description=(
            "PPO epsilon_high: the ratio is clamped above at 1 + ratio_clip_max. Set it above "
            "ratio_clip_min for DAPO's clip-higher (e.g. 0.28)."
        ),
    )
    ratio_clip_c: float | None = Field(
        None,
        gt=1.0,
        description=(
            "Dual-clip constant c (> 1, typically 3). For tokens with a negative advantage the "
            "per-token loss is capped at -A*c, so a huge ratio cannot produce an unbounded "
            "update. None disables dual clipping."
        ),
    )
    reference_policy_kl_penalty: float = Field(
        0.0,
        ge=0.0,
        description=(
            "beta: weight of the KL(pi_curr || pi_ref) penalty added to the loss. 0 disables the "
            "penalty, and no reference model or reference logprobs are needed."
        ),
    )
    reference_policy_kl_type: KLType = Field(
        "k3",
        description=(
            "Per-token estimator of KL(pi_curr || pi_ref), with log_ratio = log pi_ref - log pi_curr: "
            "k1 = -log_ratio (unbiased, can be negative), k2 = log_ratio^2/2 (biased, >= 0), "
            "k3 = exp(log_ratio) - 1 - log_ratio (unbiased, >= 0)."
        ),
    )
    kl_input_clamp_value: float | None = Field(
        20.0,
        gt=0.0,
        description="Clamp log(pi_ref/pi_curr) to [-v, v] before the KL estimator. None disables.",
    )
    kl_output_clamp_value: float | None = Field(
        10.0,
        gt=0.0,
        description=(
            "Clamp the (importance-weighted) per-token KL to [-v, v]. Clamped tokens give no KL "
            "gradient. None disables."
        ),
    )
    use_on_policy_kl_approximation: bool = Field(
        False,
        description=(
            "Weight the per-token reference KL by pi_curr/pi_gen (with gradient), so that the "
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
    truncated_importance_sampling_type: TruncationType | None = Field(
        None,
        description=(
            "How the importance weights are truncated: 'tis' clamps them to [min, max]; 'icepop' "
            "zeroes weights outside [min, max]; 'seq-mask-tis' zeroes whole sequences whose "
            "geometric-mean ratio is outside [min, max]. Requires "
            "use_importance_sampling_correction and truncated_importance_sampling_ratio."
        ),
    )
    truncated_importance_sampling_ratio: float | None = Field(
        None,
        gt=0.0,
        description="Upper bound 'max' of the truncation (e.g. 2.0 or 5.0).",
    )
    truncated_importance_sampling_ratio_min: float | None = Field(
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
    token_level_loss: bool = Field(
        True,
        description=(
            "True: average over all valid tokens of the global batch. False: average each "
            "sequence over its tokens, then average sequences over the global batch."
        ),
    )
    disable_ppo_ratio: bool = Field(
        False,
        description=(
            "REINFORCE: the per-token loss is -A * log pi_curr, with no ratio and no clipping."
        ),
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
    trust_region_type: TrustRegionType | None = Field(
        None,
        description=(
            "'dppo_binary_tv' replaces ratio clipping by a trust region on probabilities: a token "
            "is dropped when pi_curr - pi_gen moved past the band in the direction its advantage "
            "pushes (above trust_region_high for A > 0, below -trust_region_low for A < 0). "
            "Kept tokens use the unclipped ratio."
        ),
    )
    trust_region_low: float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="Band below pi_gen: A < 0 tokens with pi_curr - pi_gen < -trust_region_low are dropped.",
    )
    trust_region_high: float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="Band above pi_gen: A > 0 tokens with pi_curr - pi_gen > trust_region_high are dropped.",
    )
    kl_tau: float = Field(
        0.0,
        ge=0.0,
        description=(
            "Weight of kl_tau * (log pi_curr - log pi_gen)^2, a training/inference mismatch "
            "penalty applied over kept tokens only (never over trust-region-dropped ones; over "
            "all valid tokens when no trust region is set). 0 disables."
        ),
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> ClippedPGLossConfig:
        problems = self._contradictions() + self._ineffective_parameters()
        if problems:
            raise ValueError("invalid loss_fn config: " + "; ".join(problems))
        return self

    def _contradictions(self) -> list[str]:
        tis_type = self.truncated_importance_sampling_type
        tis_max = self.truncated_importance_sampling_ratio
        tis_min = self.truncated_importance_sampling_ratio_min
        rules: list[tuple[bool, str]] = [
            (
                self.use_cispo and self.ratio_clip_c is not None,
                "loss_fn.use_cispo and loss_fn.ratio_clip_c are exclusive (CISPO's weight is "
                "already clamped to at most 1 + ratio_clip_max and its loss is not a ratio)",
            ),
            (
                self.use_cispo and self.disable_ppo_ratio,
                "loss_fn.use_cispo and loss_fn.disable_ppo_ratio are exclusive (CISPO needs the ratio)",
            ),
            (
                self.use_cispo and self.force_on_policy_ratio,
                "loss_fn.use_cispo and loss_fn.force_on_policy_ratio are exclusive (with a ratio "
                "of 1 CISPO is plain REINFORCE)",
            ),
            (
                self.use_cispo and self.sequence_level_importance_ratios,
                "loss_fn.use_cispo and loss_fn.sequence_level_importance_ratios are exclusive",
            ),
            (
                self.use_cispo and not self.token_level_loss,
                "loss_fn.use_cispo requires loss_fn.token_level_loss=True",
            ),
            (
                self.sequence_level_importance_ratios and self.token_level_loss,
                "loss_fn.sequence_level_importance_ratios (GSPO) requires "
                "loss_fn.token_level_loss=False",
            ),
            (
                self.sequence_level_importance_ratios and self.disable_ppo_ratio,
                "loss_fn.sequence_level_importance_ratios and loss_fn.disable_ppo_ratio are "
                "exclusive (there is no ratio to make sequence-level)",
            ),
            (
                self.disable_ppo_ratio and self.force_on_policy_ratio,
                "loss_fn.disable_ppo_ratio and loss_fn.force_on_policy_ratio both replace the "
                "ratio; choose one (their gradients are identical)",
            ),
            (
                self.ratio_clip_c is not None and self.disable_ppo_ratio,
                "loss_fn.ratio_clip_c has no effect with loss_fn.disable_ppo_ratio (no ratio)",
            ),
            (
                self.ratio_clip_c is not None and self.force_on_policy_ratio,
                "loss_fn.ratio_clip_c has no effect with loss_fn.force_on_policy_ratio (the ratio "
                "is always 1 < c)",
            ),
            (
                self.trust_region_type is not None and self.use_cispo,
                "loss_fn.trust_region_type and loss_fn.use_cispo are exclusive",
            ),
            (
                self.trust_region_type is not None and self.ratio_clip_c is not None,
                "loss_fn.trust_region_type and loss_fn.ratio_clip_c are exclusive (the trust "
                "region replaces clipping)",
            ),
            (
                self.trust_region_type is not None and self.disable_ppo_ratio,
                "loss_fn.trust_region_type and loss_fn.disable_ppo_ratio are exclusive",
            ),
            (
                self.trust_region_type is not None and self.sequence_level_importance_ratios,
                "loss_fn.trust_region_type (a per-token trust region) and "
                "loss_fn.sequence_level_importance_ratios are exclusive",
            ),
            (
                self.use_on_policy_kl_approximation and self.reference_policy_kl_penalty == 0,
                "loss_fn.use_on_policy_kl_approximation has no effect with "
                "loss_fn.reference_policy_kl_penalty=0",
            ),
            (
                tis_type is not None and not self.use_importance_sampling_correction,
                "loss_fn.truncated_importance_sampling_type requires "
                "loss_fn.use_importance_sampling_correction=True",
            ),
            (
                tis_type is not None and tis_max is None,
                "loss_fn.truncated_importance_sampling_type requires "
                "loss_fn.truncated_importance_sampling_ratio",
            ),
            (
                tis_type is None and tis_max is not None,
                "loss_fn.truncated_importance_sampling_ratio is set but "
                "loss_fn.truncated_importance_sampling_type is None",
            ),
            (
                tis_type is None and tis_min is not None,
                "loss_fn.truncated_importance_sampling_ratio_min is set but "
                "loss_fn.truncated_importance_sampling_type is None",
            ),
            (
                tis_type in ("icepop", "seq-mask-tis") and tis_min is None,
                f"loss_fn.truncated_importance_sampling_type={tis_type!r} requires "
                "loss_fn.truncated_importance_sampling_ratio_min",
            ),
            (
                tis_min is not None and tis_max is not None and tis_min > tis_max,
                f"loss_fn.truncated_importance_sampling_ratio_min ({tis_min}) exceeds "
                f"loss_fn.truncated_importance_sampling_ratio ({tis_max})",
            ),
        ]
        return [message for broken, message in rules if broken]

    def _ineffective_parameters(self) -> list[str]:
        groups: list[tuple[bool, str, tuple[str, ...]]] = [
            (self.trust_region_type is not None, "loss_fn.trust_region_type is set", _CLIP_KEYS),
            (self.disable_ppo_ratio, "loss_fn.disable_ppo_ratio=True", _CLIP_KEYS),
            (self.force_on_policy_ratio, "loss_fn.force_on_policy_ratio=True", _CLIP_KEYS),
            (self.trust_region_type is None, "loss_fn.trust_region_type is None", _TRUST_REGION_KEYS),
            (
                self.reference_policy_kl_penalty == 0,
                "loss_fn.reference_policy_kl_penalty=0",
                _KL_PARAM_KEYS,
            ),
        ]
        problems = []
        for active, reason, keys in groups:
            changed = [k for k in keys if active and self._changed_from_default(k)]
            if changed:
                names = " and ".join(f"loss_fn.{k}" for k in changed)
                verb, pronoun = ("has", "it") if len(changed) == 1 else ("have", "them")
                problems.append(f"{names} {verb} no effect because {reason}; remove {pronoun}")
        return problems

    def _changed_from_default(self, key: str) -> bool:
        default = type(self).model_fields[key].default
        return key in self.model_fields_set and getattr(self, key) != default
