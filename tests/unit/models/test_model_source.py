"""The model-source check before a run starts: real directories and a real (hand-built) hub cache."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from nemo_like.config.errors import ConfigError
from nemo_like.models.assets import default_model_path
from nemo_like.models.loading import check_model_source


def fill_cache(hf_home: Path, repo_id: str) -> None:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/config.json}."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_directories_and_the_embedded_model_pass(tmp_path):
    check_model_source("embedded:tiny-arith-qwen2", "policy.model_name")
    check_model_source(default_model_path(), "policy.model_name")
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ConfigError, match=r"policy.tokenizer_name=.*weights.bin is a file, not a model directory"):
        check_model_source(str(tmp_path / "weights.bin"), "policy.tokenizer_name")


def test_a_cached_hub_id_loads_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fill_cache(tmp_path, "org/cached-model")
    check_model_source("org/cached-model", "policy.model_name")
    with pytest.raises(ConfigError, match="org/other-model.*not in the local cache"):
        check_model_source("org/other-model", "policy.model_name")


def test_a_cached_hub_id_on_an_unreachable_hub_switches_the_run_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # restored after the test, as the env
    fill_cache(tmp_path, "org/cached-model")
    check_model_source("org/cached-model", "policy.model_name")
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # forwarded to the actors: no network retries there
    # ... and here: huggingface_hub reads the variable once at import (this process retried the hub for minutes)
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True


def test_end_of_sequence_ids_add_the_generation_configs_to_the_tokenizers(tmp_path, monkeypatch) -> None:
    """Instruct models list more end ids in generation_config.json than the tokenizer's eos (Llama-3-Instruct
    ``<|eot_id|>``, Qwen2.5-Instruct ``<|endoftext|>``); transformers and vLLM stop on them, and the HF engine, the
    turn loop and the rollout server ran on to max_new_tokens. The tokenizer's id stays first; no id twice."""
    import json
    import shutil

    from nemo_like.config import load_config
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.loading import end_of_sequence_ids, load_tokenizer, resolve_model_path
    from nemo_like.serving.standalone import build_server

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    assert end_of_sequence_ids(tokenizer, EMBEDDED_MODEL) == [tokenizer.eos_token_id] == [2]  # the shipped model: 2 in both
    model = tmp_path / "instruct"
    shutil.copytree(resolve_model_path(EMBEDDED_MODEL), model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [23, 2]}))
    assert end_of_sequence_ids(tokenizer, str(model)) == [2, 23]
    adapter = tmp_path / "step_3" / "policy"  # a LoRA checkpoint: its base model's generation config
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(model)}))
    assert end_of_sequence_ids(tokenizer, str(adapter)) == [2, 23]
    (model / "generation_config.json").unlink()
    assert end_of_sequence_ids(tokenizer, str(model)) == [2]  # none shipped: the tokenizer's
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    server = build_server(load_config(None, [f"policy.model_name={model}", f"policy.tokenizer_name={EMBEDDED_MODEL}"]))
    assert server.queue.engine.eos_token_ids == [2, 7] and server.service.eos_token_ids == {2, 7}  # `nemo-like serve` stops on it
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"generation_config.json: cannot read the model's generation config"):
        end_of_sequence_ids(tokenizer, str(model))


