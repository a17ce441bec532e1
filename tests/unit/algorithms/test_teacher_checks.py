"""The start-up checks of the teachers against the student (``check_teachers``) with shipped recipes, tokenizers and
models: the keys their refusals name (through ``setup_grpo`` itself, which refuses before Ray or any actor starts), the
teacher model's own vocabulary, and the warning for a top-k KL support that covers the whole vocabulary."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from nemo_like.algorithms.setup import check_teachers, setup_grpo
from nemo_like.config import DEFAULT_RECIPE, load_config
from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.models.assets import embedded_model_path
from nemo_like.models.loading import load_causal_lm, load_tokenizer
from nemo_like.models.teacher_kl import KLTerm, token_kl

STUDENT = "embedded:tiny-arith-qwen2"  # the default recipe's policy: 359 token ids
TEACHER = "embedded:tiny-arith-teacher"  # the same tokenizer and vocabulary
OTHER = "embedded:tiny-tool-qwen2"  # another tokenizer, 315 vocabulary rows


def recipe(*overrides: str) -> MasterConfig:
    return load_config(DEFAULT_RECIPE, list(overrides), warn=False)


def refusal(*overrides: str) -> str:
    """The ConfigError ``setup_grpo`` stops with (before Ray starts) for the default recipe with ``overrides``."""
    with pytest.raises(ConfigError) as error:
        setup_grpo(recipe(*overrides))
    return str(error.value)


def model_without_tokenizer(source: str, directory: Path) -> str:
    """A copy of shipped model ``source``'s weights and configs without its tokenizer (as a checkpoint's ``policy/``
    written before 2026-12-04 is): its run names the tokenizer with ``teacher.tokenizer_name``."""
    directory.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(Path(embedded_model_path(source)) / name, directory / name)
    return str(directory)


def test_accepted_teachers_pass_the_checks() -> None:
    for overrides in (
        [f"teacher.model_name={TEACHER}"],
        [f"teacher.model_name={TEACHER}", f"teacher.tokenizer_name={STUDENT}"],  # the directory's own one agrees
        [f"+teacher.by_task.arithmetic={TEACHER}"],
    ):
        assert check_teachers(recipe(*overrides), load_tokenizer(STUDENT)) == []


def test_the_tokenizer_refusal_names_the_keys_that_name_both_tokenizers() -> None:
    student_named = f"the student's policy.tokenizer_name='{STUDENT}'"  # the recipe sets it (${policy.model_name})
    cases = {
        f"teacher.by_task.arithmetic='{OTHER}' has a tokenizer (315 tokens) different from {student_named}": [
            f"+teacher.by_task.arithmetic={OTHER}"
        ],
        f"teacher.tokenizer_name='{OTHER}' has a tokenizer (315 tokens) different from {student_named}": [
            f"teacher.model_name={TEACHER}",
            f"teacher.tokenizer_name={OTHER}",
        ],
        f"teacher.model_name='{TEACHER}' has a tokenizer (359 tokens) different from the student's policy.tokenizer_name='{OTHER}'": [
            f"teacher.model_name={TEACHER}",
            f"policy.tokenizer_name={OTHER}",
        ],
        f"teacher.model_name='{OTHER}' has a tokenizer (315 tokens) different from the student's policy.model_name='{STUDENT}'": [
            f"teacher.model_name={OTHER}",
            "policy.tokenizer_name=null",
        ],
    }
    for expected, overrides in cases.items():
        message = refusal(*overrides)
        assert message.startswith(expected), (overrides, message)
        assert "cross-tokenizer distillation is not supported" in message


def test_teacher_tokenizer_name_does_not_hide_the_teacher_models_own_tokenizer() -> None:
    # The named tokenizer is the student's, the model (and the tokenizer its directory holds) another one's.
    message = refusal(f"teacher.model_name={OTHER}", f"teacher.tokenizer_name={STUDENT}")
    assert message.startswith(f"teacher.model_name='{OTHER}' has a tokenizer (315 tokens) different from the student's")


def test_a_teacher_model_whose_vocabulary_misses_the_students_ids_is_refused(tmp_path: Path) -> None:
    # No tokenizer in its directory: teacher.tokenizer_name (the student's) is the only tokenizer to compare, and it
    # agrees; the model's own 315 rows cannot score ids 315..358 (its forward fails on them mid-step).
    teacher = model_without_tokenizer(OTHER, tmp_path / "tool-model")
    with pytest.raises(IndexError):  # what the check stands for: the teacher's pass on the student's ids
        load_causal_lm(teacher)(input_ids=torch.tensor([[1, 2, 340]]))
    message = refusal(f"teacher.model_name={teacher}", f"teacher.tokenizer_name={STUDENT}")
    assert message.startswith(
        f"teacher.model_name='{teacher}' has 315 vocabulary rows (vocab_size in its config.json, ids 0..314) but the "
        f"student's tokenizer (policy.tokenizer_name='{STUDENT}') has token ids 0..358"
    ), message


def test_a_by_task_teachers_chunked_head_refusal_names_its_task(tmp_path: Path) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tokenizer = load_tokenizer(STUDENT)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=len(tokenizer), final_logit_softcapping=2.0, **shape))
    gemma.save_pretrained(tmp_path / "gemma")
    tokenizer.save_pretrained(tmp_path / "gemma")  # the student's tokenizer: only its head is refused
    message = refusal(f"+teacher.by_task.arithmetic={tmp_path / 'gemma'}", "policy.logprob_chunk_size=16")
    assert f"cannot serve teacher.by_task.arithmetic={str(tmp_path / 'gemma')!r}" in message, message


def test_a_top_k_kl_support_covering_the_vocabulary_warns_at_set_up() -> None:
    kl = [f"teacher.model_name={TEACHER}", "distillation.kl_weight=1", "distillation.kl_support=teacher_top_k"]
    # 359 rows: k = 358 leaves one token in the tail bucket, which merges nothing (the full KL, value and gradient).
    student, teacher = torch.randn(3, 359, dtype=torch.float64), torch.randn(3, 359, dtype=torch.float64)
    top, full = (
        token_kl(student, teacher, KLTerm("forward", "teacher_top_k", 358), True),
        token_kl(student, teacher, KLTerm("forward", "full"), True),
    )
    torch.testing.assert_close(top, full)
    for k in (358, 359, 100000):
        (line,) = check_teachers(recipe(*kl, f"distillation.kl_top_k={k}"), load_tokenizer(STUDENT))
        assert line.startswith(
            f"distillation.kl_top_k={k} has no effect with distillation.kl_support=teacher_top_k: the KL term compares 359 vocabulary rows"
        )
    assert check_teachers(recipe(*kl, "distillation.kl_top_k=357"), load_tokenizer(STUDENT)) == []  # a real top-k


def test_a_teacher_config_this_machine_cannot_read_and_a_smaller_teacher_head_warn(tmp_path: Path) -> None:
    """A hub-id teacher not cached on an offline driver (its workers have it) failed set-up with a raw OSError from the
    new vocabulary check; a student head with padding rows past the teacher's passed silently (a padding id sampled
    there fails the teacher's pass)."""
    for chunked in ([], ["policy.logprob_chunk_size=64"]):  # the head's check reads the same config.json
        cfg = recipe("teacher.model_name=some-org/not-cached", f"teacher.tokenizer_name={STUDENT}", *chunked)
        (line,) = check_teachers(cfg, load_tokenizer(STUDENT))
        assert line.startswith("teacher.model_name='some-org/not-cached': its vocabulary and head are not checked here")
    padded = tmp_path / "padded-student"
    student = load_causal_lm(STUDENT)
    student.resize_token_embeddings(384)  # rows 359..383: padding, no token
    student.save_pretrained(padded)
    load_tokenizer(STUDENT).save_pretrained(padded)
    (line,) = check_teachers(recipe(f"policy.model_name={padded}", f"teacher.model_name={TEACHER}"), load_tokenizer(STUDENT))
    assert line.startswith(f"teacher.model_name='{TEACHER}' has 359 vocabulary rows, policy.model_name='{padded}' 384: ")


