"""A lean sampling loop for small decoder-only models: KV cache, our own sampler, no ``generate`` machinery.

On a CPU, a small model's decode step is a few dozen tiny kernels, so what surrounds them decides the
speed: HF ``generate`` (logits processors, stopping criteria, cache objects, mask builders) or a separate
vLLM engine (scheduler, input preparation, and a weight refit before each step's generation). The
inline backend (:mod:`.inline`) samples inside the policy worker with the training weights and this loop.

Two step functions share one loop (:func:`sample`):

* :class:`FusedLlamaStep` for the Llama family (``llama``, ``qwen2``, ``mistral`` without a sliding window):
  the transformer's math written out on the model's own parameters, with the query/key/value and the
  gate/up projections fused into one matmul each (fused copies are built once per call), a preallocated KV
  cache, and the model's own rotary embedding module (so every RoPE scaling variant is the model's); on an x86 CPU
  its larger float32 matmuls run through oneDNN on weights packed once per call into oneDNN's layout
  (:mod:`~nemo_like.utils.cpu_linear`: faster than torch's BLAS there on AMD and Intel CPUs alike);
* :class:`HFModelStep` for anything else: the model's forward with a transformers ``DynamicCache``.

``tests/unit/models/test_lean_decoder.py`` checks the fused step's logits against the model's own forward,
prefill and decode, with left padding, and the sampler's logprobs against :func:`processed_token_logprobs`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from nemo_like.models.attention import attention
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams, StopStringWatch, prompt_seeds, version_at
from nemo_like.models.llama_family import rms_norm_with, rotary_tables
from nemo_like.models.llama_family import supported as fused_step_supported
from nemo_like.models.processed_logprobs import SamplingDistribution, sampling_keep_mask
from nemo_like.utils.cpu_linear import linear, packs, prepacked


@dataclass
class SampledBatch:
    """``tokens`` / ``logprobs``: ``[B, N]`` (N = steps run); ``lengths[i]``: tokens of row i up to and including
    its first stop token (N when none); ``stopped[i]``: whether row i ended with a stop token."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: list[int]
    stopped: list[bool]

    def sample_dicts(self, prompts: list[list[int]], weight_version: int, version_changes: Sequence[tuple[int, int]] = ()) -> list[dict]:
        """:class:`~.interface.GeneratedSample` fields of every row, as dicts (what the workers return over Ray).
        ``version_changes``: the in-flight refits of the call ((first position the new weights produced, version)), so a
        row's last token's version and, after a stop string's cut, the kept tokens' are known."""
        out = []
        changes = tuple((int(first), int(version)) for first, version in version_changes)
        for i, prompt in enumerate(prompts):
            n = self.lengths[i]
            sample = GeneratedSample(
                prompt_ids=list(prompt),
                response_ids=self.tokens[i, :n].tolist(),
                response_logprobs=self.logprobs[i, :n].tolist(),
                truncated=not self.stopped[i],
                weight_version=weight_version,
                final_weight_version=version_at(n - 1, weight_version, changes),
                weight_version_changes=tuple(c for c in changes if c[0] < n),  # the refits this row's tokens saw
            )
            out.append(asdict(sample))
        return out


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, ``[B, P]``: every prompt ends at the same column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = True
    return input_ids, mask