def test_a_sequence_longer_than_the_models_positions_is_a_config_error_naming_the_key(tmp_path) -> None:
    """The shipped model has 256 positions; ``policy.max_total_sequence_length=1024`` was accepted and our engines
    extrapolated RoPE past them without a word (vLLM refuses such a max_model_len). RoPE scaling extends the limit."""
    import json
    import shutil

    from nemo_like.config import load_config
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.loading import check_context_length, model_context_length, resolve_model_path
    from nemo_like.serving.standalone import build_server

    assert model_context_length(EMBEDDED_MODEL) == 256
    check_context_length(EMBEDDED_MODEL, 256)
    with pytest.raises(
        ConfigError, match=r"policy.max_total_sequence_length=1024 is longer than embedded:tiny-arith-qwen2's context \(256"
    ):
        check_context_length(EMBEDDED_MODEL, 1024)
    with pytest.raises(ConfigError, match=r"policy.max_total_sequence_length=300"):  # `nemo-like serve` checks it too
        build_server(load_config(None, ["policy.max_total_sequence_length=300"]))
    from nemo_like.algorithms.setup import setup_grpo

    with pytest.raises(ConfigError, match=r"policy.max_total_sequence_length=300"):  # a run: before Ray or any actor
        setup_grpo(load_config(None, ["policy.max_total_sequence_length=300", f"logger.log_dir={tmp_path / 'logs'}"]))
    scaled = tmp_path / "yarn"
    shutil.copytree(resolve_model_path(EMBEDDED_MODEL), scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    (scaled / "config.json").write_text(json.dumps(config))
    assert model_context_length(str(scaled)) == 1024
    adapter = tmp_path / "policy"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(scaled)}))
    assert model_context_length(str(adapter)) == 1024


