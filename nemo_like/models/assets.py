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