class FusedLlamaStep:
    """Prefill/decode for a Llama-family ``*ForCausalLM`` on its own parameters (read, never written).

    Per call (:func:`sample`) it builds the fused projection weights (packed for oneDNN where it takes the decode
    products of ``decode_rows`` rows: :func:`~nemo_like.utils.cpu_linear.prepacked`; a packed copy of the weights
    lives for the call), the KV cache and the rotary tables of every position the call can reach (one call of the
    model's rotary module), so a decode step is little more than its matmuls: few small kernels matter on a CPU,
    where each costs microseconds whatever its size."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, decode_rows: int | None = None) -> None:
        cfg = model.config
        self.model, self.inner = model, model.model
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.decode_rows = decode_rows or batch
        param = next(model.parameters())
        self.residual_dtype = param.dtype
        self.compute_dtype = products_dtype(param)
        self.layers: list[tuple] = []
        self.refresh_weights()
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        # keys and values as the residual stream holds them (the parameters' dtype): float32 under autocast, which
        # attention reads as it is on a CPU (models.attention) and casts to bf16 itself elsewhere
        self.k_cache = [torch.empty(shape, dtype=self.residual_dtype, device=param.device) for _ in self.layers]
        self.v_cache = [torch.empty(shape, dtype=self.residual_dtype, device=param.device) for _ in self.layers]
        self.intermediate = self.inner.layers[0].mlp.gate_proj.weight.shape[0]  # gate/up may be packed: read the module
        self.cos = self.signed_sin = None

    def refresh_weights(self) -> None:
        """(Re)build the fused projection weights from the model's parameters: at construction, and after the
        weights were replaced in place mid-call (an in-flight refit, see ``sample(between_steps=...)``)."""
        layers = []

        def product_weight(*weights: torch.Tensor) -> torch.Tensor:
            # In the products' dtype once per call (autocast would cast each weight at every decode step), packed
            # for oneDNN where it pays; the parts of a fused projection side by side.
            cast = [w.to(self.compute_dtype) for w in weights]
            return prepacked(cast[0] if len(cast) == 1 else torch.cat(cast), self.decode_rows)

        for layer in self.inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            layers.append(
                (
                    layer.input_layernorm.weight,
                    product_weight(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                    None if biases[0] is None else torch.cat(biases),
                    product_weight(attn.o_proj.weight),
                    attn.o_proj.bias,
                    layer.post_attention_layernorm.weight,
                    product_weight(mlp.gate_proj.weight, mlp.up_proj.weight),
                    product_weight(mlp.down_proj.weight),
                )
            )
        self.layers = layers
        head = self.model.lm_head
        self.head = (product_weight(head.weight), head.bias) if isinstance(head, torch.nn.Linear) else None

    def set_positions(self, positions: torch.Tensor) -> None:
        """Rotary tables for ``positions`` (``[B, max_len]``: every column the call can fill), from the model's own
        rotary module, with the sign of ``rotate_half`` folded into the sine (:func:`~..llama_family.rotary_tables`)."""
        cos, signed_sin = rotary_tables(self.inner.rotary_emb, positions, self.residual_dtype, self.head_dim)
        self.cos, self.signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)  # [B, 1, max_len, head_dim]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Continue with row ``rows[i]`` of the cache and rotary tables as row ``i`` (a shared prefill)."""
        self.k_cache = [c.index_select(0, rows) for c in self.k_cache]
        self.v_cache = [c.index_select(0, rows) for c in self.v_cache]
        self.cos, self.signed_sin = self.cos.index_select(0, rows), self.signed_sin.index_select(0, rows)

    def forward(self, input_ids: torch.Tensor, start: int, attn_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of the last column of ``input_ids`` (``[B, T]``, cache columns ``start:start+T``);
        ``attn_mask``: ``[B, 1, T, start+T]`` bool, True where a query may attend to a key."""
        batch, width = input_ids.shape
        end = start + width
        heads, qk_heads, half = self.heads, self.heads + self.kv_heads, self.head_dim // 2
        cos, signed_sin = self.cos[:, :, start:end], self.signed_sin[:, :, start:end]
        h = self.inner.embed_tokens(input_ids)
        for i, (ln1, qkv_w, qkv_b, o_w, o_b, ln2, gate_up, down) in enumerate(self.layers):
            qkv = linear(rms_norm_with(h, ln1, self.eps), qkv_w, qkv_b)
            qkv = qkv.view(batch, width, qk_heads + self.kv_heads, self.head_dim).transpose(1, 2)
            qk = qkv[:, :qk_heads]
            qk = qk * cos + qk.roll(half, dims=-1) * signed_sin  # RoPE on queries and keys at once
            self.k_cache[i][:, :, start:end] = qk[:, heads:]
            self.v_cache[i][:, :, start:end] = qkv[:, qk_heads:]
            attn = attention(qk[:, :heads], self.k_cache[i][:, :, :end], self.v_cache[i][:, :, :end], attn_mask, self.kv_heads != heads)
            h = h + linear(attn.transpose(1, 2).reshape(batch, width, heads * self.head_dim), o_w, o_b)
            gate, up = linear(rms_norm_with(h, ln2, self.eps), gate_up).split(self.intermediate, dim=-1)
            h = h + linear(F.silu(gate) * up, down)
        last = rms_norm_with(h[:, -1], self.inner.norm.weight, self.eps)
        return linear(last, *self.head) if self.head is not None else self.model.lm_head(last)


def products_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype the sampler's matmuls run in for a model whose parameters are like ``param``: the autocast dtype
    where autocast is on for its device (a ``policy.precision: bfloat16`` run samples its float32 masters under
    autocast, as its logprob passes run), else the parameters' own."""
    device_type = param.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else param.dtype


def fused_step_copy_elements(
    layers: int,
    hidden: int,
    intermediate: int,
    q_width: int,
    kv_width: int,
    vocab: int,
    rows: int,
    dtype: torch.dtype,
    on_cpu: bool = True,
    cast: bool = False,
) -> int:
    """Elements of the weight copies a :class:`FusedLlamaStep` holds during a call sampling ``rows`` rows with products
    in ``dtype`` (the memory planner counts them): per layer the fused query/key/value and gate/up projections (always
    new tensors), the output and down projections only where they are ``cast`` to ``dtype`` (sampling float32 weights
    under autocast) or :func:`~nemo_like.utils.cpu_linear.packs` packs them (on a CPU: ``on_cpu``), and the output head
    likewise (the fused query/key/value bias, a few values a layer, is left out)."""
    fused = (q_width + 2 * kv_width) * hidden + 2 * intermediate * hidden

    def packed(out: int, inp: int) -> bool:
        return cast or (on_cpu and packs(rows, out, inp, dtype))

    per_layer = fused + sum(out * inp for out, inp in [(hidden, q_width), (hidden, intermediate)] if packed(out, inp))
    return layers * per_layer + (vocab * hidden if packed(vocab, hidden) else 0)


#: Model types this sampler cannot sample, and why: their state is not kept to each row of a left-padded batch (a
#: row's padding enters it) or lives in a cache of their own that a transformers ``DynamicCache`` cannot stand for.
UNSAMPLED_MODEL_TYPES = {
    "minimax": "its lightning-attention layers keep a cache of their own and let a left-padded row's padding into their state",
    "recurrent_gemma": "its recurrent blocks let a left-padded row's padding into their state",
    "rwkv": "its forward ignores the attention mask (a left-padded row's padding enters its state) and takes its state "
    "under a name of its own",
    "xlstm": "it keeps its state in a cache class of its own",
}


def sampling_problem(model_type: str | None, forward: Callable[..., object]) -> str | None:
    """Why :func:`sample` cannot sample a model of ``model_type`` whose forward is ``forward`` (its signature is read),
    or ``None``: a listed type (:data:`UNSAMPLED_MODEL_TYPES`), or a forward that takes neither ``past_key_values`` nor
    ``cache_params`` (each step would start from an empty cache). A wrapper's ``forward(*args, **kwargs)`` (PEFT's)
    passes: no engine samples a wrapped model (they load merged weights)."""
    if model_type in UNSAMPLED_MODEL_TYPES:
        return UNSAMPLED_MODEL_TYPES[model_type]
    taken = inspect.signature(forward).parameters
    delegates = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in taken.values())
    if not delegates and "past_key_values" not in taken and "cache_params" not in taken:
        return "its forward takes no cache (neither past_key_values nor cache_params), so every step would start afresh"
    return None


