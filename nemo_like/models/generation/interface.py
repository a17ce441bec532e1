"""What every generation backend provides, and the sample format it returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nemo_like.models.refit.interface import WeightReceiver, WeightSource, export_weights  # noqa: F401 (re-exported)


def version_at(position: int, start_version: int, changes: Sequence[tuple[int, int]]) -> int:
    """The weight version of response position ``position`` of a sequence that started at ``start_version`` and saw
    the in-flight refits ``changes`` ((first position the new weights produced, their version), in order)."""
    version = start_version
    for first_position, swapped_to in changes:
        if position >= first_position:
            version = swapped_to
    return version


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings; ``greedy`` overrides temperature/top-p/top-k."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # The exact cut is the driver's, after generation (stop_string_prefix); engines stop a row's sampling there too
    stop_strings: tuple[str, ...] = ()


def sampling_params(cfg: Any, greedy: bool = False) -> SamplingParams:
    """The recipe's decoding settings (``policy.generation``) as :class:`SamplingParams`."""
    g = cfg.policy.generation
    return SamplingParams(
        max_new_tokens=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=g.top_k,
        greedy=greedy,
        stop_token_ids=tuple(g.stop_token_ids or ()),
        stop_strings=tuple(g.stop_strings or ()),
    )


@dataclass
class GeneratedSample:
    """One response. ``response_logprobs[i]`` = log p(response_ids[i] | prompt, response_ids[:i])
    under the processed distribution the token was sampled from (temperature, then top-k / top-p,
    renormalised over the kept tokens) of the weights that generated it.

    A multi-turn sample (:mod:`nemo_like.experience.multi_turn`) is one such row too: ``response_ids``
    holds everything after the prompt (each turn's sampled ids and each observation's ids, in order),
    ``response_mask[i]`` is 1 where the policy sampled ``response_ids[i]`` and 0 on observation tokens
    (whose logprobs are 0), and ``messages`` the turns as chat messages. ``response_mask=None`` means
    every response token was sampled (single-turn)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    truncated: bool  # hit max_new_tokens without a stop token
    weight_version: int  # the weights the sequence started with (the oldest that produced any of its tokens)
    final_weight_version: int | None = None  # the weights of its last token (differs after an in-flight refit)
    response_mask: list[int] | None = None  # multi-turn: 1 = sampled by the policy, 0 = observation token
    num_turns: int = 1  # model turns in the sample
    length_truncated: bool = False  # multi-turn: ended because policy.max_total_sequence_length left no room
    messages: list[dict[str, str]] | None = None  # multi-turn: the turns after the prompt (assistant + observations)
    step_metrics: dict[str, float] | None = None  # multi-turn: the environment steps' per-sample metrics, summed
    # Tokens the engine decoded for the sampled turns when more than were kept: stop strings cut after generation, so
    # the tokens past the cut cost generation time (and FLOPs) though no row holds them. None: as many as were kept.
    decoded_tokens: int | None = None
    # The in-flight refits its tokens saw: (first response position the new weights produced, their version), in
    # order; () none; None: not known (vLLM reports the last token's version only, ``final_weight_version``).
    weight_version_changes: tuple[tuple[int, int], ...] | None = None
    # Multi-turn: a branched episode's later row (its prompt is the whole conversation, rendered): the tokens of that
    # prompt that are the content of the observation that branched it (an unbranched row holds it as response tokens).
    prompt_observation_tokens: int = 0

    def version_at(self, position: int) -> int | None:
        """The weight version that produced response token ``position`` (None when the engine does not say)."""
        if self.weight_version_changes is None:
            return None
        return version_at(position, self.weight_version, self.weight_version_changes)

    def kept_version(self, kept: int) -> int | None:
        """The weight version of the last of the first ``kept`` response tokens (a stop string's or a call's own
        ``max_tokens`` cut inside the draw): per position where the engine records its in-flight refits (HF), else the
        draw's last token's (vLLM: an upper bound)."""
        version = self.version_at(kept - 1) if kept else None
        return self.final_weight_version if version is None else version

    @property
    def sampled_mask(self) -> list[int]:
        """1 per response token the policy sampled (trained), 0 per observation token."""
        return [1] * len(self.response_ids) if self.response_mask is None else list(self.response_mask)

    @property
    def num_sampled_tokens(self) -> int:
        """How many response tokens the policy sampled (observation tokens excluded)."""
        return len(self.response_ids) if self.response_mask is None else sum(self.response_mask)

    @property
    def num_decoded_tokens(self) -> int:
        """How many tokens the engine decoded for this sample: :attr:`num_sampled_tokens` plus any a stop string cut."""
        return self.num_sampled_tokens if self.decoded_tokens is None else self.decoded_tokens

    @property
    def refitted_mid_sequence(self) -> bool:
        """Whether an in-flight refit changed the weights while this response was being generated."""
        return self.final_weight_version is not None and self.final_weight_version != self.weight_version


#: A generate call's seed: one int for the batch (each backend derives its chunks' and requests' seeds from it), or one
#: seed per prompt (``seed[i]`` for ``prompts[i]``; an engine whose class sets ``PER_PROMPT_SEEDS = True`` takes it).
Seeds = int | list[int]


class GenerationInterface(WeightReceiver, Protocol):
    """A generation engine behind Ray actors: a refit's receiver (:mod:`nemo_like.models.refit.interface`) that samples.

    An engine class that sets ``PER_PROMPT_SEEDS = True`` takes a list of seeds in :meth:`generate`: prompt ``i`` is
    then sampled with its own random stream, seeded ``seed[i]``, so its sample does not depend on what else is in the
    batch (the rollout server batches seeded calls this way, ``nemo_like/serving/batching.py``); one prompt with
    ``[s]`` gets the sample it gets with ``s``."""

    weight_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: Seeds) -> list[GeneratedSample]:
        """One sample per prompt (repeat a prompt G times for a group); ``seed``: see :data:`Seeds`."""

    def refit(self, weights: WeightSource, version: int) -> float:
        """Load weight version ``version``; returns seconds spent. ``weights``: the exported weights, or a zero-argument
        exporter that a backend calls only when its transport reads an export (:func:`export_weights`)."""

    def wait_ready(self) -> None:
        """Wait until the engine's actors are built (a model load: minutes for vLLM on a GPU), so that no call's deadline
        (``cluster.fault_tolerance.call_timeout_s``) counts an actor's start-up."""

    def shutdown(self) -> None:
        """Release the actors."""


