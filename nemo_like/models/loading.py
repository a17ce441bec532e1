"""Loading models and tokenizers from a hub id, a local directory or the shipped tiny model."""

from __future__ import annotations

import functools
import json
import os
import shlex
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from huggingface_hub.errors import StrictDataclassError

from nemo_like.config.errors import ConfigError
from nemo_like.config.overrides import quoted_override
from nemo_like.config.schema import EMBEDDED_MODEL
from nemo_like.models.attention import attend_in_float32_on_cpu
from nemo_like.models.layer_kinds import attention_free, gated_delta_net
from nemo_like.models.rope import fixed_frequency_length, rope_parameters, rope_type
from nemo_like.plan.backend import PolicyModel
from nemo_like.plan.memory import layer_values
from nemo_like.utils.text_path import multimodal

HUB_PROBE_TIMEOUT_S = 5.0
_TRUE = ("1", "true", "yes", "on")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter directory's config (see :mod:`nemo_like.models.lora`)


def resolve_model_path(model_name: str) -> str:
    """Map ``embedded:<name>`` (the default sentinel or another shipped model) to its directory; anything else is passed through."""
    if model_name.startswith("embedded:"):
        from nemo_like.models.assets import embedded_model_path

        return embedded_model_path(model_name)
    return model_name


def local_config_file(name: str) -> Path | None:
    """Model ``name``'s ``config.json`` on this machine: a shipped model's, a local directory's, or a hub id's copy in
    the local cache (never downloaded); ``None`` when there is none here."""
    path = Path(resolve_model_path(name)).expanduser()
    if (path / "config.json").is_file():
        return path / "config.json"
    if looks_like_path(name) or name.startswith("embedded:"):
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json", cache_dir=hub_cache_dir())
    return Path(cached) if isinstance(cached, str) else None


def actor_model_source(name: str) -> str:
    """``name`` as an actor must be given it: a relative local path made absolute, anything else unchanged. An actor's
    working directory is not the driver's when the run joins a cluster (Ray starts it where its node was started), so
    ``./my_model`` that the driver checked would be looked up elsewhere there (or not found). Applied where the driver
    hands a model to actors, never to the run config (``policy.model_name`` is a resume-checked key)."""
    if name.startswith("embedded:"):
        return name
    path = Path(name).expanduser()
    if not path.is_absolute() and looks_like_path(name) and path.exists():
        return str(path.resolve())
    return name


def hub_offline() -> bool:
    """Whether Hugging Face downloads are switched off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(var, "").strip().lower() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def go_offline() -> None:
    """Switch this process, and the actors it starts (``HF_HUB_OFFLINE`` is forwarded), to offline mode: the variable,
    and the flags ``huggingface_hub`` and ``datasets`` read from it once at import (setting the variable alone left
    this process retrying the hub for minutes when loading a cached tokenizer)."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:  # imported later, it reads the variable itself
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (``HF_HUB_CACHE``, ``HF_HOME``/hub, ~/.cache)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id: absolute, relative with ./ ../ ~, existing on disk, or with more than one '/'
    (a hub id is ``name`` or ``org/name``: ``results/grpo/step_50`` can only be a path)."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or name.count("/") > 1 or Path(name).exists()