def model_sampling_problem(model_name: str, local_only: bool = False) -> str | None:
    """:func:`sampling_problem` for model ``model_name`` read from its config on the driver (its causal-LM class, not
    built), or ``None``; a model whose class transformers does not map (remote code) is not judged here."""
    from transformers import AutoModelForCausalLM

    from nemo_like.models.loading import model_config

    config = model_config(model_name, local_only)
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return None
    problem = sampling_problem(getattr(config, "model_type", None), model_class.forward)
    return f"{model_class.__name__}: {problem}" if problem else None


class HFModelStep:
    """The same interface on the model's own forward and a transformers ``DynamicCache`` (any architecture)."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int) -> None:
        from transformers import DynamicCache

        # The config gives each layer its cache as generate() does: a hybrid model's linear-attention layers need theirs
        self.model, self.cache = model, DynamicCache(config=model.config)
        self.positions: torch.Tensor | None = None
        # A state-space model (Mamba, Mamba2, FalconMamba) takes its cache as ``cache_params``: under the other name it
        # fell into **kwargs and each call built a fresh, empty state. It masks the current tokens' columns only.
        # A wrapper's forward(*args, **kwargs) (PEFT's) counts as taking past_key_values (no engine samples a wrapped
        # model: they load merged weights).
        taken = inspect.signature(model.forward).parameters
        self.recurrent = "cache_params" in taken and "past_key_values" not in taken
        if problem := sampling_problem(getattr(model.config, "model_type", None), model.forward):
            raise ValueError(f"{type(model).__name__}: this sampler cannot sample it: {problem}")

    def refresh_weights(self) -> None:
        """Nothing to rebuild: every step runs the model's own forward on its current parameters."""

    def set_positions(self, positions: torch.Tensor) -> None:
        """``[B, max_len]`` position ids of every column the call can fill."""
        self.positions = positions

    def forward(self, input_ids: torch.Tensor, start: int, attn_mask: torch.Tensor) -> torch.Tensor:
        key_valid = attn_mask[:, 0, -1, :]  # the last query row sees every valid key
        positions = self.positions[:, start : start + input_ids.shape[1]]
        if self.recurrent:
            cache, mask = {"cache_params": self.cache}, key_valid[:, -input_ids.shape[1] :]
        else:
            cache, mask = {"past_key_values": self.cache}, key_valid
        out = self.model(input_ids=input_ids, attention_mask=mask.long(), position_ids=positions, use_cache=True, logits_to_keep=1, **cache)
        return out.logits[:, -1]