#: The most byte tokens an unfinished character can end a prefix with (a UTF-8 character has at most four bytes).
UNFINISHED_CHARACTER_TOKENS = 3


def stop_string_prefix(ids: Sequence[int], decode: Callable[[Sequence[int]], str], stop_strings: Sequence[str]) -> int | None:
    """Length of the shortest prefix of ``ids`` whose text (``decode``) holds one of ``stop_strings`` (whole tokens
    kept), or ``None``. A prefix's text only grows with the prefix, so a binary search finds it in ``log2(len(ids))``
    decodes (decoding every prefix cost 0.65 s for one 2,000-token response). A prefix that ends inside a character
    (byte tokens: its text ends in U+FFFD) is read up to that character: a byte-fallback decoder (Llama 2, Mistral)
    writes U+FFFD for every byte of such a run, the whole characters before it too, so its text did not only grow."""

    def found(text: str) -> bool:  # a trailing U+FFFD may be an unfinished character's: never part of a match
        return any(s in text.rstrip("\ufffd") for s in stop_strings)

    def holds(length: int) -> bool:
        text = decode(ids[:length])
        for back in range(1, min(UNFINISHED_CHARACTER_TOKENS, length) + 1):  # each text read counts (a byte-level token
            if found(text):  # may end one character and begin the next: 'a日\ufffd' holds 日)
                return True
            if not text.endswith("\ufffd"):
                return False
            text = decode(ids[: length - back])
        return found(text)

    if not stop_strings or not ids or not holds(len(ids)):
        return None
    low, high = 1, len(ids)  # holds(high); the answer is in [low, high]
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    return low