def hub_endpoint_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Try a TCP connection to the hub endpoint (``HF_ENDPOINT``); ``(reachable, endpoint or the error)``."""
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError as exc:
        return False, f"{endpoint} is unreachable ({exc})"
    return True, endpoint


def check_tokenizer_source(cfg: Any, model_checked: bool = False) -> None:
    """The run's tokenizer source (``policy.tokenizer_name``, else ``policy.model_name``) is loadable here: else one
    line naming the key (:func:`check_model_source`), before anything starts. ``model_checked``: the caller checked
    ``policy.model_name`` already (each check may probe the hub: not twice)."""
    tokenizer = cfg.policy.tokenizer_name
    if tokenizer and tokenizer != cfg.policy.model_name:
        check_model_source(tokenizer, "policy.tokenizer_name")
    elif not model_checked:
        check_model_source(cfg.policy.model_name, "policy.tokenizer_name" if tokenizer else "policy.model_name")


def refuse_checkpoint_as_model(name: str, key: str, trained: bool = True) -> None:
    """A training run's policy must be a whole model, not a checkpoint: a LoRA checkpoint's ``policy/`` (adapters only)
    loaded frozen (nothing to train) and vLLM refused it, and a checkpoint step ``step_N/`` holds its model one level
    down; both failed only after the actors started. A :class:`ConfigError` naming ``key`` and the fix. Not
    ``trained`` (a teacher): a LoRA checkpoint's ``policy/`` is a model (its base with the adapters merged), a step
    directory is still refused. A ``checkpointing.checkpoint_dir`` (as ``nemo-like eval`` takes one) is refused as its
    latest valid step is (it was blamed for holding no tokenizer or config.json)."""
    try:
        path = Path(resolve_model_path(name)).expanduser()
    except ValueError as exc:  # an embedded: name that is not shipped
        raise ConfigError(f"{key}={name!r}: {exc}") from None
    if (path / "config.json").is_file():
        return
    from nemo_like.utils.checkpoint import CheckpointManager

    # a checkpoint step holds its model in policy/; a checkpoint directory, in its latest valid step's
    latest = None if (path / "policy").is_dir() else CheckpointManager(path).latest()
    step = path if latest is None else latest.path
    model = step / "policy" if (step / "policy").is_dir() else path
    what = "a checkpoint step" if latest is None else f"a checkpointing.checkpoint_dir (latest valid step: {latest.path.name})"
    if trained and (model / ADAPTER_CONFIG).is_file():
        raise ConfigError(
            f"{key}={name} is a LoRA checkpoint (adapters only, {ADAPTER_CONFIG}): merge it into a whole model first "
            f"(`nemo-like merge {shlex.quote(name)} --out DIR`) and train from DIR, or resume the run that wrote it (its "
            "checkpointing.checkpoint_dir)"
        )
    if model != path and ((model / "config.json").is_file() or (model / ADAPTER_CONFIG).is_file()):
        written = quoted_override(key, str(model))  # Hydra reads non-ASCII and '(' quoted only, then the shell
        resume = (
            " (or resume the run that wrote it, from its checkpointing.checkpoint_dir)"
            if trained
            else f": set {written[1] if written else shlex.quote(f'{key}={model}')}"
        )
        raise ConfigError(f"{key}={name} is {what}: its model is {model}{resume}")


#: Heads that score or classify text instead of predicting its next token: a model listing only these loads as a causal
#: LM with an output head that is its tied embeddings or freshly random (transformers only reports the unused weights).
NON_GENERATIVE_HEADS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMaskedLM",
    "ForMultipleChoice",
)


def check_generative(model_name: str, key: str, local_only: bool = False) -> None:
    """A :class:`ConfigError` naming ``key`` when the model's config.json lists only architectures of a scoring or
    classification head (:data:`NON_GENERATIVE_HEADS`: a reward model named as a policy or a teacher)."""
    architectures = list(getattr(model_config(model_name, local_only), "architectures", None) or [])
    if architectures and all(a.endswith(NON_GENERATIVE_HEADS) for a in architectures):
        raise ConfigError(
            f"{key}={model_name} is not a causal language model ({', '.join(architectures)} in its config.json): loaded "
            "to predict tokens, its output head would be its tied embeddings or random weights. Name a *ForCausalLM "
            "model (a reward model belongs in an env section with class: reward_model)"
        )


def check_model_source(name: str, key: str) -> None:
    """Fail with one line naming ``key`` when ``name`` can not be loaded here, before anything starts.

    * a local path must be an existing directory;
    * a hub id must be in the local cache when the machine is offline (``HF_HUB_OFFLINE=1``, or the
      hub endpoint does not answer within a few seconds); a cached model on an unreachable hub switches
      the run to offline mode, so no process waits on network retries.
    """
    if name.startswith("embedded:"):
        from nemo_like.models.assets import embedded_model_path

        try:
            embedded_model_path(name)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"{key}: {exc}") from None
        return
    if looks_like_path(name):
        path = Path(name).expanduser()
        if not path.is_dir():
            problem = "is a file, not a model directory" if path.exists() else "does not exist"
            raise ConfigError(
                f"{key}={name!r}: {path} {problem}. Point {key} at a local model directory (with config.json) "
                f"or a Hugging Face hub id, or use '{EMBEDDED_MODEL}'"
            )
        return
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache_dir()
    cached = local_config_file(name) is not None or isinstance(try_to_load_from_cache(name, "tokenizer_config.json", cache_dir=cache), str)
    if cached and hub_offline():
        return
    if hub_offline():
        why = "the machine is offline (HF_HUB_OFFLINE=1)"
    else:
        reachable, detail = hub_endpoint_reachable()
        if reachable:
            return  # transformers downloads it (or revalidates the cached copy)
        if cached:
            go_offline()  # this process and every actor: load from the cache, no retries
            print(f"[setup] {detail}: using the cached copy of {name} (HF_HUB_OFFLINE=1)")
            return
        why = f"the machine is offline: {detail}"
    raise ConfigError(
        f"{key}={name!r} is a Hugging Face hub id, but {why} and the model is not in the local cache ({cache}). "
        f"Download it where there is network (`hf download {name} --local-dir DIR`) and set {key}=DIR "
        "(a local directory path), or fill the cache (HF_HOME) and keep HF_HUB_OFFLINE=1"
    )


def resolve_checkpoint_model(model_path: str, key: str) -> str:
    """The model directory ``model_path`` names, for ``nemo-like eval`` and ``nemo-like serve``: a model directory
    (``config.json``) or a LoRA one (``adapter_config.json``) as given, a checkpoint step directory's ``policy/``,
    a ``checkpointing.checkpoint_dir``'s latest valid step's ``policy/``; a hub id or the embedded model as given.
    A path that holds none of these is a :class:`ConfigError` naming ``key``."""
    from nemo_like.utils.checkpoint import CheckpointManager

    path = Path(model_path).expanduser()
    if not path.exists():
        check_model_source(model_path, key)  # a missing path, or a hub id this machine cannot load
        return model_path  # a hub id or the embedded model
    for marker in ("config.json", ADAPTER_CONFIG):  # a full checkpoint, or a LoRA one (adapters only)
        if (path / "policy" / marker).is_file():
            return str(path / "policy")
        if (path / marker).is_file():
            return str(path)
    latest = CheckpointManager(path).latest()
    if latest is not None:
        return str(latest.path / "policy")
    raise ConfigError(
        f"{key}: {model_path} is neither a model directory (config.json), a checkpoint step directory "
        "(policy/config.json) nor a checkpoint directory with a valid step_N"
    )


def load_causal_lm(model_name: str, precision: str = "float32"):
    """Load a causal LM for training or inference, its attention in float32 on a CPU under autocast
    (:func:`~nemo_like.models.attention.attend_in_float32_on_cpu`, as the written-out forwards attend). A LoRA adapter
    directory (``adapter_config.json``) loads as its base model with the adapters merged in."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per actor per load is noise in the driver's log
    path = resolve_model_path(model_name)
    if (Path(path) / ADAPTER_CONFIG).is_file():  # a LoRA checkpoint's policy/: its base model, adapters merged
        return load_merged(path, precision)  # its base model loads through this function
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[precision])
    model.config.use_cache = False
    return attend_in_float32_on_cpu(model)


def adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT adapter directory; a :class:`ConfigError` naming the file when it is no
    JSON object (a damaged checkpoint: a traceback, or a merge blaming the base model, before)."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        content = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not readable JSON ({exc}): the LoRA checkpoint is damaged") from None
    if not isinstance(content, dict):
        raise ConfigError(f"{path} holds a JSON {type(content).__name__}, not the object of a PEFT adapter config")
    return content


def adapter_base_model(adapter_dir: str | Path) -> str:
    """The base model a LoRA adapter directory names (``base_model_name_or_path`` of its adapter config); a
    :class:`ConfigError` when it names none."""
    base = adapter_config(adapter_dir).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ConfigError(
            f"{Path(adapter_dir) / ADAPTER_CONFIG} names no base model (base_model_name_or_path is {base!r}): "
            "nemo-like merge --base-model MODEL says which the adapters were trained on"
        )
    return base


def check_adapter_dir(adapter_dir: str | Path) -> None:
    """A :class:`ConfigError` when ``adapter_dir`` is no PEFT adapter directory (no ``adapter_config.json``), saying
    so when it is a whole model already (nothing to merge)."""
    adapter_dir = Path(adapter_dir)
    if (adapter_dir / ADAPTER_CONFIG).is_file():
        adapter_config(adapter_dir)  # readable, or the error names the file
        return
    whole = (adapter_dir / "config.json").is_file() and any(adapter_dir.glob("*.safetensors"))
    hint = (
        f": it is a full model already (AutoModelForCausalLM.from_pretrained('{adapter_dir}') loads it), nothing to merge" if whole else ""
    )
    raise ConfigError(f"{adapter_dir} holds no LoRA adapter ({ADAPTER_CONFIG} is missing){hint}")


def load_merged(adapter_dir: str | Path, precision: str = "float32", base_model: str | None = None) -> torch.nn.Module:
    """The plain model of a PEFT adapter directory (a LoRA checkpoint's ``policy/``): its base model
    (``base_model_name_or_path`` unless ``base_model`` is given) with the adapters merged in. Adapters that do not fit
    the base (another model's: an adapter tensor it has no place for, an adapted layer with none, or another shape) are
    a :class:`ConfigError` before anything loads (PEFT dropped the first two silently)."""

    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    check_adapter_dir(adapter_dir)
    base = base_model or adapter_base_model(adapter_dir)
    if base_model is None:  # a base that is not here fails in one line (it went to the hub as a repo id)
        check_model_source(base, f"{adapter_dir / ADAPTER_CONFIG} base_model_name_or_path (override it with --base-model)")
    _check_adapters_fit(adapter_dir, base, base_model is not None)
    model = PeftModel.from_pretrained(load_causal_lm(base, precision), str(adapter_dir))
    merged = model.merge_and_unload()
    merged.config.use_cache = False
    return merged


