"""oneDNN linear on an x86 CPU: the same product and gradients as ``F.linear`` to float32 rounding, taken only where it
is measured to win; the lean decoder samples the same with it as without it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from nemo_like.models.generation.lean_decoder import sample
from nemo_like.models.processed_logprobs import SamplingDistribution
from nemo_like.utils import cpu_linear
from nemo_like.utils.cpu_linear import ONEDNN_MIN_MACS, linear, onednn_linear_available, prepacked, uses_onednn

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="oneDNN's linear op is used on x86-64 only")


@pytest.fixture(autouse=True)
def onednn_as_on_amd(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here routes products as an AMD machine does (oneDNN for larger unpacked products), whatever vendor
    runs the suite; :func:`test_the_vendor_decides_where_unpacked_products_go` checks the vendor rule itself."""
    monkeypatch.setattr(cpu_linear, "onednn_beats_blas", onednn_linear_available)


@needs_onednn
def test_the_vendor_decides_where_unpacked_products_go(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """AMD: larger unpacked float32 products through oneDNN; Intel (MKL's own fast paths) and an unknown vendor:
    ``F.linear``, bitwise. Packing (the sampler's decode weights) is the same on both."""
    from nemo_like.utils import cpus

    monkeypatch.undo()  # the real rule, not the fixture's
    x, weight = torch.randn(64, 384), torch.randn(3584, 384)
    for vendor, onednn in (("AuthenticAMD", True), ("GenuineIntel", False), (None, False)):
        cpuinfo = tmp_path / f"cpuinfo-{vendor}"
        cpuinfo.write_text("processor\t: 0\n" + (f"vendor_id\t: {vendor}\n" if vendor else "") + "model name\t: some CPU\n")
        monkeypatch.setattr(cpu_linear, "cpuinfo_field", lambda name, path=cpuinfo: cpus.cpuinfo_field(name, path))
        cpu_linear.onednn_beats_blas.cache_clear()
        try:
            assert cpu_linear.onednn_beats_blas() is onednn, vendor
            assert uses_onednn(x, weight) is onednn
            with torch.no_grad():
                if not onednn:
                    assert torch.equal(linear(x, weight), F.linear(x, weight))
                assert prepacked(weight, 64).is_mkldnn  # packing pays on both vendors
        finally:
            cpu_linear.onednn_beats_blas.cache_clear()


def test_cpuinfo_field_reads_the_first_matching_line(tmp_path) -> None:
    from nemo_like.utils.cpus import cpuinfo_field

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon: fast\n\nprocessor\t: 1\nvendor_id\t: X\n")
    assert cpuinfo_field("vendor_id", cpuinfo) == "GenuineIntel"
    assert cpuinfo_field("model name", cpuinfo) == "Xeon: fast"  # a colon in the value stays
    assert cpuinfo_field("model", cpuinfo) is None  # a whole key, not a prefix of one
    assert cpuinfo_field("vendor_id", tmp_path / "missing") is None


@needs_onednn
@pytest.mark.parametrize("shape", [(64, 384, 3584), (3, 50, 128, 512), (1344, 1792, 384)], ids=["decode", "3d", "prefill"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_linear_is_f_linear_to_float32_rounding(shape: tuple[int, ...], with_bias: bool) -> None:
    torch.manual_seed(0)
    *rows, k, n = shape
    x, weight = torch.randn(*rows, k), torch.randn(n, k) / k**0.5
    bias = torch.randn(n) if with_bias else None
    with torch.no_grad():
        assert uses_onednn(x, weight)
        got, expected = linear(x, weight, bias), F.linear(x, weight, bias)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_strided_or_expanded_bias_is_read_as_its_values() -> None:
    """oneDNN reads the bias as dense memory whatever its strides: a strided one gave sums off by ~4, an expanded one
    read past the tensor (1e38), through plain and packed weights alike."""
    torch.manual_seed(0)
    x, weight, full = torch.randn(64, 512), torch.randn(768, 512) / 512**0.5, torch.randn(3 * 768)
    for bias in (full[::3], torch.tensor([0.5]).expand(768), full[768:1536]):
        with torch.no_grad():
            for w in (weight, prepacked(weight, 64)):
                torch.testing.assert_close(linear(x, w, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_small_products_other_dtypes_and_autocast_keep_f_linear() -> None:
    big, weight = torch.randn(64, 384), torch.randn(3584, 384)
    assert not uses_onednn(torch.randn(8, 128), torch.randn(256, 128))  # 0.26M multiply-accumulates: below
    assert not uses_onednn(big.bfloat16(), weight.bfloat16())
    assert 8 * 128 * 256 < ONEDNN_MIN_MACS <= 64 * 128 * 256
    with torch.autocast("cpu", dtype=torch.bfloat16):  # F.linear runs in bfloat16 here: so must we
        assert not uses_onednn(big, weight)
        assert linear(big, weight).dtype == torch.bfloat16


@needs_onednn
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_gradients_are_f_linears_to_float32_rounding(with_bias: bool) -> None:
    """Training's path: input, weight and bias gradients through :class:`OneDNNLinear` against autograd's F.linear,
    on a 3-D input (the leading dimensions flattened in the backward) with a weight that is a transposed view."""
    torch.manual_seed(1)
    x = torch.randn(4, 96, 384, requires_grad=True)
    weight = torch.randn(384, 1792).t().requires_grad_()  # [1792, 384], not contiguous
    bias = torch.randn(1792, requires_grad=True) if with_bias else None
    upstream = torch.randn(4, 96, 1792)
    grads = {}
    for name, fn in (("onednn", linear), ("torch", F.linear)):
        leaves = [t for t in (x, weight, bias) if t is not None]
        for t in leaves:
            t.grad = None
        out = fn(x, weight, bias)
        assert (out.grad_fn.name() == "OneDNNLinearBackward") == (name == "onednn")
        out.backward(upstream)
        grads[name] = [t.grad.clone() for t in leaves]
    for got, expected in zip(grads["onednn"], grads["torch"]):  # sums of 384 to 1792 products: float32 rounding
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@needs_onednn
def test_the_lean_decoder_samples_the_same_with_onednn_as_with_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every matmul of the fused step through oneDNN (threshold 0) against none (the threshold out of reach): the
    same greedy tokens, logprobs to float32 rounding, and the same seeded draws at temperature 1."""
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = Qwen2ForCausalLM(cfg).eval()
    prompts = [[3, 5, 7, 11], [4, 8], [9, 10, 11, 12, 13, 14]] * 4
    runs = {}
    for name, threshold in (("onednn", 0), ("torch", 1 << 62)):
        monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", threshold)
        monkeypatch.setattr(cpu_linear, "PACK_MIN_MACS", threshold - 1)  # oneDNN's products on packed weights
        runs[name] = [sample(model, prompts, 10, SamplingDistribution(), [], 0, seed=7, greedy=g) for g in (True, False)]
    for onednn, plain in zip(runs["onednn"], runs["torch"]):
        assert torch.equal(onednn.tokens, plain.tokens)
        torch.testing.assert_close(onednn.logprobs, plain.logprobs, rtol=1e-5, atol=2e-5)


@needs_onednn
def test_packed_weights_equal_plain_ones_and_an_in_flight_refit_reaches_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused step packs its weights once per call (:func:`prepacked`): products through a packed weight equal the
    plain one's, small products keep the plain weight, and a refit in the middle of a call (weights replaced in place,
    ``between_steps`` returns True) reaches the packed copies: greedy tokens after it are what F.linear gives, and
    differ from a call without the refit."""
    weight, x = torch.randn(1280, 384), torch.randn(64, 384)
    packed = prepacked(weight, 64)
    assert packed.is_mkldnn and torch.equal(linear(x, packed), linear(x, weight))
    assert not prepacked(torch.randn(1024, 128), 64).is_mkldnn  # 2^23 multiply-accumulates: packing would not pay

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model, updated = Qwen2ForCausalLM(cfg).eval(), Qwen2ForCausalLM(cfg).eval()  # two random inits: the refit's weights
    prompts = [[3, 5, 7, 11], [4, 8], [9, 10, 11, 12, 13, 14]] * 4

    def run(threshold: int, refit_at: int | None) -> object:
        monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", threshold)
        monkeypatch.setattr(cpu_linear, "PACK_MIN_MACS", threshold - 1)
        served = copy.deepcopy(model)

        def refit(t: int) -> bool:
            if t != refit_at:
                return False
            with torch.no_grad():
                for p, q in zip(served.parameters(), updated.parameters()):
                    p.copy_(q)
            return True

        return sample(served, prompts, 10, SamplingDistribution(), [], 0, seed=7, greedy=True, between_steps=refit)

    packed_run, plain_run, without_refit = run(0, 3), run(1 << 62, 3), run(0, None)
    assert torch.equal(packed_run.tokens, plain_run.tokens)
    torch.testing.assert_close(packed_run.logprobs, plain_run.logprobs, rtol=1e-5, atol=2e-5)
    assert torch.equal(packed_run.tokens[:, :4], without_refit.tokens[:, :4])
    assert not torch.equal(packed_run.tokens[:, 4:], without_refit.tokens[:, 4:])
