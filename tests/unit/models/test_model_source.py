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
    fill_cache(tmp_path, "org/cached-model")
    check_model_source("org/cached-model", "policy.model_name")
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # forwarded to the actors: no network retries there
