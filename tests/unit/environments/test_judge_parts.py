"""The judge's pure parts: template rendering and checks (format and Jinja, inline and file), the parsers and their
registry, and the section's errors and warnings (no model, no actor)."""

from __future__ import annotations

import warnings

import pytest

from nemo_like.config.errors import ConfigError
from nemo_like.config.schema import MasterConfig
from nemo_like.environments.judge import JudgeEnvConfig
from nemo_like.environments.judge_parsers import JudgeParseError, parse_json_field, parse_number, parse_regex, resolve_parser
from nemo_like.environments.judge_template import DEFAULT_TEMPLATE, JudgeTemplate, load_template_text
from nemo_like.environments.registry import resolve_environments

META = {"answer": 7, "task_name": "t", "level": "easy"}


def test_format_and_jinja_templates_render_the_same_fields() -> None:
    fmt = JudgeTemplate("Q: {prompt} A: {response} gold {answer} ({metadata[level]})")
    jinja = JudgeTemplate("Q: {{ prompt }} A: {{ response }} gold {{ answer }} ({{ metadata.level }})", "jinja")
    expected = "Q: 3+4? A: 7 gold 7 (easy)"
    assert fmt.render("3+4?", "7", META) == expected == jinja.render("3+4?", "7", META)
    assert JudgeTemplate("{answer}|{response}").render("", "", {"task_name": "t"}) == "|"  # no gold answer: empty


def test_template_from_a_file_or_the_default(tmp_path) -> None:
    path = tmp_path / "judge.txt"
    path.write_text("Rate {response}")
    assert load_template_text(None, str(path)) == "Rate {response}"
    assert load_template_text(None, None) == DEFAULT_TEMPLATE
    with pytest.raises(ValueError, match="not both"):
        load_template_text("x", str(path))
    with pytest.raises(ValueError, match="cannot be read"):
        load_template_text(None, str(tmp_path / "missing.txt"))