#: A PEFT adapter directory's weights: safetensors (what :func:`nemo_like.models.lora.write_adapter` and PEFT write),
#: or the pickled file of older PEFT versions.
_ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def _saved_adapter_shapes(adapter_dir: Path) -> dict[str, tuple[int, ...]]:
    """The tensors of ``adapter_dir``'s adapter weights file: saved name -> shape (a safetensors file's header only)."""
    for name in _ADAPTER_WEIGHT_FILES:
        file = adapter_dir / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(str(file), framework="pt") as f:
                    return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 (no __iter__)
            return {key: tuple(t.shape) for key, t in torch.load(file, map_location="cpu", weights_only=True).items()}
        except Exception as exc:  # a truncated or foreign file: safetensors' and torch's errors vary
            raise ConfigError(f"{file} cannot be read as adapter weights: {exc}") from None
    raise ConfigError(f"{adapter_dir} holds no adapter weights (none of {list(_ADAPTER_WEIGHT_FILES)} beside {ADAPTER_CONFIG})")


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (PEFT's and transformers' span several)."""
    return " ".join(str(exc).split())


def peft_adapter_config(adapter_dir: str | Path) -> Any:
    """PEFT's reading of ``adapter_dir``'s adapter config; a :class:`ConfigError` naming the file when PEFT cannot read
    it (no ``peft_type``, a value of the wrong type: a TypeError traceback, or a merge blaming the base model, before)."""
    from peft import PeftConfig

    try:
        return PeftConfig.from_pretrained(str(adapter_dir))
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(
            f"{Path(adapter_dir) / ADAPTER_CONFIG} is no adapter config PEFT can read ({one_line(exc)}): the LoRA checkpoint is damaged"
        ) from None


def _expected_adapter_shapes(adapter_dir: Path, base: str) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The adapter tensors (saved names -> shapes) that ``adapter_dir``'s adapter config puts on ``base``: those PEFT
    always saves, and those it may save too (an adapted embedding's full weights, ``save_embedding_layers``), from a
    meta-device skeleton of the base (no weights are loaded; saved explicitly, PEFT asks the hub nothing)."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    config = peft_adapter_config(adapter_dir)
    with torch.device("meta"):
        base_skeleton = AutoModelForCausalLM.from_config(model_config(base))
        try:
            skeleton = PeftModel(base_skeleton, config)
        except TypeError as exc:  # a value of the wrong type (a rank written as text)
            raise ConfigError(
                f"{adapter_dir / ADAPTER_CONFIG} holds a value PEFT cannot use ({one_line(exc)}): the LoRA checkpoint is damaged"
            ) from None

    def shapes(with_embeddings: bool) -> dict[str, tuple[int, ...]]:
        state = get_peft_model_state_dict(skeleton, save_embedding_layers=with_embeddings)
        return {key: tuple(t.shape) for key, t in state.items()}

    return shapes(False), shapes(True)


def _check_adapters_fit(adapter_dir: Path, base: str, given: bool) -> None:
    """A one-line :class:`ConfigError` naming ``adapter_dir``, ``base`` and ``--base-model`` (``given``: the base came
    from it) when the adapter weights file and the adapters its config puts on ``base`` differ: a tensor of the file
    the base has no place for (a base with fewer layers: PEFT left it out silently), an adapted layer of the base the
    file has no tensor for (more layers: PEFT kept its fresh, no-op adapter, with a warning), or another shape (another
    width: PEFT's raw size-mismatch traceback)."""
    saved = _saved_adapter_shapes(adapter_dir)
    source = f"--base-model {base}" if given else f"its base model {base} ({ADAPTER_CONFIG} base_model_name_or_path)"
    remedy = (
        "the adapters were trained on another model: pass that one with --base-model"
        if given
        else "the model at that path is not the one they were trained on: pass that one with --base-model"
    )
    try:
        required, allowed = _expected_adapter_shapes(adapter_dir, base)
    except ConfigError:  # the adapter config itself (a ValueError too): the base is not to blame
        raise
    except (ValueError, RuntimeError, KeyError) as exc:  # PEFT: a target module the base does not have
        raise ConfigError(f"the LoRA adapters of {adapter_dir} do not fit {source}: {one_line(exc)}; {remedy}") from None

    def sample(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    unloaded = sorted(set(saved) - set(allowed))
    missing = sorted(set(required) - set(saved))
    reshaped = sorted(k for k in set(saved) & set(allowed) if saved[k] != allowed[k])
    problems = []
    if unloaded:
        problems.append(f"{len(unloaded)} adapter tensors of the checkpoint have no place in it ({sample(unloaded)})")
    if missing:
        problems.append(f"{len(missing)} adapter tensors it needs are not in the checkpoint ({sample(missing)})")
    if reshaped:
        first = reshaped[0]
        problems.append(
            f"{len(reshaped)} adapter tensors have another shape on it (the first, {first}: {list(saved[first])} in the "
            f"checkpoint, {list(allowed[first])} on this base)"
        )
    if problems:
        raise ConfigError(f"the LoRA adapters of {adapter_dir} do not fit {source}: {'; '.join(problems)}; {remedy}")


def save_generation_config(config: Any, directory: str | Path) -> None:
    """Write ``config`` as ``directory/generation_config.json`` as it is: ``save_pretrained`` validates it first and
    refuses a base model's own config that sets ``temperature`` or ``top_p`` without ``do_sample`` (which loads with a
    logged note), so every checkpoint (and merge) of a run on such a base failed."""
    config.to_json_file(Path(directory) / "generation_config.json", use_diff=True)


#: Files one of which a local directory needs to hold a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


def holds_tokenizer(directory: str | Path) -> bool:
    """Whether the local ``directory`` holds a tokenizer (one of :data:`TOKENIZER_FILES`)."""
    return any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)


#: The date a chat template that stamps today's (Llama 3.x: ``strftime_now`` unless ``date_string`` is given) renders:
#: fixed, so a prompt's ids do not change at midnight (a resumed run's data check refused the checkpoint, a multi-turn
#: episode's re-rendering no longer matched its ids). Llama 3's own templates' fallback date.
CHAT_TEMPLATE_DATE = "26 Jul 2024"


def render_chat(tokenizer: Any, messages: Any, **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`` with the date fixed (:data:`CHAT_TEMPLATE_DATE`):
    every chat rendering of the project goes through it (prompts, multi-turn turns, the rollout server, judges)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, date_string=CHAT_TEMPLATE_DATE, **kwargs)


#: A tool only a chat template's rendering can spell (:func:`renders_tools`).
PROBE_TOOL_NAME = "nemo_like_probe_tool_5f3a"
PROBE_TOOL = {
    "type": "function",
    "function": {"name": PROBE_TOOL_NAME, "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


def renders_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether the chat template (the tokenizer's, or ``chat_template``) writes the ``tools`` it is given into the
    prompt: many read only each message's role and content, and the model then sees no tool list."""
    try:
        messages = [{"role": "user", "content": "hi"}]
        return PROBE_TOOL_NAME in render_chat(tokenizer, messages, tools=[PROBE_TOOL], chat_template=chat_template)
    except Exception:  # noqa: BLE001 - a template that refuses the probe renders none of it
        return False


@functools.cache  # per tokenizer (hashed by identity): read once, not per text
def added_around(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids ``tokenizer`` adds before and after a text when asked for its special tokens (a BOS, CLS ... SEP; none
    when they merge with the text's): what ``tokenizer(text)`` gives beyond ``tokenizer(text, add_special_tokens=False)``."""
    probe, bare = tokenizer("x")["input_ids"], tokenizer("x", add_special_tokens=False)["input_ids"]
    at = next((i for i in range(len(probe) - len(bare) + 1) if probe[i : i + len(bare)] == bare), None)
    return ((), ()) if at is None else (tuple(probe[:at]), tuple(probe[at + len(bare) :]))


@functools.cache
def added_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts ``tokenizer`` reads as special or added tokens (each one id wherever it stands)."""
    return tuple(t for t in (*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()) if t)


def decode_exact(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text of ``ids`` with every token (special ones included), without whitespace clean-up (what a stop string
    is matched against, and what a multi-turn episode's text is made of)."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=4)
def exact_decoder(name: str) -> Callable[[Sequence[int]], str]:
    """:func:`decode_exact` with tokenizer ``name``, loaded once per process."""
    return functools.partial(decode_exact, load_tokenizer(name))


def tokenizer_source(policy_cfg: Any) -> str:
    """The policy's tokenizer (``policy.tokenizer_name``, else its model) as an actor must be given it."""
    return actor_model_source(policy_cfg.tokenizer_name or policy_cfg.model_name)


def load_tokenizer(name: str, fix: str = "name the tokenizer's model with policy.tokenizer_name"):
    """Load a tokenizer; prompts are left-padded for generation. A local directory without tokenizer files is an error
    (transformers returned an empty tokenizer for it, which encodes every text as no tokens), saying ``fix``."""
    from transformers import AutoTokenizer

    path = Path(resolve_model_path(name)).expanduser()
    if path.is_dir() and not holds_tokenizer(path):
        raise ConfigError(
            f"{name!r} holds no tokenizer (none of {list(TOKENIZER_FILES)}): {fix} (checkpoints written before "
            "2026-12-04 hold none in policy/)"
        )
    tok = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else resolve_model_path(name))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


#: What transformers raises for a config.json it cannot read: not JSON, an unknown ``model_type`` (ValueError), a field
#: its strict dataclass validation refuses (huggingface_hub's StrictDataclassError: a Exception of its own).
UNREADABLE_CONFIG_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError, TypeError, KeyError, StrictDataclassError)


#: The sizes a model's text config must give as positive integers (the plan and the model are built from them).
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "num_key_value_heads")


def read_model_config(path: Path) -> tuple[dict[str, Any], Any]:
    """``path``'s JSON and the ``transformers`` config it describes; a ConfigError naming the file when it is not a
    model's ``config.json`` (not JSON, no or an unknown ``model_type``: a generation_config.json, say), or naming the
    field where a size of :data:`SIZE_FIELDS` it gives or its class defaults is not a positive integer (a negative one
    was a torch traceback; 0 layers a plan that read "short -38489 MiB")."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        # transformers' reader: save_pretrained writes an infinite float as {"__float__": "Infinity"} (Mamba2's
        # time_step_limit), which plain JSON leaves a dict that the config's validation refused
        raw = PretrainedConfig._dict_from_json_file(path)
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise ValueError("it has no 'model_type'")
        _check_sizes(path, raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw)  # as written first:
        config = AutoConfig.for_model(**raw)  # transformers' own validation of a size says less
    except ConfigError:  # a size, named (a ConfigError is a ValueError too)
        raise
    except UNREADABLE_CONFIG_ERRORS as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{path}: not a causal language model's config.json ({str(exc).splitlines()[0]})") from None
    text = config.get_text_config()
    for name in SIZE_FIELDS:  # its class's defaults (each layer's, where it keeps one per layer)
        for value in layer_values(text, name):
            _check_sizes(path, {name: value})
    # a model whose every layer carries a state (Mamba, Mamba-2) has no attention heads to count
    needed = ("hidden_size",) if attention_free(config) else ("hidden_size", "num_attention_heads")
    if missing := [name for name in needed if not hasattr(text, name)]:
        raise ConfigError(f"{path}: its {raw['model_type']} config has no {' or '.join(missing)}, which the memory plan is counted from")
    return raw, config


def _check_sizes(path: Path, fields: Mapping[str, Any]) -> None:
    """A :class:`ConfigError` naming ``path`` and the field where one of :data:`SIZE_FIELDS` in ``fields`` is given
    and is not a positive integer (None: the class's default applies; ``intermediate_size`` may be one per layer, as
    Gemma-3n's)."""
    for name in SIZE_FIELDS:
        value = fields.get(name)
        values = value if name == "intermediate_size" and isinstance(value, list) and value else [value]
        if value is not None and any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ConfigError(f"{path}: {name} must be a positive integer, got {value!r}")


#: The config.json files that stand in for models not on this machine (``nemo-like plan --model-config`` and
#: ``--teacher-config``), by model name: :func:`model_config` reads these.
_GIVEN_CONFIGS: ContextVar[Mapping[str, Path] | None] = ContextVar("given_model_configs", default=None)


@contextmanager
def model_configs_given(configs: Mapping[str, Path]) -> Iterator[None]:
    """Within the block, :func:`model_config` (and so every check of a recipe against a model's config) reads
    ``configs[name]`` for model ``name``: ``nemo-like plan`` runs train's checks on the config files it was given."""
    token = _GIVEN_CONFIGS.set(dict(configs))
    try:
        yield
    finally:
        _GIVEN_CONFIGS.reset(token)


def model_config(model_name: str, local_only: bool = False) -> Any:
    """The model's ``config.json`` as transformers reads it; a LoRA checkpoint: its base model's; a model given a
    config file by :func:`model_configs_given`: that file's. ``local_only``: a hub id's cached copy, never the hub
    (``nemo-like plan``; otherwise transformers checks the cache against the hub, as the actors' loads do). A
    config.json on this machine that transformers cannot read is a :class:`ConfigError` naming the file (it was a
    transformers traceback)."""
    from transformers import AutoConfig

    if (given := (_GIVEN_CONFIGS.get() or {}).get(model_name)) is not None:
        return read_model_config(given)[1]
    path = Path(resolve_model_path(model_name)).expanduser()
    if (path / ADAPTER_CONFIG).is_file():
        return model_config(adapter_base_model(path), local_only)
    local = path / "config.json" if path.is_dir() else local_config_file(model_name) if local_only else None
    if local is None:
        return AutoConfig.from_pretrained(model_name)
    try:
        return AutoConfig.from_pretrained(str(local.parent))
    except UNREADABLE_CONFIG_ERRORS as exc:
        raise ConfigError(f"{model_name}: cannot read its config.json {local} ({str(exc).splitlines()[0]})") from None


def meta_skeleton(model_name: str, local_only: bool = False) -> torch.nn.Module:
    """Model ``model_name`` built on the meta device from its config (:func:`model_config`; no weights), to read its
    modules' names and shapes."""
    from transformers import AutoModelForCausalLM

    config = model_config(model_name, local_only)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def routes_experts(model_name: str, local_only: bool = False) -> bool:
    """Whether the model is a mixture of experts: its config says how many experts a token runs through
    (:func:`~nemo_like.utils.experts.top_k`) and its layers hold routed experts (a meta-device skeleton: some dense
    models' config classes carry a default top-k, Doge's and Nemotron-H's). A model whose config is not to be read:
    ``False``."""
    from nemo_like.utils.experts import experts_of, top_k

    try:
        if top_k(model_config(model_name, local_only)) is None:
            return False
        return experts_of(meta_skeleton(model_name, local_only))[0] > 0
    except (OSError, ValueError, ConfigError):
        return False


def policy_model(model_name: str, local_only: bool = False) -> PolicyModel:
    """What the backend and refit choices need to know of model ``model_name`` (:class:`~nemo_like.plan.backend.PolicyModel`),
    read from its config once on the driver; a model whose config is not to be read: the defaults."""
    try:
        config = model_config(model_name, local_only)
    except (OSError, ValueError, ConfigError):
        return PolicyModel()
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)  # none: no attention (Mamba2's head_dim is its state-space heads')
    sizes = (layer_values(text, "head_dim") or [None]) if heads else []
    head_dims = tuple(sorted({size or text.hidden_size // heads for size in sizes}))
    architecture = next(iter(getattr(config, "architectures", None) or []), None)
    return PolicyModel(routes_experts(model_name, local_only), architecture, head_dims, gated_delta_net(config), multimodal(config))


def model_context_length(model_name: str, local_only: bool = False) -> int | None:
    """The longest sequence the model's positions cover: ``max_position_embeddings`` (times a RoPE scaling factor,
    as vLLM derives ``max_model_len``), or ``None`` when its config states none. A LoRA checkpoint: its base model's."""
    config = model_config(model_name, local_only)
    positions = getattr(config, "max_position_embeddings", None)
    if not positions:
        return None
    scaling, kind = rope_parameters(config), rope_type(config)
    if kind in ("su", "longrope", "llama3") or "factor" not in scaling:  # these already state their extended length
        return int(positions)
    original = scaling.get("original_max_position_embeddings", positions) if kind == "yarn" else positions
    return int(original * scaling["factor"])


def check_context_length(model_name: str, length: int, key: str = "policy.max_total_sequence_length", local_only: bool = False) -> None:
    """A :class:`ConfigError` naming ``key`` when ``length`` tokens pass the model's positions (a RoPE model would
    extrapolate silently on our engines; vLLM refuses such a ``max_model_len``)."""
    limit = model_context_length(model_name, local_only)
    if limit is not None and length > limit:
        raise ConfigError(
            f"{key}={length} is longer than {model_name}'s context ({limit} positions: max_position_embeddings in its "
            f"config.json); lower {key} (prompt + response tokens) to at most {limit}"
        )


def check_trained_length(model_name: str, length: int, key: str = "policy.max_total_sequence_length", local_only: bool = False) -> None:
    """A :class:`ConfigError` naming ``key`` when a run would train on ``length`` tokens past the length up to which a
    position-dependent RoPE keeps its pretrained frequencies (:func:`~nemo_like.models.rope.fixed_frequency_length`).
    Training only: sampling alone (eval, a server) computes what the model computes."""
    config = model_config(model_name, local_only)
    fixed = fixed_frequency_length(config)
    if fixed is not None and length > fixed:
        # The sampler computes each token's logprob with the frequencies of its own forward (a KV cache, one position
        # at a time), the trainer with those of one forward over the batch's longest row: 0.4-2.3 nats apart on a tiny
        # Llama past the pretrained context, and a row's tokens depend on the other rows of its batch.
        raise ConfigError(
            f"{key}={length} passes {model_name}'s pretrained context ({fixed} positions) and its RoPE is "
            f"'{rope_type(config)}', whose frequencies past that length change with each forward's longest sequence: "
            f"the sampler's logprobs and the trainer's would differ. Lower {key} (prompt + response tokens) to at most "
            f"{fixed}"
        )


#: Config fields with which a model's forward post-processes its output head's logits (Gemma 2's soft-capping,
#: Granite's division, Cohere's scale, Falcon-H1's multiplier), with the value that leaves them as they are. A model
#: that does so under another name is caught at its first chunked forward (``chunked_logprobs``).
HEAD_POSTPROCESSING = {"final_logit_softcapping": None, "logits_scaling": 1.0, "logit_scale": 1.0, "lm_head_multiplier": 1.0}


def head_postprocessing(model_name: str, local_only: bool = False) -> list[str]:
    """``field=value`` of each :data:`HEAD_POSTPROCESSING` field the model's config sets to a value that changes the
    logits its forward returns (a LoRA checkpoint: its base model's)."""
    config = model_config(model_name, local_only).get_text_config()
    found = []
    for field, neutral in HEAD_POSTPROCESSING.items():
        value = getattr(config, field, neutral)
        if value is not None and value != neutral:
            found.append(f"{field}={value}")
    return found


def check_chunkable_head(model_name: str, chunk_size: int | None, key: str = "policy.model_name", local_only: bool = False) -> None:
    """A :class:`ConfigError` when ``policy.logprob_chunk_size`` is set for a model whose forward post-processes its
    head's logits: the chunked path computes the logprobs from the head's own product (it replaces the head), so they
    would be those of another distribution than the one the model samples from, and the model's post-processing would
    then be applied to them once more."""
    if chunk_size and (fields := head_postprocessing(model_name, local_only)):
        raise ConfigError(
            f"policy.logprob_chunk_size={chunk_size} cannot serve {key}={model_name!r}: its forward post-processes the "
            f"output head's logits ({', '.join(fields)} in its config.json), which the chunked path would leave out. "
            "Set policy.logprob_chunk_size=null"
        )


def model_vocab_size(model_name: str, local_only: bool = False) -> int | None:
    """The rows of the model's embedding and output head (``vocab_size`` in its config.json; a LoRA checkpoint: its
    base model's): every id below it can be sampled, the padding rows past the tokenizer's ids too (Qwen2.5: 151,936
    rows for 151,665 ids). ``None`` when the config states none."""
    return getattr(model_config(model_name, local_only).get_text_config(), "vocab_size", None)


def check_stop_token_ids(
    model_name: str, ids: Sequence[int] | None, key: str = "policy.generation.stop_token_ids", local_only: bool = False
) -> None:
    """A :class:`ConfigError` naming ``key`` when a stop id is outside the model's vocabulary: the inline and HF
    samplers would never draw it (the stop silently never fires), vLLM refuses the request at the first step."""
    if not ids:
        return
    vocab = model_vocab_size(model_name, local_only)
    outside = [i for i in ids if vocab is not None and not 0 <= i < vocab]
    if outside:
        raise ConfigError(f"{key}: {outside} are outside {model_name}'s vocabulary (ids 0..{vocab - 1}, vocab_size in its config.json)")


def end_of_sequence_ids(tokenizer: Any, model_name: str) -> list[int]:
    """The ids that end a response: the tokenizer's eos and the ``eos_token_id`` of the model's
    ``generation_config.json`` (an int or a list: Llama-3-Instruct lists ``<|eot_id|>``, Qwen2.5-Instruct
    ``<|endoftext|>`` beside ``<|im_end|>``), which transformers' ``generate`` and vLLM stop on too. Decided once per run
    and handed to every engine, the multi-turn plan and the rollout server."""
    ids = [*_as_ids(tokenizer.eos_token_id), *_as_ids(_generation_config(model_name).get("eos_token_id"))]
    return list(dict.fromkeys(ids))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _generation_config(model_name: str) -> dict[str, Any]:
    """``generation_config.json`` of a local model directory, a LoRA checkpoint's base model or a hub model (from the
    cache; fetched when not cached and the machine is online: the driver reads it before anything else downloads the
    model, so a first run had stopped on fewer ids than later ones); ``{}`` when there is none (many models ship none)."""
    path = Path(resolve_model_path(model_name)).expanduser()
    if (path / ADAPTER_CONFIG).is_file():
        return _generation_config(adapter_base_model(path))
    if path.is_dir():
        found: Any = path / "generation_config.json"
    elif looks_like_path(model_name):
        return {}
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_name, "generation_config.json", cache_dir=hub_cache_dir())
        if found is None and not hub_offline():  # None: never fetched (a file known absent is a sentinel)
            found = _fetch_generation_config(model_name)
    if not isinstance(found, (str, Path)) or not Path(found).is_file():
        return {}
    try:
        config = json.loads(Path(found).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{found}: cannot read the model's generation config ({exc})") from None
    return config if isinstance(config, dict) else {}


def _fetch_generation_config(model_name: str) -> str | None:
    """Download hub model ``model_name``'s ``generation_config.json`` into the cache; None when the model has none."""
    import huggingface_hub
    from huggingface_hub.errors import RemoteEntryNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT") or None  # the endpoint the start-up probe asked (huggingface_hub reads it once)
    try:
        return huggingface_hub.hf_hub_download(model_name, "generation_config.json", cache_dir=hub_cache_dir(), endpoint=endpoint)
    except RemoteEntryNotFoundError:  # the hub says the model has none (a failed connection is not that)
        return None
    except Exception as exc:  # the hub answered the start-up probe: a failure now is worth a clear stop
        raise ConfigError(
            f"policy.model_name={model_name!r}: cannot fetch its generation_config.json (its end-of-sequence ids) from the hub "
            f"({type(exc).__name__}: {exc}); retry, or download the model and point policy.model_name at the directory"
        ) from None


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copy of every parameter and buffer, tied weights included under each name.

    ``state_dict()`` keeps tied weights (``lm_head.weight``) under both names; ``save_pretrained``
    drops them, which leaves inference engines with a stale output head.
    """
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def token_id_count(tokenizer: Any) -> int:
    """The student's token-id range ``0..n-1``: every id its tokenizer can produce (added tokens included)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def eval_tokenizer(cfg: Any, model_dir: str) -> tuple[Any, str]:
    """``(tokenizer, source)`` ``nemo-like eval`` and ``serve`` tokenize with: ``policy.tokenizer_name`` when set, else
    the one the model's directory holds (a checkpoint's: the tokenizer of the run that wrote it, which the engine loads
    too; a shipped model's, named ``embedded:...``), else ``policy.model_name``'s. One that cannot be the model's
    (another vocabulary than its directory's, or ids past its vocabulary rows) is a :class:`ConfigError` naming the
    keys, before Ray starts: a checkpoint of another model than the recipe's failed in the sampler's actor with an
    IndexError."""
    directory = Path(resolve_model_path(model_dir)).expanduser()  # a shipped model's too (embedded:...)
    own = str(directory) if directory.is_dir() and holds_tokenizer(directory) else None
    # a tokenizer_name that names the recipe's model (the tiny recipe's ${policy.model_name}) means "the model's own"
    named = cfg.policy.tokenizer_name if cfg.policy.tokenizer_name not in (None, cfg.policy.model_name) else None
    key = "policy.tokenizer_name" if named else "policy.model_name"
    source = named or own or cfg.policy.model_name
    tokenizer = load_tokenizer(source)
    if own is not None and source != own and load_tokenizer(own).get_vocab() != tokenizer.get_vocab():
        raise ConfigError(
            f"{key}={source!r} has another tokenizer than the one {own} holds (a checkpoint's: the run's that wrote "
            "it): set policy.tokenizer_name=null to use the model's own"
        )
    rows = model_vocab_size(model_dir)
    if rows is not None and token_id_count(tokenizer) > rows:
        raise ConfigError(
            f"the tokenizer of {key}={source!r} has ids up to {token_id_count(tokenizer) - 1}, past the {rows} vocabulary "
            f"rows of {model_dir}: use the tokenizer of the run that trained it (its config.yaml's "
            "policy.model_name, or policy.tokenizer_name)"
        )
    return tokenizer, source