def draw_per_row(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """``[B]`` tokens, row ``i`` drawn from ``probs[i]`` with ``generators[i]`` alone: the draw of
    ``torch.multinomial(probs[i : i + 1], 1, generator=generators[i])`` (the exponential race torch runs for one
    sample, ``argmax(p / q)`` with ``q ~ Exp(1)``), with each row's noise from its own generator and one argmax for all."""
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators):
        row.exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


class RowNoise:
    """Per-row generators (``generators[i]`` row ``i``'s alone) whose exponential-race noise is drawn ``block`` decode
    steps at a time: one ``exponential_`` call per row per block of steps instead of one per row per step (64 rows x 64
    steps: 256 calls instead of 4096). A CPU generator's ``exponential_`` stream does not depend on how it is cut
    (``test_row_noise_draws_what_a_call_per_step_draws``), so every row draws exactly what :func:`draw_per_row` draws
    step by step. Not on CUDA, where a call's values depend on its size (each element's stream offset is its position in
    the call): :func:`sample` uses it for CPU generators only. ``steps``: the most steps the call can take (no block
    draws past it)."""

    def __init__(self, generators: list[torch.Generator], steps: int, block: int = 16) -> None:
        self.generators, self.steps_left, self.block = generators, steps, block
        self._noise: torch.Tensor | None = None  # [rows, steps in the block, vocabulary]
        self._used = 0

    def next(self, probs: torch.Tensor) -> torch.Tensor:
        """``[rows, V]`` Exp(1) variates for this step (``probs``: its shape, dtype and device)."""
        if self._noise is None or self._used == self._noise.shape[1] or self._noise.shape[2] != probs.shape[1]:
            steps = max(1, min(self.block, self.steps_left))
            self._noise = torch.empty((probs.shape[0], steps, probs.shape[1]), dtype=probs.dtype, device=probs.device)
            for row, generator in zip(self._noise, self.generators):
                row.exponential_(generator=generator)
            self._used = 0
        self.steps_left -= 1
        self._used += 1
        return self._noise[:, self._used - 1]