@pytest.mark.parametrize(
    ("text", "fmt", "message"),
    [
        ("{respons}", "format", r"unknown field\(s\) \['respons'\]"),
        ("{}", "format", "positional field"),
        ("{{ reponse }}", "jinja", r"unknown field\(s\) \['reponse'\]"),
        ("{% if %}", "jinja", "does not parse"),
        # the same text for every sample: one verdict a step, constant within every group (no advantage)
        ("Is this right? {prompt}", "format", r"never uses \{response\}: the judge would score the same text for every sample"),
        ("{{ prompt }} {{ answer }}", "jinja", r"never uses \{response\}"),
        # passed the check, then failed on every sample ('dict' object has no attribute 'level'): Jinja's spelling
        ("Level {metadata.level}: {response}", "format", r"\{metadata.level\} reads an attribute.*write \{metadata\[level\]\}"),
    ],
)
def test_bad_templates_are_refused(text: str, fmt: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JudgeTemplate(text, fmt)  # type: ignore[arg-type]


def test_a_metadata_key_with_a_dot_is_a_key_not_an_attribute() -> None:
    template = JudgeTemplate("Source {metadata[source.url]}: {response}")
    assert template.render("p", "r", {"source.url": "x.org"}) == "Source x.org: r"
    with pytest.raises(ValueError, match=r"\{metadata\[a\].b\} reads an attribute.*write \{metadata\[a\]\[b\]\}"):
        JudgeTemplate("{metadata[a].b}")


def test_parsers() -> None:
    assert parse_number("Score: 8/10") == 8.0
    assert parse_number("from 3 to 7.5", which="last") == 7.5
    assert parse_regex("Verdict: [[6]]", r"\[\[(\d+)\]\]") == 6.0
    assert parse_json_field('ok {"score": {"value": 0.25}} end', "score.value") == 0.25
    assert parse_json_field('{"correct": true}', "correct") == 1.0
    # a hyphen is not a minus sign (a negative reward from a non-negative verdict), a sign after a space or colon is
    assert parse_number("As GPT-4, I rate it 7") == 4.0 and parse_number("Score: 7-8", which="last") == 8.0
    assert parse_number("score:-3") == -3.0 and parse_number("delta -0.5 (+2)", which="last") == 2.0
    # braces before the JSON object (LaTeX in the judge's reasoning) do not hide it
    assert parse_json_field('Since \\frac{1}{2} = 0.5, the verdict: {"score": 1}', "score") == 1.0
    assert parse_json_field('{1} then {"score": 0.5} and {"score": 0}', "score") == 0.5
    for call in (
        lambda: parse_number("no digits"),
        lambda: parse_regex("Verdict: six", r"Verdict: (\d)"),
        lambda: parse_json_field("{not json", "x"),
        lambda: parse_json_field('{"a": 1}', "b"),
        lambda: parse_json_field('{"a": [1]}', "a"),
        lambda: parse_number("1e999"),
    ):
        with pytest.raises(JudgeParseError):
            call()


def test_parser_plugins_come_from_the_registry_or_an_import_path(tmp_path) -> None:
    assert resolve_parser("regex", {"pattern": "(x)"}) is parse_regex
    plugin = tmp_path / "my_parser.py"
    plugin.write_text("def parse(text, scale=1.0):\n    return scale * len(text)\n")
    parser = resolve_parser(f"{plugin}:parse", {"scale": 2.0})
    assert parser("abc", scale=2.0) == 6.0
    with pytest.raises(ValueError, match="do not fit parser"):
        resolve_parser(f"{plugin}:parse", {"pattern": "x"})
    with pytest.raises(ConfigError, match="Did you mean 'number'"):
        resolve_parser("numbr", {})
    with pytest.raises(ValueError, match="do not fit parser 'regex'"):
        resolve_parser("regex", {})  # pattern missing
    with pytest.raises(ValueError, match="not a regular expression"):
        resolve_parser("regex", {"pattern": "("})
    # A group the pattern lacks passed start-up, then every verdict was a parse failure (IndexError) for the whole run.
    with pytest.raises(ValueError, match=r"parser_options.group 1 is not a group of parser_options.pattern 'Score: \*\\\\d\+' \(it has 0"):
        resolve_parser("regex", {"pattern": r"Score: *\d+"})
    with pytest.raises(ValueError, match=r"group 'score' is not a group .* named \['s'\]"):
        resolve_parser("regex", {"pattern": r"Score: *(?P<s>\d+)", "group": "score"})
    assert resolve_parser("regex", {"pattern": r"Score: *(?P<s>\d+)", "group": "s"})("Score: 8", r"Score: *(?P<s>\d+)", "s") == 8.0
    assert resolve_parser("regex", {"pattern": r"Score: *\d+", "group": 0}) is parse_regex  # the whole match


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"template": "x", "template_file": "y"}, "not both"),
        ({"template": "{verdict}"}, "unknown field"),
        ({"parser": "json_field"}, "do not fit parser 'json_field'"),
        ({"parser": "regx", "parser_options": {"pattern": "(1)"}}, "Did you mean 'regex'"),
        # option values were checked when a verdict was read: every sample a parse failure
        ({"parser_options": {"which": "Last"}}, "parser_options.which must be 'first' or 'last', got 'Last'"),
        ({"parser": "json_field", "parser_options": {"field": "score."}}, "parser_options.field must be a dotted path"),
        ({"score_range": [10, 0]}, "score_range must be \\[low, high\\]"),
        ({"deadline_s": 0}, "env.j.deadline_s"),
        ({"deadline_s": 1e-6}, "env.j.deadline_s"),  # below Ray's millisecond: a wait of 0, not a microsecond
        ({"model_name": "./no/such/judge"}, "env.j.model_name"),
        ({"parse_failure_reward": "low"}, "env.j.parse_failure_reward"),
        ({"parse_failure_reward": float("inf")}, "env.j.parse_failure_reward"),
        ({"engine_backend": "sglang"}, "env.j.engine_backend"),
        ({"engine_kv_cache_space_gib": 0.5}, "env.j.engine_kv_cache_space_gib"),
        ({"engine_num_gpus": 1.5}, "env.j.engine_num_gpus"),  # one engine runs on one GPU; Ray grants 1.5 as no GPU can
        # every judge prompt was cut to nothing (each sample an engine error, the engine restarted every step)
        ({"max_new_tokens": 64, "engine_max_model_len": 64}, "max_new_tokens=64 leaves no room for the judge's prompt"),
    ],
)
def test_bad_judge_sections_name_the_key(section: dict, message: str) -> None:
    cfg = MasterConfig.model_validate({"env": {"j": {"class": "judge", **section}}})
    with pytest.raises(ConfigError, match=message):
        resolve_environments(cfg.env_sections)


