"""The shared-memory refit buffer: what a receiver maps is bit for bit what the policy wrote, version after version."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from nemo_like.models.refit import shared_memory
from nemo_like.models.refit.shared_memory import ALIGN, SharedWeightWriter, layout

pytestmark = pytest.mark.skipif(not shared_memory.shared_memory_available(), reason="no writable /dev/shm")


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(7, 5, generator=g)),
        ("norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),  # 10 bytes: the next tensor must still be aligned
        ("steps", torch.randint(0, 1 << 40, (3,), generator=g)),
        ("empty", torch.zeros(0)),
        ("lm_head.weight", torch.randn(7, 5, generator=g)),
    ]


def receive(descriptor) -> dict[str, torch.Tensor]:
    """What a generation worker loads: the descriptor travels pickled, the tensors are copied out of the mapping."""
    shared_memory._mapped.clear()  # a receiver process maps the file itself
    return {name: t.clone() for name, t in pickle.loads(pickle.dumps(descriptor)).iter_tensors()}


def test_layout_aligns_every_tensor():
    entries = layout(tensors(0))
    assert [e.offset % ALIGN for e in entries] == [0] * len(entries)
    assert [e.nbytes for e in entries] == [140, 10, 24, 0, 140]
    # After the 64-byte header (the version), each tensor starts at the previous end rounded up to 64 bytes; an
    # empty tensor takes no room.
    assert [e.offset for e in entries] == [64, 256, 320, 384, 384]


def test_a_tied_weight_is_written_and_counted_once():
    """The embedding and the LM head (one tensor under two names) took two places in the buffer and in refit_bytes (the
    writer given one tensor object twice; test_precision.py checks that the worker's own export hands it so)."""
    shared = torch.arange(35, dtype=torch.float32).reshape(7, 5)
    other = torch.ones(3)
    entries = layout([("embed", shared), ("x", other), ("head", shared)])
    assert [e.offset for e in entries] == [64, 256, 64]
    writer = SharedWeightWriter()
    try:
        descriptor = writer.write(1, [("embed", shared), ("x", other), ("head", shared)])
        assert descriptor.nbytes == 140 + 12 and descriptor.size == 256 + 12
        received = receive(descriptor)
        assert torch.equal(received["head"], shared) and torch.equal(received["embed"], shared) and torch.equal(received["x"], other)
    finally:
        writer.close()


def test_receiver_gets_exact_values_dtypes_and_shapes_across_versions():
    writer = SharedWeightWriter()
    try:
        first = writer.write(1, tensors(0))
        assert os.path.exists(first.path) and first.all_names() == [n for n, _ in tensors(0)]
        got = receive(first)
        for name, t in tensors(0):
            assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
        mapped_before = {n: t for n, t in first.iter_tensors()}  # a live mapping, as a worker keeps it
        second = writer.write(2, tensors(1))
        assert second.path == first.path and second.version == 2
        for name, t in tensors(1):  # the old mapping sees the new weights: same buffer, written in place
            assert torch.equal(mapped_before[name], t), name
        fresh = writer.write(3, tensors(2), fresh=True)
        assert fresh.path != first.path and os.path.exists(fresh.path)
        assert not os.path.exists(first.path)  # a replaced buffer's file is removed
        got = receive(fresh)
        assert all(torch.equal(got[name], t) for name, t in tensors(2))
    finally:
        writer.close()
    assert not os.path.exists(fresh.path)


def test_an_engine_started_after_several_refits_maps_the_served_version_and_never_another():
    """A replacement engine (a new process) maps the buffer mid-run: it holds the last refit's weights, and a
    descriptor of any other version is refused (the header's stamp), whatever the policy trained since."""
    writer = SharedWeightWriter()
    try:
        writer.write(1, tensors(0))
        writer.write(2, tensors(1))
        served = writer.write(3, tensors(2))
        assert os.path.exists(served.path)  # still linked after the third write in place
        got = receive(served)
        assert all(torch.equal(got[name], t) for name, t in tensors(2))
        older = shared_memory.SharedWeights(2, served.names, [], path=served.path, size=served.size, entries=served.entries)
        with pytest.raises(shared_memory.StaleRefitBuffer, match="holds weight version 3, but this refit is version 2"):
            receive(older)
    finally:
        writer.close()


def test_a_changed_layout_gets_a_new_buffer_and_a_gone_file_names_itself():
    writer = SharedWeightWriter()
    try:
        first = writer.write(1, tensors(0))
        bigger = [*tensors(0), ("extra", torch.ones(4))]
        second = writer.write(2, bigger)  # a new layout: a new file; the first one's is removed
        assert second.path != first.path
        shared_memory._mapped.clear()
        with pytest.raises(FileNotFoundError, match="nemo_like_refit_"):
            next(first.iter_tensors())
        assert torch.equal(receive(second)["extra"], torch.ones(4))
    finally:
        writer.close()


def test_a_dead_writers_buffer_is_removed_by_the_next_writer_but_not_one_of_another_pid_namespace():
    """A pid alone names another process, or none, in a container with a PID namespace of its own sharing /dev/shm
    (docker --ipc=host): another run's live buffer was swept as an orphan. Names carry the namespace now."""
    import subprocess
    import sys

    from nemo_like.utils.orphans import pid_namespace

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True).stdout)
    orphans = [shared_memory.SHM_DIR / f"nemo_like_refit_{dead}{tag}_0" for tag in (f"p{pid_namespace()}", "")]  # "": older
    elsewhere = shared_memory.SHM_DIR / f"nemo_like_refit_{dead}p{pid_namespace() + 1}_0"  # that pid may run there
    # Another user's orphan: /dev/shm's sticky bit refuses its removal, and the PermissionError stopped every later run
    # at its first refit (as root, which may remove it, it is left alone all the same: not ours)
    others = shared_memory.SHM_DIR / f"nemo_like_refit_{dead}p{pid_namespace()}_1"
    for path in (*orphans, elsewhere, others):
        path.write_bytes(b"x")
    if os.geteuid() == 0:
        os.chown(others, 65534, 65534)
    writer = SharedWeightWriter()
    try:
        live = writer.write(1, tensors(0))  # creating a buffer sweeps the orphans
        assert not any(p.exists() for p in orphans) and os.path.exists(live.path)  # its own (live pid) stays
        assert elsewhere.exists() and f"_{os.getpid()}p{pid_namespace()}_" in live.path
        assert others.exists() == (os.geteuid() == 0)
    finally:
        writer.close()
        for path in (*orphans, elsewhere, others):
            path.unlink(missing_ok=True)