def uniforms(generator: torch.Generator | list[torch.Generator], rows: int, device: torch.device) -> torch.Tensor:
    """``[rows, 1]`` float64 uniforms in [0, 1): from one generator for the batch, or row ``i``'s from ``generator[i]``
    alone (the same call a batch of one row makes, so a row draws what it draws alone, whatever else is in the batch)."""
    if isinstance(generator, torch.Generator):
        return torch.rand(rows, 1, generator=generator, dtype=torch.float64, device=device)
    return torch.cat([torch.rand(1, 1, generator=g, dtype=torch.float64, device=device) for g in generator])


# Up to this vocabulary size a token is drawn by the exponential race (``torch.multinomial``): one Exp(1) variate per
# entry, ~20 ns each on a CPU, which costs little here and keeps every seeded draw of the small models (the tiny
# recipes, their recorded figures, resumed runs) what it was. Larger vocabularies draw by inverse CDF (one uniform a
# row): at 64 rows of a 151,936-token vocabulary the race takes ~270-400 ms a decode step on a 2-core CPU.
RACE_MAX_VOCAB = 4096
INVERSE_CDF_BLOCK = 1024  # vocabularies larger than this are searched in two levels: blocks, then a block's tokens


def _pick(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first index whose cumulative weight (float64) exceeds ``u * total`` (``[B, 1]``), and where in that
    entry's own mass the target fell (``[B, 1]``, in [0, 1)). An entry of zero weight is never picked: its cumulative
    weight equals its predecessor's, and the target stays below the total."""
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True)
    before = torch.where(index > 0, cdf.gather(1, (index - 1).clamp(min=0)), torch.zeros_like(target))
    return index, (target - before) / (cdf.gather(1, index) - before)


