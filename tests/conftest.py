"""Shared test setup: offline Hugging Face, loopback-only Ray, and one Ray cluster per session."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    """A private local Ray cluster (4 logical CPUs, small object store) shared by the tests that need one.

    4, not the machine's 2 cores (a reservation only: threads come from the cores, ``node_cpus``): the groups kept idle
    between runs (below) hold their bundles, and on 2 a run of another shape found no room, evicted every kept group
    and started all its actors afresh (~6 CPU-s each for a policy worker): 125 CPU-s more over the suite.

    Runs in the session reuse their actors (``reuse_actors``: a kept actor is re-initialised exactly as a
    new one), so each functional test pays for actor start-up only when it needs a new kind of actor.
    ``NEMO_LIKE_TEST_REUSE_ACTORS=0`` starts fresh actors for every run instead.
    """
    import contextlib

    import ray

    from nemo_like.config.schema import ClusterConfig
    from nemo_like.distributed.ray_init import init_ray
    from nemo_like.distributed.worker_group import reuse_actors

    init_ray(ClusterConfig(num_cpus=4, object_store_memory_mb=256))
    reuse = os.environ.get("NEMO_LIKE_TEST_REUSE_ACTORS", "1") != "0"
    with reuse_actors() if reuse else contextlib.nullcontext():
        yield ray
    ray.shutdown()


def pytest_runtest_setup(item):
    """Under pytest-xdist (``make test`` runs ``-n 2 --dist worksteal``), a worker lowers its own priority to nice 19
    (once) when it first runs a test without the session cluster: such tests (the unit tier, tests with their own
    clusters) then fill the CPU that cluster actors (nice 0, see ``nemo_like.distributed.ray_env``) leave idle
    instead of stalling their multi-threaded steps, on one torch thread (unit tests that build workers ask for one).

    Each xdist worker starts its own session cluster when it first needs one, and tests are handed to whichever
    worker is free, so which tests share a cluster and its kept actors changes from run to run: every test must
    pass after any other (a kept actor is re-initialised exactly as a new one).
    """
    if os.environ.get("PYTEST_XDIST_WORKER") and "ray_cluster" not in getattr(item, "fixturenames", ()) and os.nice(0) < 19:
        os.nice(19 - os.nice(0))
        # And one torch thread: a 2-thread OpenMP op at nice 19 waits at every barrier for the thread that lost its core
        # to the other worker's actors (a 0.8 s unit test took 34 s so in a suite run); one thread just runs slower.
        from nemo_like.distributed.threads import apply_thread_count

        apply_thread_count(1)  # OMP_NUM_THREADS too, for the processes the tests spawn (gloo ranks)


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    """No offline switch set, a hub endpoint nothing listens on (a connection is refused at once) and an empty
    ``HF_HOME``; ``huggingface_hub``'s offline flag (read once at import) cleared and restored after the test. Returns
    the endpoint."""
    import socket

    import huggingface_hub.constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def cached_hub_model(monkeypatch, tmp_path):
    """An offline ``HF_HOME`` whose hub cache holds the shipped tiny causal LM as hub id ``acme/tiny-chat`` (a model a
    node holds in its cache). Returns the snapshot directory."""
    import shutil

    from nemo_like.models.assets import embedded_model_path

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(embedded_model_path("embedded:tiny-arith-qwen2"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return snapshot