class StopStringWatch:
    """Tells, while a batch samples, whether a row's text now holds one of ``stop_strings``, so that the engine stops
    sampling that row there (it had sampled on to ``max_new_tokens``, all of it then cut away). It decodes only the row's
    last tokens, enough to spell the longest stop string from partial-character tokens; the exact cut stays
    :func:`stop_string_prefix`'s on the whole response, after generation, so a stop the window missed only costs the
    tokens sampled past it."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop_strings: Sequence[str]) -> None:
        if not stop_strings:
            raise ValueError("a StopStringWatch needs at least one stop string")
        self.decode, self.stop_strings = decode, tuple(stop_strings)
        self.window = 4 * max(len(s) for s in self.stop_strings) + 4  # a character can take up to 4 byte tokens
        self._last_chars = {s[-1] for s in self.stop_strings}
        # A SentencePiece token spells its word-start space only behind another token: a stop string ending in
        # whitespace can end with any of them
        self._any_token = any(c.isspace() for c in self._last_chars)
        self._can_end: dict[int, bool] = {}

    def can_end(self, token_id: int) -> bool:
        """Whether ``token_id`` can be the token that completes a stop string (decoded once per id): its own text holds
        a stop string's last character, or it holds part of a character (its bytes complete one behind others), or it
        spells nothing on its own. Only such rows are decoded (decoding every row cost ~6 ms a step at 512 rows)."""
        if self._any_token:
            return True
        known = self._can_end.get(token_id)
        if known is None:
            text = self.decode([token_id])
            known = self._can_end[token_id] = not text or "\ufffd" in text or any(c in text for c in self._last_chars)
        return known

    def holds(self, ids: Sequence[int]) -> bool:
        """Whether the text of ``ids``'s last tokens holds a stop string. A window that starts inside a character (its
        text starts with U+FFFD: a byte-fallback decoder then blanks the whole byte run, the stop string's characters
        too) starts up to 3 tokens earlier."""
        start = max(0, len(ids) - self.window)
        text = self.decode(ids[start:])
        for _ in range(UNFINISHED_CHARACTER_TOKENS):
            if start == 0 or not text.startswith("\ufffd"):
                break
            start -= 1
            text = self.decode(ids[start:])
        # confirmed on the whole row (once per hit): a window's clean byte run may be blanked in the whole text, where
        # the driver's cut would then find no stop
        return any(s in text for s in self.stop_strings) and stop_string_prefix(ids, self.decode, self.stop_strings) is not None


def actor_concurrency(cfg) -> int:
    """2 with in-flight weight updates (a refit call must reach the actor while it generates), else 1."""
    async_cfg = cfg.grpo.async_grpo
    return 2 if async_cfg.refits_mid_generation else 1


def generate_on_group(group, prompts: list[list[int]], params: SamplingParams, seed: Seeds, replaceable=None) -> list[GeneratedSample]:
    """Split ``prompts`` into contiguous shards, one per worker of ``group`` (a ``RayWorkerGroup`` whose
    actors have ``generate(prompts, params_dict, seed)``), and return the samples in prompt order. An int ``seed``
    gives rank r the seed ``worker_seed(seed, r)``; a list of per-prompt seeds is split with the prompts, so every
    prompt keeps its own. ``replaceable`` (a :class:`~nemo_like.distributed.supervision.Replaceable` of ``group``): a
    worker that dies is replaced and its shard sent again with the same seed (:mod:`nemo_like.distributed.supervision`);
    ``None``: a death is an error."""
    from dataclasses import asdict
    from functools import partial

    from nemo_like.distributed.supervision import Call, dispatch, gather
    from nemo_like.distributed.worker_group import get_with_context
    from nemo_like.utils.seeds import worker_seed
    from nemo_like.utils.sharding import contiguous_shards

    shards = contiguous_shards(prompts, len(group))  # rank r generates piece r (its seed depends on r)
    if isinstance(seed, (list, tuple)):
        seeds = [list(piece) for piece in contiguous_shards(prompt_seeds(seed, len(prompts)), len(group))]
    else:
        seeds = [worker_seed(seed, rank) for rank in range(len(shards))]
    fields = asdict(params)
    submits = [partial(_submit_generate, shard, fields, seeds[rank], rank == 0) for rank, shard in enumerate(shards)]
    if replaceable is None:
        out = get_with_context([submit(w) for submit, w in zip(submits, group.workers)], "generation")
    else:
        calls = [Call(replaceable, rank, submit) for rank, submit in enumerate(submits)]
        out = gather(calls, dispatch(calls), "generation")
    return [GeneratedSample(**s) for shard in out for s in shard]


def prompt_seeds(seed: Seeds, num_prompts: int) -> list[int]:
    """The seed of every prompt of a batch of ``num_prompts`` sampled with ``seed``: an int gives prompt ``i``
    ``chunk_seed(seed, i)`` (how vLLM seeds its requests); a list is checked to hold one seed per prompt."""
    from nemo_like.utils.seeds import chunk_seed

    if not isinstance(seed, (list, tuple)):
        return [chunk_seed(seed, i) for i in range(num_prompts)]
    if len(seed) != num_prompts:
        raise ValueError(f"{len(seed)} seeds for {num_prompts} prompts: a list of seeds needs one per prompt")
    return [int(s) for s in seed]


def chunk_seeds(seed: Seeds, start: int, stop: int) -> Seeds:
    """The seed of prompts ``start:stop`` of a batch sampled with ``seed``, for a backend that samples a batch in
    chunks: an int gives the chunk ``chunk_seed(seed, start)``; a list of per-prompt seeds, the chunk's own entries."""
    from nemo_like.utils.seeds import chunk_seed

    return list(seed[start:stop]) if isinstance(seed, (list, tuple)) else chunk_seed(seed, start)


