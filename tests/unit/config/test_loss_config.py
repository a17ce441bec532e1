"""ClippedPGLossConfig: defaults, documentation, rejection of contradictions, no-effect warnings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_like.config.loss import ClippedPGLossConfig

TIS = {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0}


def test_defaults() -> None:
    cfg = ClippedPGLossConfig()
    assert (cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c) == (0.2, 0.2, None)
    assert (cfg.reference_policy_kl_penalty, cfg.reference_policy_kl_type) == (0.0, "k3")
    assert (cfg.kl_input_clamp_value, cfg.kl_output_clamp_value) == (20.0, 10.0)
    assert cfg.token_level_loss is None and cfg.loss_aggregation is None
    assert cfg.aggregation == "token-mean"
    assert not any(
        [
            cfg.use_on_policy_kl_approximation,
            cfg.use_importance_sampling_correction,
            cfg.sequence_level_importance_ratios,
            cfg.disable_ppo_ratio,
            cfg.force_on_policy_ratio,
            cfg.use_cispo,
        ]
    )
    assert cfg.truncated_importance_sampling_type is None
    assert cfg.trust_region_type is None
    assert (cfg.trust_region_low, cfg.trust_region_high, cfg.kl_tau) == (0.2, 0.2, 0.0)


def test_every_field_is_documented() -> None:
    for name, field in ClippedPGLossConfig.model_fields.items():
        assert field.description and len(field.description) > 20, name


def test_unknown_keys_are_rejected() -> None:
    with pytest.raises(ValidationError, match="use_kl_in_reward"):
        ClippedPGLossConfig(use_kl_in_reward=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio_clip_max": 0.28, "ratio_clip_c": 3.0},
        {"use_cispo": True, "ratio_clip_max": 5.0},
        {"sequence_level_importance_ratios": True, "token_level_loss": False},
        {"truncated_importance_sampling_type": "tis", **TIS},
        {"truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio_min": 0.5, **TIS},
        {"truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio_min": 0.5, **TIS},
        {"reference_policy_kl_penalty": 0.01, "reference_policy_kl_type": "k1", "use_on_policy_kl_approximation": True},
        {"trust_region_type": "dppo_binary_tv", "trust_region_high": 0.28, "kl_tau": 1e-3},
        {"force_on_policy_ratio": True, "use_importance_sampling_correction": True},
        {"kl_tau": 0.01},
        # Writing a default out explicitly is fine even where it has no effect.
        {"trust_region_type": "dppo_binary_tv", "ratio_clip_min": 0.2, "ratio_clip_max": 0.2},
        {"reference_policy_kl_type": "k3", "kl_input_clamp_value": 20.0},
    ],
)
def test_valid_combinations(kwargs: dict) -> None:
    ClippedPGLossConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "keys"),
    [
        ({"use_cispo": True, "ratio_clip_c": 3.0}, ["use_cispo", "ratio_clip_c"]),
        # a dual-clip cap inside the PPO band (c <= 1 + clip_max) zeroed the gradient of in-band tokens
        ({"ratio_clip_c": 1.1}, ["ratio_clip_c", "ratio_clip_max"]),
        ({"ratio_clip_c": 1.3, "ratio_clip_max": 0.3}, ["ratio_clip_c", "ratio_clip_max"]),
        ({"use_cispo": True, "disable_ppo_ratio": True}, ["use_cispo", "disable_ppo_ratio"]),
        ({"use_cispo": True, "force_on_policy_ratio": True}, ["use_cispo", "force_on_policy_ratio"]),
        ({"use_cispo": True, "token_level_loss": False}, ["use_cispo", "token_level_loss"]),
        (
            {"use_cispo": True, "sequence_level_importance_ratios": True, "token_level_loss": False},
            ["use_cispo", "sequence_level_importance_ratios"],
        ),
        ({"sequence_level_importance_ratios": True}, ["sequence_level_importance_ratios", "token_level_loss"]),
        (
            {"sequence_level_importance_ratios": True, "token_level_loss": False, "disable_ppo_ratio": True},
            ["sequence_level_importance_ratios", "disable_ppo_ratio"],
        ),
        ({"disable_ppo_ratio": True, "force_on_policy_ratio": True}, ["disable_ppo_ratio", "force_on_policy_ratio"]),
        (
            {"truncated_importance_sampling_type": "tis", "use_importance_sampling_correction": True},
            ["truncated_importance_sampling_type", "truncated_importance_sampling_ratio"],
        ),
        (
            {"truncated_importance_sampling_type": "icepop", **TIS},
            ["truncated_importance_sampling_type", "truncated_importance_sampling_ratio_min"],
        ),
        (
            {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio_min": 3.0, **TIS},
            ["truncated_importance_sampling_ratio_min", "truncated_importance_sampling_ratio"],
        ),
        ({"trust_region_type": "dppo_binary_tv", "use_cispo": True}, ["trust_region_type", "use_cispo"]),
        ({"trust_region_type": "dppo_binary_tv", "ratio_clip_c": 3.0}, ["trust_region_type", "ratio_clip_c"]),
        ({"trust_region_type": "dppo_binary_tv", "disable_ppo_ratio": True}, ["trust_region_type", "disable_ppo_ratio"]),
        (
            {"trust_region_type": "dppo_binary_tv", "sequence_level_importance_ratios": True, "token_level_loss": False},
            ["trust_region_type", "sequence_level_importance_ratios"],
        ),
        ({"token_level_loss": True, "loss_aggregation": "seq-mean-token-sum-norm"}, ["token_level_loss", "loss_aggregation"]),
        ({"token_level_loss": False, "loss_aggregation": "token-mean"}, ["token_level_loss", "loss_aggregation"]),
        ({"token_level_loss": False, "loss_aggregation": "seq-mean-token-sum"}, ["token_level_loss", "loss_aggregation"]),
        ({"use_cispo": True, "loss_aggregation": "seq-mean-token-sum"}, ["use_cispo", "loss_aggregation"]),
        (
            {"sequence_level_importance_ratios": True, "loss_aggregation": "token-sum"},
            ["sequence_level_importance_ratios", "loss_aggregation"],
        ),
        ({"surrogate": "ppo_clip", "use_cispo": True}, ["surrogate", "use_cispo"]),
        ({"surrogate": "cispo", "disable_ppo_ratio": True}, ["surrogate", "disable_ppo_ratio"]),
        # The same surrogates chosen by name break the same rules (they were accepted, ratio_clip_c silently ignored).
        ({"surrogate": "cispo", "ratio_clip_c": 3.0}, ["surrogate='cispo'", "ratio_clip_c"]),
        ({"surrogate": "cispo", "loss_aggregation": "seq-mean-token-mean"}, ["surrogate='cispo'", "loss_aggregation"]),
        (
            {"surrogate": "cispo", "sequence_level_importance_ratios": True, "token_level_loss": False},
            ["surrogate='cispo'", "sequence_level_importance_ratios"],
        ),
        ({"surrogate": "cispo", "trust_region_type": "dppo_binary_tv"}, ["surrogate='cispo'", "trust_region_type"]),
        (
            {"surrogate": "reinforce", "sequence_level_importance_ratios": True, "token_level_loss": False},
            ["sequence_level_importance_ratios", "surrogate='reinforce'"],
        ),
        ({"surrogate": "reinforce", "force_on_policy_ratio": True}, ["surrogate='reinforce'", "force_on_policy_ratio"]),
        # GSPO weighs a sequence by the product of its ratios: a mask on their geometric mean does not bound it
        (
            {
                "sequence_level_importance_ratios": True,
                "token_level_loss": False,
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "seq-mask-tis",
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            ["truncated_importance_sampling_type='seq-mask-tis'", "sequence_level_importance_ratios"],
        ),  # fmt: skip
        # Truncation bounds that exclude a ratio of 1 (read as an epsilon, like ratio_clip_max): icepop dropped every
        # on-policy token (the step trained on nothing), tis scaled every one down
        (
            {
                **TIS,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 0.8,
                "truncated_importance_sampling_ratio_min": 0.5,
            },
            ["truncated_importance_sampling_ratio_min/_ratio ([0.5, 0.8]) must contain 1"],
        ),  # fmt: skip
        (
            {**TIS, "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 0.2},
            ["truncated_importance_sampling_ratio_min/_ratio ([None, 0.2]) must contain 1"],
        ),
    ],
)
def test_invalid_combinations_name_both_keys(kwargs: dict, keys: list[str]) -> None:
    with pytest.raises(ValidationError) as excinfo:
        ClippedPGLossConfig(**kwargs)
    message = str(excinfo.value)
    for key in keys:
        assert f"loss_fn.{key}" in message, (key, message)


@pytest.mark.parametrize(
    ("kwargs", "ignored", "because"),
    [
        # A parameter changed from its default but made ineffective by another key: a warning.
        ({"trust_region_type": "dppo_binary_tv", "ratio_clip_max": 0.28}, "ratio_clip_max", "loss_fn.trust_region_type='dppo_binary_tv'"),
        ({"force_on_policy_ratio": True, "ratio_clip_max": 0.28}, "ratio_clip_max", "loss_fn.force_on_policy_ratio=true"),
        ({"force_on_policy_ratio": True, "ratio_clip_min": 0.1}, "ratio_clip_min", "loss_fn.force_on_policy_ratio=true"),
        ({"disable_ppo_ratio": True, "ratio_clip_max": 0.3}, "ratio_clip_max", "loss_fn.disable_ppo_ratio=true"),
        ({"disable_ppo_ratio": True, "ratio_clip_c": 3.0}, "ratio_clip_c", "loss_fn.disable_ppo_ratio=true"),
        ({"surrogate": "reinforce", "ratio_clip_max": 0.3}, "ratio_clip_max", "loss_fn.surrogate='reinforce'"),
        ({"force_on_policy_ratio": True, "ratio_clip_c": 3.0}, "ratio_clip_c", "loss_fn.force_on_policy_ratio=true"),
        ({"trust_region_high": 0.3}, "trust_region_high", "loss_fn.trust_region_type is null"),
        ({"reference_policy_kl_type": "k1"}, "reference_policy_kl_type", "loss_fn.reference_policy_kl_penalty=0"),
        ({"kl_output_clamp_value": 5.0}, "kl_output_clamp_value", "loss_fn.reference_policy_kl_penalty=0"),
        ({"reference_policy_kl_penalty": 0, "kl_input_clamp_value": 5.0}, "kl_input_clamp_value", "loss_fn.reference_policy_kl_penalty=0"),
        ({"use_on_policy_kl_approximation": True}, "use_on_policy_kl_approximation", "loss_fn.reference_policy_kl_penalty=0"),
        (
            {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
            "truncated_importance_sampling_type",
            "loss_fn.use_importance_sampling_correction=false",
        ),
        (
            {"truncated_importance_sampling_ratio": 2.0, "use_importance_sampling_correction": True},
            "truncated_importance_sampling_ratio",
            "loss_fn.truncated_importance_sampling_type is null",
        ),
        (
            {"truncated_importance_sampling_ratio_min": 0.5},
            "truncated_importance_sampling_ratio_min",
            "loss_fn.truncated_importance_sampling_type is null",
        ),
        ({"loss_aggregation_normalizer": 512}, "loss_aggregation_normalizer", "loss_fn.loss_aggregation='token-mean'"),
        # a dual clip inside the PPO band is an error where the clip runs; where it never runs it is only ineffective
        ({"ratio_clip_c": 1.1, "disable_ppo_ratio": True}, "ratio_clip_c", "loss_fn.disable_ppo_ratio=true"),
        ({"ratio_clip_c": 1.1, "force_on_policy_ratio": True}, "ratio_clip_c", "loss_fn.force_on_policy_ratio=true"),
        ({"ratio_clip_c": 1.1, "surrogate": "unclipped"}, "ratio_clip_c", "loss_fn.surrogate='unclipped'"),
        ({"ratio_clip_c": 1.1, "surrogate": "reinforce"}, "ratio_clip_c", "loss_fn.surrogate='reinforce'"),  # was an error
    ],
)
def test_ineffective_options_warn_instead_of_failing(kwargs: dict, ignored: str, because: str) -> None:
    cfg = ClippedPGLossConfig(**kwargs)  # no error
    warnings = cfg.no_effect_warnings()
    assert [w for w in warnings if w.startswith(f"loss_fn.{ignored} has no effect because")] == [
        f"loss_fn.{ignored} has no effect because {because} (ignored)"
    ], warnings


def test_one_warning_line_per_option() -> None:
    # ratio_clip_max is ineffective for two reasons at once: still one line.
    cfg = ClippedPGLossConfig(force_on_policy_ratio=True, trust_region_type="dppo_binary_tv", ratio_clip_max=0.3)
    assert sum(w.startswith("loss_fn.ratio_clip_max ") for w in cfg.no_effect_warnings()) == 1


def test_defaults_written_out_do_not_warn() -> None:
    cfg = ClippedPGLossConfig(force_on_policy_ratio=True, ratio_clip_max=0.2, kl_input_clamp_value=20.0)
    assert cfg.no_effect_warnings() == []


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"ratio_clip_c": 1.0}, "ratio_clip_c"),
        ({"ratio_clip_c": 0.5}, "ratio_clip_c"),
        ({"ratio_clip_min": 1.5}, "ratio_clip_min"),
        ({"ratio_clip_max": -0.1}, "ratio_clip_max"),
        ({"reference_policy_kl_penalty": -1.0}, "reference_policy_kl_penalty"),
        ({"loss_aggregation": "seq-mean"}, "loss_aggregation"),
        ({"loss_aggregation_normalizer": 0}, "loss_aggregation_normalizer"),
        ({"truncated_importance_sampling_ratio": 0.0}, "truncated_importance_sampling_ratio"),
        ({"trust_region_high": 1.5}, "trust_region_high"),
        ({"kl_tau": -0.1}, "kl_tau"),
    ],
)
def test_out_of_range_values(kwargs: dict, key: str) -> None:
    with pytest.raises(ValidationError, match=key):
        ClippedPGLossConfig(**kwargs)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"reference_policy_kl_type": "k4"}, "reference_policy_kl_type"),
        ({"surrogate": "ppo-clip"}, "surrogate"),
        ({"trust_region_type": "dppo"}, "trust_region_type"),
        ({"truncated_importance_sampling_type": "clip", **TIS}, "truncated_importance_sampling_type"),
    ],
)
def test_unknown_plugin_names_fail_the_check_after_loading(overrides: dict, key: str) -> None:
    # The schema keeps plain names; check_plugin_names (CLI, train, eval) resolves them before any actor starts.
    from nemo_like.algorithms.names import check_plugin_names
    from nemo_like.config import ConfigError, load_config

    cfg = load_config(None, [f"loss_fn.{k}={v}" for k, v in overrides.items()], warn=False)
    with pytest.raises(ConfigError, match=f"loss_fn.{key}: unknown"):
        check_plugin_names(cfg)


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(ValidationError) as excinfo:
        ClippedPGLossConfig(use_cispo=True, ratio_clip_c=3.0, token_level_loss=False)
    message = str(excinfo.value)
    assert "loss_fn.ratio_clip_c" in message and "loss_fn.token_level_loss" in message


def _loss_on_ratios_outside_the_band(cfg: ClippedPGLossConfig) -> float:
    """The loss of one row whose ratios (vs prev) are e^0.8 (A=+1), e^-1 (A=-1) and e^1.5 (A=-1): outside the clip
    band on both sides, and above a dual clip of 3 where the advantage is negative."""
    import torch

    from nemo_like.algorithms.loss_functions import ClippedPGLossFn

    def row(*values: float) -> torch.Tensor:
        return torch.tensor([[0.0, *values]], dtype=torch.float64)

    prev = row(-1.0, -2.0, -3.0)
    data = {
        "advantages": row(1.0, -1.0, -1.0),
        "token_mask": row(1, 1, 1),
        "sample_mask": torch.ones(1, dtype=torch.float64),
        "generation_logprobs": prev.clone(),
        "prev_logprobs": prev.clone(),
    }
    curr = row(-0.2, -3.0, -1.5)
    return ClippedPGLossFn(cfg)(curr, data, 1.0, 3.0)[0].item()


@pytest.mark.parametrize("surrogate", ["ppo_clip", "unclipped", "cispo", "reinforce"])
@pytest.mark.parametrize("trust_region", [None, "dppo_binary_tv"])
@pytest.mark.parametrize(("key", "value"), [("ratio_clip_max", 0.5), ("ratio_clip_min", 0.5), ("ratio_clip_c", 3.0)])
def test_a_clip_option_warns_exactly_when_it_leaves_the_loss_unchanged(surrogate, trust_region, key, value) -> None:
    """The warnings followed the flags, not the surrogate chosen by name: 'unclipped' ignored the clip silently, and
    'ppo_clip' beside a trust region was told its clip was ignored while it changed the loss."""
    region = {"trust_region_type": trust_region, "trust_region_low": 1.0, "trust_region_high": 1.0} if trust_region else {}
    base = {"surrogate": surrogate, **region}
    # The contradictions, errors rather than warnings: CISPO or REINFORCE with a trust region, and a dual clip with
    # CISPO or with the unclipped surrogate inside a trust region (ppo_clip's dual clip beside one is valid).
    refused = (trust_region is not None and surrogate in ("cispo", "reinforce")) or (
        key == "ratio_clip_c" and (surrogate == "cispo" or (surrogate == "unclipped" and trust_region is not None))
    )
    if refused:
        with pytest.raises(ValidationError):
            ClippedPGLossConfig(**base, **{key: value})
        return
    changed = ClippedPGLossConfig(**base, **{key: value})
    warned = any(line.startswith(f"loss_fn.{key} has no effect") for line in changed.no_effect_warnings())
    unchanged = _loss_on_ratios_outside_the_band(changed) == _loss_on_ratios_outside_the_band(ClippedPGLossConfig(**base))
    assert warned == unchanged, (changed.no_effect_warnings(), unchanged)


def test_gspo_warns_where_every_ratio_is_one_unless_advantages_or_weights_vary_per_token() -> None:
    """At a ratio of 1 GSPO's exp(mean_t(c - sg c)) gives the token-level loss and gradient when every token carries
    its sequence's advantage and no importance weight is in play: at one optimizer step per rollout it changes nothing."""
    gspo = ClippedPGLossConfig(sequence_level_importance_ratios=True, token_level_loss=False)
    assert any(w.startswith("loss_fn.sequence_level_importance_ratios has no effect") for w in gspo.no_effect_warnings(True))
    assert not any("sequence_level_importance_ratios" in w for w in gspo.no_effect_warnings(False))  # several steps
    assert not any("sequence_level_importance_ratios" in w for w in gspo.no_effect_warnings(True, per_token_advantages=True))
    weighted = ClippedPGLossConfig(sequence_level_importance_ratios=True, token_level_loss=False, use_importance_sampling_correction=True)
    assert not any("sequence_level_importance_ratios" in w for w in weighted.no_effect_warnings(True))