def test_an_orphan_that_cannot_be_removed_is_skipped_not_raised(tmp_path):
    """A removal refused (EPERM) inside the sweep's ProcessLookupError handler escaped it: the run that swept died."""
    import subprocess
    import sys

    from nemo_like.utils.orphans import pid_namespace, remove_orphans

    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True).stdout)
    refused, removable = (tmp_path / f"x_{dead}p{pid_namespace()}_{i}" for i in (0, 1))
    for path in (refused, removable):
        path.write_bytes(b"x")

    def unlink_unless_refused(path):
        if path == refused:
            raise PermissionError(1, "Operation not permitted", str(path))
        path.unlink()

    assert remove_orphans([refused, removable], "x_", unlink_unless_refused) == [str(removable)]
    assert refused.exists() and not removable.exists()


FULL_SHM_CHILD = r"""
import glob, os, resource, signal, sys
sys.path.insert(0, "tests")
from unit.models.test_policy_worker import make_worker
from nemo_like.models.refit import shared_memory

worker = make_worker(4)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file may pass 1 MiB: the 4 MiB model cannot fit
refused = worker.export_shared_weights(fresh=True)
print(type(refused).__name__, refused.reason)
print("left behind:", glob.glob(str(shared_memory.SHM_DIR / f"nemo_like_refit_{os.getpid()}p*_*")))
"""


