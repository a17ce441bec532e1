"""Plug-in registries: registered names or user code by import path, checked after loading (by
check_plugin_names, before any actor starts) with a did-you-mean; one definition of the k1/k2/k3 KL estimators."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nemo_like.algorithms import kl, loss_functions, metrics
from nemo_like.algorithms.advantages import compute_advantages
from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.algorithms.names import check_plugin_names
from nemo_like.config import ConfigError, load_config
from nemo_like.config.loss import ClippedPGLossConfig

PLUGINS = "tests.unit.algorithms.user_plugins"
PLUGINS_FILE = "tests/unit/algorithms/user_plugins.py"
REPO = Path(__file__).parents[3]


@pytest.mark.parametrize("path", [f"{PLUGINS}:best_of_group_advantages", f"{PLUGINS_FILE}:best_of_group_advantages"])
def test_user_estimator_by_import_path_is_used_for_advantages(path: str) -> None:
    cfg = load_config(None, [f"grpo.adv_estimator.name={path}"])
    check_plugin_names(cfg)
    assert cfg.grpo.adv_estimator.name == path
    result = compute_advantages(
        cfg.grpo.adv_estimator.name,
        rewards=torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0]),
        prompt_ids=torch.tensor([0, 0, 0, 1, 1]),
        valid_mask=torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]),
        normalize_rewards=True,
        use_leave_one_out_baseline=False,
    )
    assert result.advantages.tolist() == [0.0, -1.0, -0.5, 0.0, 0.0]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("grpo.adv_estimator.name=rlo", "grpo.adv_estimator.name: unknown advantage estimator 'rlo'. Did you mean 'rloo'?"),
        ("grpo.adv_estimator.name=dr-grpo", "Did you mean 'dr_grpo'?"),
        ("loss_fn.surrogate=cipso", "loss_fn.surrogate: unknown surrogate 'cipso'. Did you mean 'cispo'?"),
        ("loss_fn.reference_policy_kl_type=k33", "Did you mean 'k3'?"),
        ("loss_fn.trust_region_type=dppo_binary", "Did you mean 'dppo_binary_tv'?"),
        ("loss_fn.truncated_importance_sampling_type=icepo", "Did you mean 'icepop'?"),
        (
            f"grpo.adv_estimator.name={PLUGINS}:missing",
            "grpo.adv_estimator.name: 'tests.unit.algorithms.user_plugins' has no attribute 'missing'",
        ),
        (f"grpo.adv_estimator.name={PLUGINS}:NOT_CALLABLE", "is not callable"),
        ("grpo.adv_estimator.name=no_such_pkg.mod:fn", "grpo.adv_estimator.name: cannot import 'no_such_pkg.mod'"),
    ],
)
def test_unknown_names_are_config_errors_with_suggestions(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        check_plugin_names(load_config(None, [override]))
    assert message in str(excinfo.value)


def one_token() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One trained token: A = 2, pi_ref / pi_curr = e^-0.5 (|log ratio| 0.5): a penalty of 0.1 gives -A + 0.1 * 0.5."""
    curr = torch.tensor([[0.0, math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    data = {
        "advantages": torch.tensor([[0.0, 2.0]], dtype=torch.float64),
        "token_mask": torch.tensor([[0.0, 1.0]], dtype=torch.float64),
        "sample_mask": torch.ones(1, dtype=torch.float64),
        "generation_logprobs": curr.detach().clone(),
        "reference_policy_logprobs": curr.detach() - torch.tensor([[0.0, 0.5]], dtype=torch.float64),
    }
    return curr, data


def test_user_kl_estimator_by_import_path_is_used_in_the_loss() -> None:
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1, reference_policy_kl_type=f"{PLUGINS}:abs_log_ratio_kl")
    curr, data = one_token()
    loss, fragments = ClippedPGLossFn(cfg)(curr, data, 1, 1)
    assert loss.item() == pytest.approx(-2.0 + 0.1 * 0.5)
    assert fragments["kl_penalty"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"reference_policy_kl_type": f"{PLUGINS}:mean_kl"}, f"loss_fn.reference_policy_kl_type='{PLUGINS}:mean_kl' returned a "
         "Tensor of shape [] and dtype torch.float64, not a per-token tensor of the log-ratio's shape [1, 2]"),
        ({"trust_region_type": f"{PLUGINS}:float_keep"}, f"loss_fn.trust_region_type='{PLUGINS}:float_keep' returned a Tensor "
         "of shape [1, 2] and dtype torch.float32, not a bool keep mask of shape [1, 2]"),
        ({"surrogate": f"{PLUGINS}:bare_surrogate"}, f"loss_fn.surrogate='{PLUGINS}:bare_surrogate' returned a Tensor of shape "
         "[1, 2] and dtype torch.float64, not a Surrogate(loss, ratio, ratio_clamped, clipped) of per-token [1, 2] tensors"),
    ],
)  # fmt: skip
def test_a_loss_plugins_output_is_checked_naming_the_key(keys: dict, message: str) -> None:
    """A user's surrogate returning a bare tensor or a trust region's float mask failed deep in the loss (an
    AttributeError, a dtype error, in a policy worker's traceback); a KL estimator's scalar was broadcast into another
    penalty, silently."""
    cfg = ClippedPGLossConfig(reference_policy_kl_penalty=0.1, **keys)
    curr, data = one_token()
    with pytest.raises(ValueError) as excinfo:
        ClippedPGLossFn(cfg)(curr, data, 1, 1)
    assert str(excinfo.value) == message