def _submit_generate(shard: list[list[int]], params: dict, seed: Seeds, first: bool, worker: Any) -> Any:
    """One worker's generate call (sent again unchanged to a replacement); the fault-injection hook before the first
    shard's (tests only: ``cluster.fault_injection``; a no-op when unset)."""
    if first:
        from nemo_like.distributed.faults import inject

        inject("generation", "generate", [worker])
    return worker.generate.remote(shard, params, seed)


def load_served_weights(worker: Any, weights: WeightSource | None, exported: Any | None, version: int) -> None:
    """Bring a replacement engine (a fresh actor) to the weights its group serves, version ``version``, before it
    serves. ``exported``: what the last refit sent, kept by the facade until the next refit (object-store buckets stay
    in the store; ``None``: never refitted, the fresh actor's own model is version 0); ``weights``: what that refit was
    handed. A shared-memory export is mapped from the policy's buffer, which holds the last refit's weights until the
    next refit (its header's version is checked by the engine); if its file is gone (the policy replaced the buffer),
    the weights are exported again through the object store. The version the engine reports must be ``version``: a
    replacement never serves stale (or newer) weights. Both refusals, a newer version and a buffer the policy rewrote
    while the engine copied it (:class:`~nemo_like.models.refit.shared_memory.StaleRefitBuffer`: the engine then holds
    a mix of two versions, and the policy has moved past ``version``, so no export gives it back), are a
    :class:`WorkerFailure` naming why (the latter had been the buffer's own error, out of the supervision's terms)."""
    import os

    from nemo_like.distributed.worker_group import WorkerFailure, get_with_context
    from nemo_like.models.refit.shared_memory import StaleRefitBuffer

    if exported is None:
        loaded = get_with_context(worker.__ray_call__.remote(_weight_version), "generation: replacement start")
    else:
        path = getattr(exported, "path", None)
        payload = export_to_object_store(weights) if path and not os.path.exists(path) else exported
        try:
            loaded = get_with_context(worker.update_weights.remote(payload), "generation: replacement refit")
        except StaleRefitBuffer as exc:  # a Ray task error is an instance of its cause
            raise WorkerFailure(
                f"a replaced generation engine could not load the served weight version {version}: the policy wrote its "
                f"next refit into the shared buffer while the engine copied it ({str(exc).splitlines()[0]})"
            ) from exc
    if loaded != version:
        raise WorkerFailure(
            f"a replaced generation engine would serve weight version {loaded}, but its group serves version {version}: "
            "refusing a stale engine (the policy's weights moved on before the lost batch was sent again)"
        )


class ServedWeights:
    """What an engine group serves: the last refit's source (``weights``), what it sent (``exported``, kept until the
    next refit, so a replacement can load it) and its ``version``."""

    def __init__(self) -> None:
        self.weights: WeightSource | None = None
        self.exported: Any = None
        self.version = 0

    def refit(self, replaceable: Any, weights: WeightSource, version: int) -> None:
        """Export ``weights`` (version ``version``) and load them into every worker of ``replaceable``'s group."""
        exported = export_weights(weights)
        self.weights, self.exported, self.version = weights, exported, version
        refit_group(replaceable, exported, version)

    def load_into(self, worker: Any) -> None:
        """Bring a replacement engine to the served weights (:func:`load_served_weights`)."""
        load_served_weights(worker, self.weights, self.exported, self.version)


def export_to_object_store(weights: WeightSource) -> Any:
    """:func:`export_weights`, asking the policy's exporter for the object-store path instead of its shared-memory
    buffer (for an engine that cannot map that buffer: its file is gone)."""
    if callable(weights):
        import inspect

        if "shared_memory" in inspect.signature(weights).parameters:
            return weights(shared_memory=False)
    return export_weights(weights)


def _weight_version(actor: Any) -> int:
    return actor.weight_version


def refit_group(replaceable: Any, exported: Any, version: int) -> None:
    """Send ``exported`` weights (version ``version``) to every worker of ``replaceable``'s group (a dead one is
    replaced and loads them too); every worker must report ``version``."""
    from functools import partial

    from nemo_like.distributed.supervision import Call, gather

    group = replaceable.group
    calls = [Call(replaceable, rank, partial(_submit_refit, exported)) for rank in range(len(group))]
    versions = gather(calls, group.run_all("update_weights", exported), "refit")  # one object-store copy for all
    if set(versions) != {version}:
        raise RuntimeError(f"refit delivered weight versions {versions}, expected {version}")


def _submit_refit(exported: Any, worker: Any) -> Any:
    return worker.update_weights.remote(exported)