def test_a_judge_the_hf_sampler_cannot_drive_is_refused_naming_its_engine_backend(tmp_path) -> None:
    """A MiniMax judge on the HF engine was accepted: its actor refused every call, so every sample got
    parse_failure_reward and the engine restarted each step."""
    from transformers import MiniMaxConfig

    MiniMaxConfig(vocab_size=359, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1).save_pretrained(
        tmp_path
    )
    cfg = MasterConfig.model_validate({"env": {"j": {"class": "judge", "model_name": str(tmp_path)}}})
    with pytest.raises(
        ConfigError,
        match=r"env.j: engine_backend='hf' cannot sample the judge .*MiniMaxForCausalLM: its lightning-attention layers.*engine_backend='vllm' samples",
    ):
        resolve_environments(cfg.env_sections)
    vllm = MasterConfig.model_validate({"env": {"j": {"class": "judge", "model_name": str(tmp_path), "engine_backend": "vllm"}}})
    resolve_environments(vllm.env_sections)


def test_a_vllm_judge_that_cannot_start_or_run_is_refused_when_the_recipe_loads(tmp_path) -> None:
    """A head size vLLM's CPU attention lacks, and a gated delta net in float32 (the judge's default precision): the
    engine started, then failed every call ("Unsupported CPU attention configuration", "CPU GDN attention requires
    BF16"), so every sample got parse_failure_reward with nothing on the console."""
    from transformers import Qwen2Config, Qwen3NextConfig

    small_heads, delta_net = tmp_path / "head16", tmp_path / "next"
    Qwen2Config(vocab_size=359, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1).save_pretrained(
        small_heads
    )
    Qwen3NextConfig(vocab_size=359, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                    layer_types=["linear_attention", "full_attention"]).save_pretrained(delta_net)  # fmt: skip

    def judge(model, **section):
        cfg = MasterConfig.model_validate({"env": {"j": {"class": "judge", "model_name": str(model), "engine_backend": "vllm", **section}}})
        return resolve_environments(cfg.env_sections)

    with pytest.raises(
        ConfigError, match=r"env.j: engine_backend='vllm' on a CPU cannot run the judge .*head sizes \[32, .*the model's is 16"
    ):
        judge(small_heads)
    with pytest.raises(ConfigError, match=r"gated delta nets in bfloat16 only, and it would load it in float32; use engine_backend='hf'"):
        judge(delta_net)
    judge(delta_net, precision="bfloat16")
    judge(small_heads, engine_num_gpus=1)  # vLLM's GPU attention
    # a tokenizer that states no context length: the environment actor refused it, after Ray and the other actors started
    import json
    import shutil

    from nemo_like.models.assets import default_model_path

    unbounded = tmp_path / "unbounded"
    shutil.copytree(default_model_path(), unbounded)
    settings = json.loads((unbounded / "tokenizer_config.json").read_text())
    settings.pop("model_max_length")
    (unbounded / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=r"the tokenizer of the judge .*unbounded' states no context length .*set engine_max_model_len"):
        judge(unbounded)
    judge(unbounded, engine_max_model_len=128)
    judge(default_model_path())  # the shipped tokenizer states 256