def test_a_teacher_directory_without_a_tokenizer_a_checkpoint_step_or_a_reward_model_is_refused_naming_its_key(tmp_path: Path) -> None:
    """A teacher directory without a tokenizer was told to set policy.tokenizer_name (which changed nothing); a checkpoint
    step (its model one level down) passed with a warning and failed in the teacher's actor after a minute; a reward
    model loaded as a causal LM (its output head its tied embeddings), with no error at all."""
    from nemo_like.train import check_run_inputs

    bare = model_without_tokenizer(TEACHER, tmp_path / "bare")
    assert "holds no tokenizer" in (message := refusal(f"teacher.model_name={bare}")) and "set teacher.tokenizer_name" not in message
    assert "name the tokenizer's model with teacher.tokenizer_name" in message and "offline" not in message
    by_task = refusal(f"+teacher.by_task.arithmetic={bare}")
    assert "a teacher.by_task model's directory must hold its tokenizer" in by_task, by_task
    step = tmp_path / "ckpt" / "step_3"
    shutil.copytree(embedded_model_path(TEACHER), step / "policy")
    for key in ("teacher.model_name", "+teacher.by_task.arithmetic"):  # the fix, quoted to paste into a shell as Hydra reads it
        policy = step / "policy"
        fix = f"is a checkpoint step: its model is {policy}: set \"{key.lstrip('+')}='{policy}'\""
        with pytest.raises(ConfigError, match=re.escape(fix)):
            check_run_inputs(recipe(f"{key}={step}", f"logger.log_dir={tmp_path / 'logs'}"))
    # the run's checkpoint directory (eval, serve and merge take its latest valid step): it was blamed for holding no
    # tokenizer, or no config.json
    (step / "trainer_state.json").write_text("{}")
    shutil.copytree(step, tmp_path / "ckpt" / "step_1")
    latest = "a checkpointing.checkpoint_dir (latest valid step: step_3): its model is"
    fix = f"{latest} {step / 'policy'}: set \"teacher.model_name='{step / 'policy'}'\""
    with pytest.raises(ConfigError, match=re.escape(fix)):
        check_run_inputs(recipe(f"teacher.model_name={tmp_path / 'ckpt'}", f"logger.log_dir={tmp_path / 'logs'}"))
    with pytest.raises(ConfigError, match=re.escape(f"policy.model_name={tmp_path / 'ckpt'} is {latest} {step / 'policy'} (or resume")):
        check_run_inputs(recipe(f"policy.model_name={tmp_path / 'ckpt'}", f"logger.log_dir={tmp_path / 'logs'}"))
    # a directory that holds a tokenizer but no model (the vocabulary check read no config.json): refused, not a warning
    load_tokenizer(STUDENT).save_pretrained(tmp_path / "tokenizer-only")
    assert refusal(f"teacher.model_name={tmp_path / 'tokenizer-only'}").startswith(
        f"teacher.model_name='{tmp_path / 'tokenizer-only'}' is not a model directory here"
    )
    reward = "embedded:tiny-reward-qwen2"  # Qwen2ForSequenceClassification, the student's tokenizer
    assert refusal(f"teacher.model_name={reward}").startswith(
        f"teacher.model_name={reward} is not a causal language model (Qwen2ForSequenceClassification in its config.json)"
    )
    assert refusal(f"policy.model_name={reward}").startswith(f"policy.model_name={reward} is not a causal language model")


