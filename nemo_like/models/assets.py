"""Paths of the assets shipped inside the package (the tiny default model)."""

from __future__ import annotations

from pathlib import Path

#: Directory name of the shipped tiny model under ``nemo_like/assets/``.
TINY_MODEL_DIRNAME = "tiny-arith-qwen2"
#: Command that rebuilds the shipped model (run from the repository root).
REBUILD_COMMAND = "python scripts/build_tiny_model.py"


def default_model_path() -> str:
    """Absolute path of the shipped tiny arithmetic model (``nemo_like/assets/tiny-arith-qwen2``).

    Raises:
        FileNotFoundError: if the directory (or its ``config.json``) is missing; the message names
            the path and the command that rebuilds it.
    """
    path = Path(__file__).resolve().parents[1] / "assets" / TINY_MODEL_DIRNAME
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"The default tiny model is missing at {path}. Rebuild it (a few minutes on CPU, no "
            f"network) with: {REBUILD_COMMAND} --out {path}"
        )
    return str(path)


#: Prefix of model names that refer to a model shipped under ``nemo_like/assets/`` (``embedded:<dir name>``).
EMBEDDED_PREFIX = "embedded:"
#: Shipped models other than the default, and the command that rebuilds each.
OTHER_MODELS = {
    "tiny-tool-qwen2": "python scripts/build_tiny_tool_model.py",
    "tiny-reward-qwen2": "python scripts/build_tiny_reward_model.py",  # a sequence-classification model (reward_model env)
    "tiny-arith-teacher": "python scripts/build_tiny_teacher.py",  # the tiny model after the default recipe's 100 steps
}


def embedded_model_path(name: str) -> str:
    """Absolute path of the shipped model ``embedded:<dir name>`` (the default one, or one of :data:`OTHER_MODELS`).

    Raises:
        ValueError: an unknown name (the message lists the shipped ones).
        FileNotFoundError: the directory is missing (the message names the rebuild command)."""
    dirname = name.removeprefix(EMBEDDED_PREFIX)
    if dirname == TINY_MODEL_DIRNAME:
        return default_model_path()
    if dirname not in OTHER_MODELS:
        shipped = ", ".join(EMBEDDED_PREFIX + n for n in (TINY_MODEL_DIRNAME, *OTHER_MODELS))
        raise ValueError(f"{name!r} is not a shipped model; shipped: {shipped}")
    path = Path(__file__).resolve().parents[1] / "assets" / dirname
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"The shipped model {name} is missing at {path}. Rebuild it with: {OTHER_MODELS[dirname]} --out {path}")
    return str(path)
