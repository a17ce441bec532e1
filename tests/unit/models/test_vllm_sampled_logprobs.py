"""vLLM's flat logprobs give the same per-token values as its dict-per-position form."""

from __future__ import annotations

import pytest

from nemo_like.models.generation.vllm_worker import sampled_logprobs
from nemo_like.models.loading import load_tokenizer

logprobs_mod = pytest.importorskip("vllm.logprobs")


def test_flat_and_dict_logprobs_give_the_sampled_tokens_values():
    Logprob, FlatLogprobs = logprobs_mod.Logprob, logprobs_mod.FlatLogprobs
    tokens = [5, 9, 5, 2]
    # The sampled token is not always first: with top-logprobs a position also holds other tokens.
    positions = [
        {5: Logprob(-0.25, 1, None)},
        {3: Logprob(-0.5, 1, None), 9: Logprob(-1.5, 2, None)},
        {5: Logprob(-0.125, 1, None)},
        {7: Logprob(-0.0625, 1, None), 1: Logprob(-3.0, 3, None), 2: Logprob(-2.0, 2, None)},
    ]
    flat = FlatLogprobs()
    flat.extend(positions)
    expected = [-0.25, -1.5, -0.125, -2.0]
    assert sampled_logprobs(positions, tokens) == expected
    assert sampled_logprobs(flat, tokens) == expected


def test_a_request_stops_on_the_runs_end_ids_and_no_others():
    """vLLM adds the model's generation-config eos ids to every request (``update_from_generation_config``, called by
    its input processor): the run's end-of-sequence ids, the same for every backend, must be the only stop ids."""
    pytest.importorskip("vllm")
    from nemo_like.models.generation.interface import SamplingParams
    from nemo_like.models.generation.vllm_worker import vllm_sampling_params

    params = vllm_sampling_params(SamplingParams(max_new_tokens=8), [2, 20], seed=0)
    params.update_from_generation_config({"eos_token_id": [2, 31]}, eos_token_id=2)  # as vLLM 0.32 does per request
    assert sorted(params.stop_token_ids) == [2, 20] and params.eos_token_id is None


def test_a_request_with_stop_strings_stops_at_them_keeping_them_and_every_token_in_the_text():
    """Stop strings were not given to vLLM (it sampled on to max_tokens, then the driver cut): vLLM now stops there,
    keeps the stop string and spells every token as the driver's cut does; a stop string that starts with a space is
    left to the driver (vLLM matches behind the prompt, where a SentencePiece first token gains a space; the driver's
    cut decodes alone after a prompt that ends in half a character)."""
    pytest.importorskip("vllm")
    from nemo_like.models.generation.interface import SamplingParams
    from nemo_like.models.generation.vllm_worker import vllm_sampling_params

    stops = ("</answer>", "\n\nQuestion:", " Answer:")
    params = vllm_sampling_params(SamplingParams(max_new_tokens=8, stop_strings=stops), [2], seed=0)
    assert params.stop == ["</answer>", "\n\nQuestion:"] and params.detokenize and params.include_stop_str_in_output
    assert not params.skip_special_tokens and not params.spaces_between_special_tokens
    plain = vllm_sampling_params(SamplingParams(max_new_tokens=8), [2], seed=0)
    assert plain.stop == [] and not plain.detokenize  # no text work without stop strings


def test_the_engine_detokenizes_with_the_runs_tokenizer_not_the_model_directorys(tmp_path):
    """vLLM finds stop strings in its own detokenized text: with ``policy.tokenizer_name`` set (a model directory that holds
    no tokenizer, or another one than the run's), the engine must be built with the run's tokenizer."""
    pytest.importorskip("vllm")
    import shutil
    from pathlib import Path

    from vllm.engine.arg_utils import EngineArgs
    from vllm.tokenizers import cached_tokenizer_from_config

    from nemo_like.models.generation.vllm_worker import VLLMGenerationWorker
    from nemo_like.models.loading import resolve_model_path

    tokenizer_model = "embedded:tiny-arith-qwen2"
    for name in ("config.json", "model.safetensors", "generation_config.json"):  # the weights without a tokenizer
        shutil.copy(Path(resolve_model_path(tokenizer_model)) / name, tmp_path / name)

    class Worker(VLLMGenerationWorker):
        def _start_engine(self, *args):
            return None

    worker = Worker(0, 1, str(tmp_path), "float32", 64, 0, pad_token_id=0, eos_token_ids=[1], tokenizer_name=tokenizer_model)
    kwargs = worker.engine_kwargs(worker.model_path, "float32", 64, 0, True, 0.5)
    tokenizer = cached_tokenizer_from_config(EngineArgs(**kwargs).create_model_config())
    expected = load_tokenizer(tokenizer_model)
    text = "The answer is 42.</answer>"
    assert tokenizer.encode(text) == expected.encode(text)