def inverse_cdf_tokens(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[B]`` tokens, row ``i``'s drawn with probability ``probs[i, j] / probs[i].sum()`` given ``u[i]`` ~ U[0, 1)
    (``[B, 1]``, float64): the first token whose cumulative mass exceeds ``u * total``; never one of zero mass.

    Cumulative sums are float64: float32's rounding over a 150k vocabulary would move ~1e-5 of mass between tokens.
    Above :data:`INVERSE_CDF_BLOCK` tokens, two levels: a block is picked by its float32 mass (an error of ~1e-7 of
    that mass, float32's own precision), then a token inside it from the same uniform's position within the block's
    mass, over the block's float64 cumulative sum; a float64 pass over the whole vocabulary would cost 50x more.

    One uniform per row, where ``torch.multinomial`` draws one Exp(1) variate per vocabulary entry (the race
    ``argmax(p / q)``): ``python benchmarks/sampler.py`` prints both."""
    rows, vocab = probs.shape
    if vocab <= INVERSE_CDF_BLOCK:
        return _pick(probs, u)[0].squeeze(-1)
    whole = vocab // INVERSE_CDF_BLOCK * INVERSE_CDF_BLOCK
    block_mass = probs[:, :whole].reshape(rows, -1, INVERSE_CDF_BLOCK).sum(dim=-1)
    if whole < vocab:
        block_mass = torch.cat([block_mass, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=1)
    block, within = _pick(block_mass, u)
    ids = block * INVERSE_CDF_BLOCK + torch.arange(INVERSE_CDF_BLOCK, device=probs.device)
    inside = probs.gather(1, ids.clamp(max=vocab - 1)) * (ids < vocab)  # the last block's missing tokens weigh 0
    return ids.gather(1, _pick(inside, within)[0]).squeeze(-1)


def draw(
    logits: torch.Tensor,
    dist: SamplingDistribution,
    greedy: bool,
    generator: torch.Generator | list[torch.Generator] | RowNoise,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B]`` tokens and their logprobs under the processed distribution (greedy: argmax, plain softmax logprob).
    ``generator``: one for the batch, or one per row (a list, or a :class:`RowNoise` over them). Up to
    :data:`RACE_MAX_VOCAB` tokens, the exponential race (``torch.multinomial``, or :func:`draw_per_row`); above,
    :func:`inverse_cdf_tokens` with :func:`uniforms`."""
    if greedy:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = dist.scale(logits)
    if dist.truncates:
        scaled = scaled.masked_fill(~sampling_keep_mask(scaled, dist.top_k, dist.top_p), float("-inf"))
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp()
    broken = ~torch.isfinite(probs.sum(dim=-1))  # probabilities are in [0, 1] or NaN: one reduction finds a NaN
    if bool(broken.any()):
        # Non-finite weights (a diverged update) give NaN logits: such rows draw uniformly and report a NaN logprob,
        # so the run goes on to the trainer's non-finite step handling (grpo.max_consecutive_nonfinite_steps)
        # instead of dying inside the sampler.
        probs[broken] = 1.0
    if probs.shape[-1] > RACE_MAX_VOCAB:
        generators = generator.generators if isinstance(generator, RowNoise) else generator
        tokens = inverse_cdf_tokens(probs, uniforms(generators, probs.shape[0], probs.device))
    elif isinstance(generator, RowNoise):
        tokens = (probs / generator.next(probs)).argmax(dim=-1)
    elif isinstance(generator, torch.Generator):
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    else:
        tokens = draw_per_row(probs, generator)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def seeded_generators(seed: int | list[int], num_prompts: int, device: torch.device) -> torch.Generator | list[torch.Generator]:
    """One generator seeded ``seed`` for the batch, or (a list of seeds) one per prompt seeded ``seed[i]``."""
    if isinstance(seed, (list, tuple)):
        return [torch.Generator(device=device).manual_seed(s) for s in prompt_seeds(seed, num_prompts)]
    return torch.Generator(device=device).manual_seed(seed)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    dist: SamplingDistribution,
    stop_token_ids: list[int],
    pad_token_id: int,
    seed: int | list[int],
    greedy: bool = False,
    fused: bool | None = None,
    between_steps: Callable[[int], bool] | None = None,
    stop_watch: StopStringWatch | None = None,
) -> SampledBatch:
    """Sample up to ``max_new_tokens`` per prompt from ``model`` (left-padded batch, KV cache); stops early when
    every row has produced a stop token, or (``stop_watch``) a token that completes a stop string. Tokens after a
    row's stop are padding.

    A GRPO batch repeats each prompt G times: with the fused step, each distinct prompt is prefilled once and its
    KV cache copied to its rows. ``fused``: None picks :class:`FusedLlamaStep` where it applies; False forces the
    model's own forward (benchmarks and tests compare the two).

    ``seed``: an int seeds one generator for the batch; a list gives row ``i`` its own (:func:`draw_per_row`,
    :func:`uniforms`), so a row draws what it draws alone with that seed, whatever else is in the batch (its logits
    agree to float rounding).

    ``between_steps(t)``: called after token ``t`` of every row is drawn, before the forward that produces the
    logits of token ``t + 1``; it may replace the model's weights in place (an in-flight refit) and returns whether
    it did, so that tokens ``t + 1`` on come from the new weights (the KV cache of earlier positions is kept)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    empty = [i for i, prompt in enumerate(prompts) if not prompt]
    if empty:
        raise ValueError(f"prompts {empty[:10]} are empty: a row needs at least one token to condition on")
    device = next(model.parameters()).device
    if fused is None:
        fused = fused_step_supported(model)
    elif fused and not fused_step_supported(model):
        raise ValueError(f"the fused step does not serve {type(model).__name__} (see fused_step_supported)")
    distinct: dict[tuple[int, ...], int] = {}
    row_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    share_prefill = fused and len(distinct) < len(prompts)
    input_ids, prompt_mask = left_padded([list(p) for p in distinct] if share_prefill else prompts, pad_token_id)
    input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
    width = input_ids.shape[1]
    max_len = width + max_new_tokens
    step = FusedLlamaStep(model, input_ids.shape[0], max_len, len(prompts)) if fused else HFModelStep(model, input_ids.shape[0], max_len)
    generator = seeded_generators(seed, len(prompts), device)
    if isinstance(generator, list) and device.type == "cpu":
        generator = RowNoise(generator, max_new_tokens)
    stop_ids = torch.tensor(sorted(set(stop_token_ids)) or [-1], device=device)

    # Prefill: causal over the prompt, padding keys masked; each query also sees itself, so padding rows
    # (never read) stay finite.
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    prefill_mask = (causal & prompt_mask[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)
    prompt_positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    after = prompt_positions[:, -1:] + torch.arange(1, max_new_tokens + 1, device=device)
    step.set_positions(torch.cat([prompt_positions, after], dim=1))
    logits = step.forward(input_ids, 0, prefill_mask[:, None])
    if share_prefill:
        rows = torch.tensor(row_of, device=device)
        step.select_rows(rows)
        logits, prompt_mask = logits[rows], prompt_mask[rows]
    batch = len(prompts)
    key_valid = torch.zeros((batch, max_len), dtype=torch.bool, device=device)
    key_valid[:, :width] = prompt_mask

    tokens, logprobs = [], []
    row_ids: list[list[int]] = [[] for _ in range(batch)]  # each row's tokens so far, for the stop-string watch
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long, device=device)
    for t in range(max_new_tokens):
        token, logprob = draw(logits, dist, greedy, generator)
        token = token.masked_fill(finished, pad_token_id)
        tokens.append(token)
        logprobs.append(logprob.masked_fill(finished, 0.0))
        just_stopped = ~finished & torch.isin(token, stop_ids)
        if stop_watch is not None:
            just_stopped |= at_stop_string(stop_watch, row_ids, token, finished)
        lengths = torch.where(just_stopped, t + 1, lengths)
        finished |= just_stopped
        if t == max_new_tokens - 1 or bool(finished.all()):
            break
        if between_steps is not None and between_steps(t):
            step.refresh_weights()
        key_valid[:, width + t] = True
        logits = step.forward(token[:, None], width + t, key_valid[:, None, None, : width + t + 1])
    return SampledBatch(
        tokens=torch.stack(tokens, dim=1).cpu(),
        logprobs=torch.stack(logprobs, dim=1).cpu(),
        lengths=lengths.tolist(),
        stopped=finished.tolist(),
    )


def at_stop_string(watch: StopStringWatch, row_ids: list[list[int]], token: torch.Tensor, finished: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the running rows whose text ``token`` (the step's draw) completes a stop string; appends the draw
    to each running row's ``row_ids``."""
    hit = [False] * len(row_ids)
    for i, (drawn, done) in enumerate(zip(token.tolist(), finished.tolist(), strict=True)):
        if not done:
            row_ids[i].append(drawn)
            hit[i] = watch.can_end(drawn) and watch.holds(row_ids[i])
    return torch.tensor(hit, device=token.device)


def sampling_distribution(sp: SamplingParams) -> SamplingDistribution:
    """The distribution :func:`sample` draws from under ``sp`` (greedy: the plain softmax of the logits)."""
    if sp.greedy:
        return SamplingDistribution()
    return SamplingDistribution(sp.temperature, sp.top_k, sp.top_p)


def sample_with_params(
    model: torch.nn.Module,
    prompts: list[list[int]],
    sp: SamplingParams,
    eos_token_ids: list[int],
    pad_token_id: int,
    seed: int | list[int],
    between_steps: Callable[[int], bool] | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> SampledBatch:
    """:func:`sample` under a backend's :class:`~.interface.SamplingParams`: stops at the model's eos ids and ``sp``'s
    stop ids, and (given the tokenizer's ``decode``) at ``sp``'s stop strings."""
    stop_ids = [*eos_token_ids, *sp.stop_token_ids]
    watch = StopStringWatch(decode, sp.stop_strings) if decode is not None and sp.stop_strings else None
    return sample(
        model, prompts, sp.max_new_tokens, sampling_distribution(sp), stop_ids, pad_token_id, seed, sp.greedy,
        between_steps=between_steps, stop_watch=watch,
    )  # fmt: skip