def test_a_tensor_parallel_degree_that_does_not_divide_the_heads_is_refused_before_ray_starts(tmp_path: Path) -> None:
    """The policy's workers (and the teachers', which take its degree) refused it only after every actor had started."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tp4 = refusal("policy.dtensor_cfg.tensor_parallel_size=4", "loss_fn.reference_policy_kl_penalty=0")
    assert tp4 == (
        "policy.dtensor_cfg.tensor_parallel_size=4 must divide num_attention_heads=4 and num_key_value_heads=2 (the heads "
        "are split across the tensor-parallel ranks)"
    )
    tokenizer = load_tokenizer(STUDENT)
    shape = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), **shape)).save_pretrained(tmp_path / "three-heads")
    tokenizer.save_pretrained(tmp_path / "three-heads")
    from transformers import GPT2Config

    from nemo_like.algorithms.setup import check_shardable, check_tensor_parallel_heads

    GPT2Config(n_head=3).save_pretrained(tmp_path / "gpt2")  # n_head, which transformers reads as num_attention_heads
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 must divide num_attention_heads=3 and num_key_value_heads=3"):
        check_tensor_parallel_heads(recipe("policy.dtensor_cfg.tensor_parallel_size=2"), str(tmp_path / "gpt2"))
    message = refusal(f"teacher.model_name={tmp_path / 'three-heads'}", "policy.dtensor_cfg.tensor_parallel_size=2")
    assert message.startswith(
        f"teacher.model_name={str(tmp_path / 'three-heads')!r}: policy.dtensor_cfg.tensor_parallel_size=2 must divide num_attention_heads=3"
    )
    # a state-space model has no heads to split: the workers' plan failed on them after every actor started; its layers
    # (backbone.layers, not model.model.layers) shard over policy.dp_size
    from transformers import AutoModelForCausalLM, Mamba2Config

    from nemo_like.models.policy.sharding import decoder_layers

    mamba = Mamba2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1)
    mamba.save_pretrained(tmp_path / "mamba2")
    no_heads = r"teacher.model_name=.*mamba2' with .*tensor_parallel_size=2: the workers cannot shard it: layer 0 has no self_attn"
    with pytest.raises(ConfigError, match=no_heads):
        check_shardable(recipe("policy.dtensor_cfg.tensor_parallel_size=2"), str(tmp_path / "mamba2"), "teacher.model_name")
    assert len(decoder_layers(AutoModelForCausalLM.from_config(mamba))) == 2
    # Layouts the workers cannot shard, refused before any actor starts: a per-head query/key norm stays whole on every
    # tp rank while each trains its copy on its own heads (Qwen3's drifted apart, its logprobs 0.1 off a plain rank's in
    # 5 steps, silently); Phi-3's fused qkv_proj beside a row-wise o_proj crashed in the workers; RWKV's blocks are not
    # where FSDP2 looks for them. Falcon's (transformer.h) now shard over dp.
    from transformers import FalconConfig, Phi3Config, Qwen3Config, RwkvConfig

    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    for name, config in (("qwen3", Qwen3Config(**shape)), ("phi3", Phi3Config(**shape)), ("falcon", FalconConfig(hidden_size=32, num_attention_heads=4)),
                         ("rwkv", RwkvConfig(hidden_size=32, num_hidden_layers=2))):  # fmt: skip
        config.save_pretrained(tmp_path / name)
    tp2 = recipe("policy.dtensor_cfg.tensor_parallel_size=2")
    with pytest.raises(
        ConfigError,
        match=r"teacher.model_name=.*qwen3' with policy.dp_size=1 and policy.dtensor_cfg.tensor_parallel_size=2: the workers cannot shard it: layer 0's self_attn holds parameters the plan does not split \(q_norm.weight, k_norm.weight\); lower policy.dtensor_cfg.tensor_parallel_size to 1",
    ):
        check_shardable(tp2, str(tmp_path / "qwen3"), "teacher.model_name")
    with pytest.raises(ConfigError, match=r"layer 0 has no self_attn.q_proj"):
        check_shardable(tp2, str(tmp_path / "phi3"), "policy.model_name")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from nemo_like.models.loading import read_model_config

    gemma4 = CONFIG_MAPPING["gemma4_text"](hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True,
                                           head_dim=32, vocab_size=359)  # fmt: skip
    gemma4.save_pretrained(tmp_path / "gemma4")  # its key/value heads differ per layer: reading the whole count raised
    read_model_config(tmp_path / "gemma4" / "config.json")  # plan, train and eval had died with a traceback here
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 must divide num_attention_heads=2 and num_key_value_heads=1"):
        check_tensor_parallel_heads(tp2, str(tmp_path / "gemma4"))
    from transformers import ArceeConfig

    ArceeConfig(**shape).save_pretrained(tmp_path / "arcee")  # an MLP without a gate (up_proj, down_proj) splits exactly
    check_shardable(tp2, str(tmp_path / "arcee"), "policy.model_name")
    with pytest.raises(
        ConfigError, match=r"cannot find the decoder layers.*; lower policy.dp_size and policy.dtensor_cfg.tensor_parallel_size to 1"
    ):
        check_shardable(
            recipe("policy.dp_size=2", "policy.dtensor_cfg.tensor_parallel_size=2"), str(tmp_path / "rwkv"), "policy.model_name"
        )
    dp2 = recipe("policy.dp_size=2")
    check_shardable(dp2, str(tmp_path / "qwen3"), "policy.model_name")  # FSDP2 alone shards any layout it finds
    check_shardable(dp2, str(tmp_path / "falcon"), "policy.model_name")
    from transformers import Llama4TextConfig

    llama4 = Llama4TextConfig(**shape, intermediate_size_mlp=64, num_local_experts=2)  # its text class: model.model.layers,
    assert len(decoder_layers(AutoModelForCausalLM.from_config(llama4))) == 2  # base_model_prefix 'language_model'
    with pytest.raises(ConfigError, match=r"policy.model_name=.*rwkv'.*cannot find the decoder layers.*; lower policy.dp_size to 1"):
        check_shardable(dp2, str(tmp_path / "rwkv"), "policy.model_name")