def test_a_refit_buffer_that_does_not_fit_is_refused_before_any_write(tmp_path):
    """A tmpfs file is sparse: a ``/dev/shm`` smaller than the weights (Docker's default is 64 MB) let the buffer be
    created, then killed the policy worker with SIGBUS at the first page written. The space is now reserved up front
    and the rank answers SharedMemoryRefused (the policy then refits through the object store); no file is left."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", FULL_SHM_CHILD], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = done.stdout.strip().splitlines()[-2:]
    assert first.startswith("SharedMemoryRefused /dev/shm cannot hold the 3.9 MiB refit buffer"), (
        first
    )  # the tied embedding once (4.1 when it was twice)
    assert "enlarge it (Docker: --shm-size)" in first and second == "left behind: []"


def test_a_read_that_overlaps_a_newer_write_is_refused_not_served():
    """A replacement engine can load the served version while an async run's policy writes the next one into the same
    buffer. The header was stamped only after the tensors, so a read during the write passed its version check and
    copied a mix of two versions; the header now says a write is in progress first, and receivers check it again
    after their copy (``check_intact``)."""
    writer = SharedWeightWriter()
    try:
        served = writer.write(1, tensors(0))
        views = dict(served.iter_tensors())  # a receiver has taken its views and is copying...
        served.check_intact()  # ...nothing changed yet
        writer.buffer[:8].view(torch.int64)[0] = shared_memory.WRITING  # the writer's first act, as in write()
        with pytest.raises(shared_memory.StaleRefitBuffer, match="rewritten \\(it holds a write in progress\\)"):
            served.check_intact()
        with pytest.raises(shared_memory.StaleRefitBuffer):
            dict(served.iter_tensors())  # a read that starts now is refused at once
        writer.write(2, tensors(1))
        assert not torch.equal(views["embed.weight"], tensors(0)[0][1])  # the views did change under the reader
        with pytest.raises(shared_memory.StaleRefitBuffer, match="holds version 2"):
            served.check_intact()
    finally:
        writer.close()


def test_a_replacement_whose_shared_buffer_was_rewritten_is_a_worker_failure_naming_why(ray_cluster):
    """A replacement engine loads the served version from the policy's buffer; when the policy has written its next
    refit into it meanwhile, the engine's copy is refused (StaleRefitBuffer), and no export gives the served version
    back (the policy has moved past it). That error ended the run outside the supervision's terms; it is now the
    WorkerFailure a replacement that cannot serve the group's version is."""
    import ray

    from nemo_like.distributed.worker_group import WorkerFailure
    from nemo_like.models.generation.hf_worker import HFGenerationWorker
    from nemo_like.models.generation.interface import load_served_weights
    from nemo_like.models.loading import load_causal_lm, load_tokenizer

    model_name = "embedded:tiny-arith-qwen2"
    tok = load_tokenizer(model_name)
    state = load_causal_lm(model_name, "float32").state_dict()
    writer = SharedWeightWriter()
    worker = ray.remote(HFGenerationWorker).remote(0, 1, model_name, "float32", 1, tok.pad_token_id, [tok.eos_token_id])
    try:
        descriptor = writer.write(1, [(name, value + 0.01) for name, value in state.items()])  # version 1, served
        writer.write(2, [(name, value + 0.02) for name, value in state.items()])  # the policy's next refit, same buffer
        with pytest.raises(WorkerFailure, match="could not load the served weight version 1: the policy wrote its next refit"):
            load_served_weights(worker, lambda **_: (2, state), descriptor, 1)
    finally:
        ray.kill(worker)
        writer.close()


def test_a_kept_engine_drops_its_mapping_of_the_last_runs_refit_buffer():
    """A generation engine kept for the next run (reuse_actors: its reinit runs its __init__) held its mapping of the
    last run's buffer: after the policy unlinked it, a whole model's worth of /dev/shm stayed used, invisible to ls."""
    from nemo_like.models.generation.hf_worker import HFGenerationWorker
    from nemo_like.models.loading import load_tokenizer

    big = [("w", torch.zeros(4 * 2**20 // 4))]  # 4 MiB
    writer = SharedWeightWriter()
    served = writer.write(1, big)
    assert set(dict(served.iter_tensors())) == {"w"}  # this process maps it, as an engine does
    writer.close()

    def used() -> int:
        stats = os.statvfs(shared_memory.SHM_DIR)
        return (stats.f_blocks - stats.f_bfree) * stats.f_frsize

    held = used()
    tok = load_tokenizer("embedded:tiny-arith-qwen2")
    HFGenerationWorker(0, 1, "embedded:tiny-arith-qwen2", "float32", 1, tok.pad_token_id, [tok.eos_token_id])
    assert held - used() >= 3 * 2**20 and not shared_memory._mapped