def test_the_default_template_bounds_its_scores_and_another_template_only_by_score_range() -> None:
    """The default template asks for 0-10; a parsed 2024 ("2024 was a good year; 7") became a reward of 202 at scale 0.1."""
    assert JudgeEnvConfig().score_bounds == (0.0, 10.0)
    assert JudgeEnvConfig(template="Rate {response} from 1 to 100:").score_bounds is None
    assert JudgeEnvConfig(template="Rate {response} from 1 to 100:", score_range=[1, 100]).score_bounds == (1.0, 100.0)


def test_an_option_without_effect_warns() -> None:
    cfg = MasterConfig.model_validate({"env": {"j": {"class": "judge", "temperature": 0.5}}})
    with pytest.warns(UserWarning, match="temperature=0.5 has no effect with greedy=true"):
        resolve_environments(cfg.env_sections)
    cfg = MasterConfig.model_validate({"env": {"j": {"class": "judge", "engine_gpu_memory_utilization": 0.5}}})
    with pytest.warns(UserWarning, match="engine_gpu_memory_utilization has no effect with engine_backend='hf'"):
        resolve_environments(cfg.env_sections)
    # validated again from its dump (actor needs, the actor's constructor): a default is not "set" (every hf judge warned)
    from nemo_like.environments.judge import JudgeEnvConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        JudgeEnvConfig.model_validate(JudgeEnvConfig.model_validate({}).model_dump())


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_each_judge_backend_starts_its_engines_actor_with_arguments_it_accepts(backend: str) -> None:
    """The judge's engine is the run's generation actor class of that backend: its arguments must bind to that class's
    constructor as the worker group calls it (rank, world size first), and vLLM gets the run's engine environment."""
    import inspect

    from nemo_like.environments.judge_engine import JudgeEngineSpec, engine_actor
    from nemo_like.models.generation.hf_worker import HFGenerationWorker
    from nemo_like.models.generation.vllm_worker import ENGINE_ENV, VLLMGenerationWorker

    spec = JudgeEngineSpec(
        "embedded:tiny-arith-qwen2", "float32", 1, 0.25, 0.0, 1, 0, (1,), backend=backend, max_model_len=512, kv_cache_space_gib=2
    )
    actor_cls, init, env = engine_actor(spec, max_batch_size=8)
    assert actor_cls is {"hf": HFGenerationWorker, "vllm": VLLMGenerationWorker}[backend]
    inspect.signature(actor_cls.__init__).bind(None, 0, 1, **init)  # raises TypeError on a missing or unknown argument
    if backend == "vllm":
        assert init["max_model_len"] == 512 and env is not None and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
        assert ENGINE_ENV.items() <= env.items()
    else:
        assert env is None and init["max_batch_size"] == 8


def test_the_judge_engine_stops_where_the_judges_turn_ends(tmp_path) -> None:
    """A chat judge whose turn-end token is listed only in generation_config.json (Gemma-it, Llama-3-Instruct): the
    judge engine stopped on the tokenizer's eos alone, so a verdict ran past its turn ("19" + junk parsed as 1919)."""
    import json
    import shutil

    from nemo_like.environments.judge import JudgeEnvConfig, judge_engine_spec
    from nemo_like.models.loading import load_tokenizer, resolve_model_path

    judge = tmp_path / "gemma_like_judge"
    shutil.copytree(resolve_model_path("embedded:tiny-arith-qwen2"), judge)
    tokenizer_config = json.loads((judge / "tokenizer_config.json").read_text())
    (judge / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "<|endoftext|>"}))
    generation_config = json.loads((judge / "generation_config.json").read_text())
    (judge / "generation_config.json").write_text(json.dumps({**generation_config, "eos_token_id": [0, 2]}))
    tokenizer = load_tokenizer(str(judge))
    assert tokenizer.eos_token_id == 0 and tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    spec = judge_engine_spec(JudgeEnvConfig(model_name=str(judge)), tokenizer, 64)
    assert spec.eos_token_ids == (0, 2)
    vllm = JudgeEnvConfig(model_name=str(judge), engine_backend="vllm")
    with pytest.raises(ValueError, match="does not state its context length: set engine_max_model_len"):
        judge_engine_spec(vllm, tokenizer, None)