def test_chunked_logprobs_are_refused_for_a_model_that_post_processes_its_head_logits(tmp_path) -> None:
    """Gemma 2 soft-caps its logits in its forward (Granite divides them, Cohere scales them): the chunked path, which
    replaces the head, scored the uncapped distribution and then had the cap applied to its logprobs (1.8 nats off the
    sampler's on a tiny Gemma 2); now such a model with policy.logprob_chunk_size set is refused before any actor."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from nemo_like.algorithms.setup import setup_grpo
    from nemo_like.config import load_config
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.chunked_logprobs import chunked_token_logprobs
    from nemo_like.models.loading import check_chunkable_head, head_postprocessing, load_tokenizer
    from nemo_like.models.processed_logprobs import SamplingDistribution

    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=len(tokenizer), final_logit_softcapping=2.0, **shape)).eval()
    gemma.save_pretrained(tmp_path / "gemma")
    tokenizer.save_pretrained(tmp_path / "gemma")
    ids = torch.tensor([[5, 9, 30, 7, 12]])
    with torch.no_grad():  # why: the head's own product is not the distribution the model's forward returns
        gemma.lm_head.weight.mul_(30.0)  # logits of several nats, where the cap bites (random init gives ~0.1)
        full = torch.log_softmax(gemma(input_ids=ids).logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        hidden = gemma.model(input_ids=ids).last_hidden_state
        chunked, _ = chunked_token_logprobs(hidden, gemma.lm_head.weight, None, ids, SamplingDistribution(), 2)
    assert (chunked[:, 1:].double() - full).abs().max() > 0.1
    assert head_postprocessing(str(tmp_path / "gemma")) == ["final_logit_softcapping=2.0"]
    assert head_postprocessing(EMBEDDED_MODEL) == []
    check_chunkable_head(str(tmp_path / "gemma"), None)  # the full path applies the cap: nothing to refuse
    check_chunkable_head(EMBEDDED_MODEL, 64)
    message = r"policy.logprob_chunk_size=64 cannot serve policy.model_name=.*final_logit_softcapping=2.0.*logprob_chunk_size=null"
    with pytest.raises(ConfigError, match=message):  # a run: before Ray or any actor
        setup_grpo(
            load_config(
                None, [f"policy.model_name={tmp_path / 'gemma'}", "policy.logprob_chunk_size=64", f"logger.log_dir={tmp_path / 'logs'}"]
            )
        )
    with pytest.raises(ConfigError, match=r"cannot serve teacher.model_name="):
        overrides = [f"teacher.model_name={tmp_path / 'gemma'}", "policy.logprob_chunk_size=64", f"logger.log_dir={tmp_path / 'logs'}"]
        setup_grpo(load_config(None, overrides))


def test_a_head_scaled_under_a_field_we_do_not_list_fails_the_chunked_forward_instead_of_scoring_another_distribution(
    tmp_path,
) -> None:
    """Falcon-H1 multiplies its head's logits by ``lm_head_multiplier``, a field the refusal did not list: the chunked
    logprobs came back multiplied by it (3.1 nats off the model's own). The field is listed now, and the chunked forward
    itself checks that the model returned what the head produced, for the next model that scales under another name."""
    import torch
    from transformers import FalconH1Config, FalconH1ForCausalLM

    from nemo_like.models.chunked_logprobs import check_head_output_unchanged, model_token_logprobs_with_outside, teacher_head_inputs
    from nemo_like.models.loading import head_postprocessing

    torch.manual_seed(0)
    config = FalconH1Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=1, mamba_chunk_size=8, lm_head_multiplier=0.25, max_position_embeddings=64,
    )  # fmt: skip
    falcon = FalconH1ForCausalLM(config).eval()
    falcon.save_pretrained(tmp_path / "falcon")
    assert head_postprocessing(str(tmp_path / "falcon")) == ["lm_head_multiplier=0.25"]
    ids = torch.randint(0, 64, (2, 12))
    inputs = (ids, torch.ones_like(ids), torch.arange(12).expand(2, 12))
    with torch.no_grad():
        lp, _ = model_token_logprobs_with_outside(falcon, *inputs, chunk_size=None)
        falcon.model.lm_head_multiplier = 1.0  # the chunked path agrees with a head that is left as it is (x 1.0: a copy)
        chunked, _ = model_token_logprobs_with_outside(falcon, *inputs, chunk_size=5)
        falcon.model.lm_head_multiplier = 0.25
        unscaled = torch.log_softmax(falcon.lm_head(falcon.model(input_ids=ids).last_hidden_state)[:, :-1], -1)
        assert (lp[:, 1:] - unscaled.gather(-1, ids[:, 1:, None])[..., 0]).abs().max() > 0.1  # the multiplier matters
        with pytest.raises(RuntimeError, match="FalconH1ForCausalLM's forward changes its output head's logits"):
            model_token_logprobs_with_outside(falcon, *inputs, chunk_size=5)
        with pytest.raises(RuntimeError, match="FalconH1ForCausalLM's forward changes"):
            teacher_head_inputs(falcon, *inputs, chunk_size=5, copy_head=False)
    torch.testing.assert_close(chunked[:, 1:], unscaled.gather(-1, ids[:, 1:, None])[..., 0], atol=1e-5, rtol=0)
    # A cast of the same values passes, a NaN of the model's own too (the run's non-finite guard handles it)
    produced = torch.tensor([[0.5, float("nan")]], dtype=torch.bfloat16)
    check_head_output_unchanged(falcon, produced, produced.float())
    with pytest.raises(RuntimeError, match="forward changes its output head's logits"):
        check_head_output_unchanged(falcon, produced, produced.float() * 0.25)


def test_stop_settings_no_engine_can_honour_are_config_errors_naming_the_key(tmp_path) -> None:
    """An empty stop string cut every response to its first token; a stop id outside the vocabulary never fired on the
    inline and HF samplers (vLLM refused it at the first step). Each is refused before any actor starts."""
    from nemo_like.algorithms.setup import setup_grpo
    from nemo_like.config import load_config
    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.loading import check_stop_token_ids, load_tokenizer
    from nemo_like.serving.standalone import build_server

    with pytest.raises(ConfigError, match=r"policy.generation.stop_strings: every stop string must be non-empty, got \['\.', ''\]"):
        load_config(None, ["policy.generation.stop_strings=['.', '']"])
    with pytest.raises(ConfigError, match=r"policy.generation.stop_token_ids: token ids are >= 0, got \[-5\]"):
        load_config(None, ["policy.generation.stop_token_ids=[3, -5]"])
    check_stop_token_ids(EMBEDDED_MODEL, [0, 358])  # the shipped model's first and last ids
    outside = r"policy.generation.stop_token_ids: \[359\] are outside embedded:tiny-arith-qwen2's vocabulary \(ids 0..358"
    with pytest.raises(ConfigError, match=outside):
        check_stop_token_ids(EMBEDDED_MODEL, [2, 359])
    bad = ["policy.generation.stop_token_ids=[359]"]
    with pytest.raises(ConfigError, match=outside):  # `nemo-like serve`
        build_server(load_config(None, bad))
    # serve answered from a reward model's random output head (HTTP 200), and every request to a model its sampler
    # cannot sample failed (HTTP 500), advising a backend serve does not have
    with pytest.raises(ConfigError, match=r"eval.model_path=embedded:tiny-reward-qwen2 is not a causal language model"):
        build_server(load_config(None, ["eval.model_path=embedded:tiny-reward-qwen2"]))
    from transformers import MiniMaxConfig

    MiniMaxConfig(vocab_size=359, hidden_size=32, num_hidden_layers=2, num_attention_heads=2).save_pretrained(tmp_path / "minimax")
    with pytest.raises(
        ConfigError, match=r"eval.model_path='.*minimax': nemo-like serve samples with the HF sampler, which cannot sample Mini"
    ):
        build_server(load_config(None, [f"eval.model_path={tmp_path / 'minimax'}"]))
    # the served model's own tokenizer, as eval's (the recipe's 359 ids failed every request to a 315-row model with an
    # IndexError), and a named other one refused
    tool = load_config(None, ["eval.model_path=embedded:tiny-tool-qwen2"])
    assert build_server(tool).service.renderer.tokenizer.get_vocab() == load_tokenizer("embedded:tiny-tool-qwen2").get_vocab()
    with pytest.raises(ConfigError, match=r"policy.tokenizer_name='embedded:tiny-arith-teacher' has another tokenizer than the one"):
        build_server(load_config(None, ["eval.model_path=embedded:tiny-tool-qwen2", "policy.tokenizer_name=embedded:tiny-arith-teacher"]))
    with pytest.raises(ConfigError, match=outside):  # a run: before Ray or any actor
        setup_grpo(load_config(None, [*bad, f"logger.log_dir={tmp_path / 'logs'}"]))


def test_actors_get_a_relative_model_path_made_absolute_and_the_run_config_keeps_it(tmp_path, monkeypatch) -> None:
    """An actor of a joined cluster starts where its node started, not in the driver's directory: './my_model', which
    the driver checked, was looked up there (measured: ray start in one directory, the driver in another)."""
    import shutil

    from nemo_like.config import load_config
    from nemo_like.environments.learned_inputs import check_model_name
    from nemo_like.models.loading import actor_model_source
    from nemo_like.models.policy.spec import PolicyWorkerSpec

    shutil.copytree(default_model_path(), tmp_path / "my_model")
    monkeypatch.chdir(tmp_path)
    assert actor_model_source("./my_model") == actor_model_source("my_model") == str(tmp_path / "my_model")
    for unchanged in ("embedded:tiny-arith-qwen2", "Qwen/Qwen2.5-0.5B", str(tmp_path / "my_model"), "./missing"):
        assert actor_model_source(unchanged) == unchanged
    cfg = load_config(None, ["policy.model_name=./my_model"], warn=False)
    spec = PolicyWorkerSpec.from_config(cfg, trainable=False, loss_fn=None, num_threads=1)
    assert cfg.policy.model_name == "./my_model" and spec.model_name == str(tmp_path / "my_model")
    assert check_model_name("./my_model") == str(tmp_path / "my_model")  # a reward model's or judge's actors


def test_a_hub_models_generation_config_is_fetched_when_not_cached(tmp_path, monkeypatch) -> None:
    """The driver reads a hub model's end ids before anything downloads the model: from the cache only, a first run
    stopped on the tokenizer's eos alone and later runs on the generation config's ids too. A local HTTP server stands
    in for the hub (huggingface_hub's own requests: HEAD then GET of .../resolve/main/generation_config.json)."""
    import http.server
    import json
    import threading

    from nemo_like.models.loading import _generation_config

    body = json.dumps({"eos_token_id": [2, 23]}).encode()
    requests: list[str] = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def answer(self, head: bool) -> None:
            requests.append(f"{self.command} {self.path}")
            if "org/none" in self.path:  # a model that ships no generation config
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            for name, value in (("X-Repo-Commit", "a" * 40), ("ETag", '"abc"'), ("Content-Length", str(len(body)))):
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's names
            self.answer(True)

        def do_GET(self) -> None:  # noqa: N802
            self.answer(False)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path))
        monkeypatch.delenv("HF_HUB_CACHE", raising=False)
        import huggingface_hub.constants

        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # as the env says (read once at import)
        assert _generation_config("org/model") == {"eos_token_id": [2, 23]}
        assert _generation_config("org/none") == {}
        fetched = [r for r in requests if "generation_config.json" in r and r.startswith("GET")]
        assert _generation_config("org/model") == {"eos_token_id": [2, 23]}  # now from the cache: no new request
        assert [r for r in requests if "generation_config.json" in r and r.startswith("GET")] == fetched
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert _generation_config("org/other") == {}  # offline: the cache only, as before
    finally:
        server.shutdown()


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_rope_whose_frequencies_follow_the_sequence_is_refused_past_its_pretrained_context(tmp_path, kind) -> None:
    """Dynamic NTK scaling and LongRoPE recompute their frequencies from each forward's longest position once it passes
    the pretrained context: the sampler (a KV cache, one forward per position) and the trainer (one forward over the
    batch's longest row) then score a token with different frequencies (0.4-2.3 nats apart). Within the context a
    token's logprob does not depend on the forward's length; past it, it does; a run past it is refused."""
    import json
    import shutil

    import torch

    from nemo_like.config.schema import EMBEDDED_MODEL
    from nemo_like.models.loading import check_context_length, check_trained_length, load_causal_lm, resolve_model_path

    pretrained = 32
    model_dir = tmp_path / kind
    shutil.copytree(resolve_model_path(EMBEDDED_MODEL), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    half_head = config["hidden_size"] // config["num_attention_heads"] // 2
    if kind == "dynamic":
        config["max_position_embeddings"] = pretrained
        config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    else:
        config["max_position_embeddings"] = 4 * pretrained
        config["rope_parameters"] = {
            "rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": pretrained,
            "short_factor": [1.0] * half_head, "long_factor": [4.0] * half_head,
        }  # fmt: skip
    (model_dir / "config.json").write_text(json.dumps(config))

    model = load_causal_lm(str(model_dir)).eval()
    ids = torch.randint(0, config["vocab_size"], (1, 3 * pretrained), generator=torch.Generator().manual_seed(0))

    def logprobs(length: int) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=ids[:, :length]).logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:length, None])[:, 0]

    within, at_limit, past = logprobs(pretrained // 2), logprobs(pretrained), logprobs(3 * pretrained)
    torch.testing.assert_close(within, at_limit[: pretrained // 2 - 1], atol=1e-5, rtol=0)
    assert (past[: pretrained - 1] - at_limit).abs().max() > 1e-2  # the same tokens, scored again in a longer forward

    check_trained_length(str(model_dir), pretrained)
    with pytest.raises(
        ConfigError,
        match=rf"policy.max_total_sequence_length={pretrained + 1} passes .* pretrained context \({pretrained} positions\) "
        rf"and its RoPE is '{kind}'.*Lower policy.max_total_sequence_length .* to at most {pretrained}",
    ):
        check_trained_length(str(model_dir), pretrained + 1)
    check_context_length(str(model_dir), 3 * pretrained)  # sampling alone (eval, a server) is what the model computes
    from nemo_like.algorithms.setup import setup_grpo
    from nemo_like.config import load_config

    run = [f"policy.model_name={model_dir}", f"policy.tokenizer_name={EMBEDDED_MODEL}", f"logger.log_dir={tmp_path / 'logs'}"]
    with pytest.raises(ConfigError, match=rf"policy.max_total_sequence_length={2 * pretrained} passes"):  # before Ray
        setup_grpo(load_config(None, [*run, f"policy.max_total_sequence_length={2 * pretrained}"]))