def test_plugins_registered_in_the_users_process_reach_the_policy_workers(tmp_path, monkeypatch) -> None:
    """A KL estimator or trust region added to its registry in the driver's process passed the name check, then the
    policy worker (a process whose registries never saw it) failed at the first step: the loss now carries the
    functions it looked up, pickled, as it carries a registered surrogate; one named by a file path each process imports
    itself (pickled, it named a module only the driver had)."""
    from tests.unit.algorithms.user_plugins import abs_log_ratio_kl, keep_every_token

    names = ("test_runtime_abs_kl", "test_runtime_keep_all")  # registered for this test only (others list the registries)
    monkeypatch.setitem(loss_functions.KL_ESTIMATORS._entries, names[0], abs_log_ratio_kl)  # noqa: SLF001
    monkeypatch.setitem(loss_functions.TRUST_REGIONS._entries, names[1], keep_every_token)  # noqa: SLF001
    by_file = (f"{PLUGINS_FILE}:abs_log_ratio_kl", f"{PLUGINS_FILE}:keep_every_token")  # each process imports the file
    for kl_type, trust_region in (names, by_file):
        cfg = ClippedPGLossConfig(
            reference_policy_kl_penalty=0.1, reference_policy_kl_type=kl_type, trust_region_type=trust_region,
            trust_region_low=0.1, trust_region_high=0.1,
        )  # fmt: skip
        assert in_a_fresh_process(ClippedPGLossFn(cfg), tmp_path) == pytest.approx(-2.0 + 0.1 * 0.5), kl_type


def in_a_fresh_process(loss_fn: ClippedPGLossFn, tmp_path) -> float:
    """The loss of :func:`one_token`, computed by ``loss_fn`` pickled into a fresh process, as a policy worker is (only
    the built-in names are registered there; a file imported by path exists only where it was imported)."""
    import pickle
    import subprocess
    import sys

    curr, data = one_token()
    (tmp_path / "loss.pkl").write_bytes(pickle.dumps((loss_fn, curr.detach(), data)))
    worker = (
        "import pickle, sys\nloss_fn, curr, data = pickle.load(open(sys.argv[1], 'rb'))\n"
        "print(loss_fn(curr.requires_grad_(), data, 1, 1)[0].item())"
    )
    done = subprocess.run([sys.executable, "-c", worker, str(tmp_path / "loss.pkl")], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout)


def test_registering_a_surrogate_makes_it_a_valid_recipe_value() -> None:
    def negated(log_ratio, inputs, cfg):  # -(-A r): a deliberately different loss
        plain = loss_functions.unclipped_surrogate(log_ratio, inputs, cfg)
        return plain._replace(loss=-plain.loss)

    name = "test_negated_unclipped"
    if name not in loss_functions.SURROGATES:
        loss_functions.SURROGATES.add(name, negated)
    with pytest.raises(ValueError, match="already registered"):
        loss_functions.SURROGATES.add(name, negated)
    cfg = ClippedPGLossConfig(surrogate=name)
    curr = torch.tensor([[0.0, math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    data = {
        "advantages": torch.tensor([[0.0, 3.0]], dtype=torch.float64),
        "token_mask": torch.tensor([[0.0, 1.0]], dtype=torch.float64),
        "sample_mask": torch.ones(1, dtype=torch.float64),
        "generation_logprobs": curr.detach().clone(),
    }
    loss, _ = ClippedPGLossFn(cfg)(curr, data, 1, 1)
    assert loss.item() == pytest.approx(3.0)


def test_one_definition_of_each_kl_estimator() -> None:
    assert loss_functions.KL_ESTIMATORS is kl.KL_ESTIMATORS
    assert kl.KL_ESTIMATORS.names() == ["k1", "k2", "k3"]
    log_ratio = torch.linspace(-3, 3, 13, dtype=torch.float64)
    torch.testing.assert_close(metrics.kl_gen_train_k1(log_ratio), kl.kl_k1(log_ratio), rtol=0, atol=0)
    torch.testing.assert_close(metrics.kl_gen_train_k3(log_ratio), kl.kl_k3(log_ratio), rtol=0, atol=0)
    # Exact values: r = e^x -> k1 = -x, k2 = x^2/2, k3 = e^x - 1 - x.
    x = 0.7
    t = torch.tensor(x, dtype=torch.float64)
    assert (kl.kl_k1(t).item(), kl.kl_k2(t).item()) == (pytest.approx(-x), pytest.approx(x * x / 2))
    assert kl.kl_k3(t).item() == pytest.approx(math.exp(x) - 1 - x, rel=1e-14)


def test_k3_in_float32_is_non_negative_and_exact_near_r_equal_1() -> None:
    """Peer pitfall (unsloth-zoo#1240): ``exp(x) - 1 - x`` in float32 loses ``x^2 / 2`` to cancellation near ``x = 0``
    (12% off at ``x = 1e-3``) and goes negative; ``expm1(x) - x`` keeps it (float64 reference, float32 inputs)."""
    small = torch.tensor([1e-7, -1e-7, 3e-5, -3e-5, 1e-4, -1e-4], dtype=torch.float32)
    assert bool((kl.kl_k3(small) >= 0).all())
    x = torch.tensor([1e-3, -1e-3, 3e-3, -3e-3, 1e-2, -1e-2], dtype=torch.float32)
    exact = (torch.expm1(x.double()) - x.double()).float()
    torch.testing.assert_close(kl.kl_k3(x), exact, rtol=1e-3, atol=0)