def test_the_judges_engines_wait_for_their_placement_as_long_as_the_run_says(monkeypatch) -> None:
    """The judge's engine group waited 60 s whatever cluster.placement_timeout_s said: on a busy or autoscaling cluster
    given 900 s, the judge's environment actor died at 60."""
    from nemo_like.environments import interface
    from nemo_like.environments.judge import JudgeEnvConfig, judge_engine_spec
    from nemo_like.environments.worker import EnvironmentWorker
    from nemo_like.models.loading import load_tokenizer

    monkeypatch.setitem(interface.HELPER_PLACEMENT, "timeout_s", 60.0)
    EnvironmentWorker(0, 1, "arithmetic", "arithmetic", {}, placement_timeout_s=900.0)  # what every environment actor runs first
    cfg = JudgeEnvConfig()
    assert judge_engine_spec(cfg, load_tokenizer(cfg.model_name), 64).placement_timeout_s == 900.0


def test_a_judge_whose_context_holds_no_prompt_is_refused_and_a_chat_template_it_lacks_warns(tmp_path) -> None:
    """The context read from the judge's tokenizer (no engine_max_model_len) is checked when the judge starts; with no
    chat template, use_chat_template did nothing silently (the reward model warns there)."""
    import shutil

    from nemo_like.environments.judge import JudgeEnvConfig, checked_context
    from nemo_like.environments.learned_inputs import resolve_reward_model_path
    from nemo_like.models.loading import load_tokenizer

    tokenizer = load_tokenizer("embedded:tiny-arith-qwen2")  # the default judge: model_max_length 256
    assert checked_context(JudgeEnvConfig(), tokenizer) == 256
    with pytest.raises(ValueError, match=r"max_new_tokens=300 leaves no room .* context of 256 tokens"):
        checked_context(JudgeEnvConfig(max_new_tokens=300), tokenizer)
    bare = tmp_path / "judge"
    shutil.copytree(resolve_reward_model_path("embedded:tiny-arith-qwen2"), bare)
    (bare / "chat_template.jinja").unlink()
    with pytest.warns(UserWarning, match="use_chat_template has no effect: the judge .* has no chat template"):
        checked_context(JudgeEnvConfig(model_name=str(bare)), load_tokenizer(str(bare)))


def test_a_response_too_long_for_the_judge_loses_its_middle_not_the_question() -> None:
    """The prompt was cut from the left: past the tiny judge's 240 prompt tokens the question and the user turn's
    header went first, and a padded response was judged without what was asked."""
    from nemo_like.environments.judge import CUT_MARK, JudgeEnvConfig, JudgeEnvironment
    from nemo_like.environments.judge_template import DEFAULT_TEMPLATE, JudgeTemplate
    from nemo_like.models.loading import load_tokenizer

    tok = load_tokenizer("embedded:tiny-arith-qwen2")
    judge = object.__new__(JudgeEnvironment)  # the prompt building alone: no engine actors
    judge.cfg, judge.template, judge.tokenizer = JudgeEnvConfig(), JudgeTemplate(DEFAULT_TEMPLATE), tok
    judge.max_prompt_tokens, judge._counts = 240, {"prompt_missing": 0, "truncated": 0}
    question = "What is 17 + 25? Answer with the number only."
    response = "42. " + "I am very sure. " * 100 + "Final answer: 42"
    ids = judge.judge_prompt_ids(response, {"prompt": question})
    text = tok.decode(ids)
    assert len(ids) <= 240 and judge._counts["truncated"] == 1
    assert text.startswith("<|im_start|>user\n") and question in text and text.endswith("<|im_start|>assistant\n")
    assert "42. I am very sure." in text and "Final answer: 42" in text and CUT_MARK in text
    assert len(judge.judge_prompt_ids("42", {"prompt": question})) < 240 and judge._counts["truncated"] == 1  # short: whole
