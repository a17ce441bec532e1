"""The memory planner's per-rank estimate against measured training steps on this CPU, at dp 1 and dp 2 (FSDP2).

Usage: python benchmarks/plan_memory.py [--only dp1|dp2] [--match 63M]

For each configuration (model size, micro-batch, activation checkpointing, dp) fresh processes load a PolicyWorker
(fp32, random-init Qwen2 built locally: no download); at dp 2 two ranks join a gloo group and shard the model with
FSDP2 (one thread each; dp 1: two threads), each rank training on its own micro-batch of the configured rows. Each
rank runs one warm-up step of one 16-token row (so gradients and AdamW state exist and the allocator caches nothing of
the measured size), then samples its memory every millisecond during one training step of the configured micro-batch.
Two measures of memory:

* **RSS**, the resident set the kernel counts (what a CPU node runs out of). It includes memory glibc keeps after a
  ``free`` (its heap is returned only from the top) and misses the allocations that land in such kept memory;
* **live bytes**: what glibc's allocator has handed out and not taken back (``mallinfo2``: in-use heap chunks plus
  ``mmap``-ed blocks; every torch CPU tensor allocated at run time is one of these) plus the resident pages of the
  mapped safetensors file (a one-rank worker's parameters stay a copy-on-write mapping of it). What the planner
  models.

Two comparisons per rank:

* **step increase**: the peak above the level just before the measured step, against the planner's activations plus
  FSDP2's unsharded root at dp 2 (the planner predicts that step's peak above the loaded model and AdamW state as
  ``max(activations + gradients, gradients)`` plus the unsharded root; gradients stay allocated from the warm-up step,
  so the measured peak is the activations' on top of them);
* **per rank**: the step's peak above the process's level before the model was loaded (torch, transformers and our
  modules imported), against the planner's whole per-rank figure (parameters + gradients + AdamW state + activations
  + the unsharded root).

Parameters, gradients and AdamW state per rank are exact (tests/unit/plan/test_memory_plan.py); the script checks them
against :meth:`PolicyWorker.memory_footprint` on every rank too (``exact p/g/o``). The last column is the freed heap
glibc keeps before the measured step (``mallinfo2().fordblks``): in the RSS, not in live bytes. glibc's dynamic mmap
threshold is what keeps it; ``MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/plan_memory.py`` fixes the threshold
(every block of 128 KiB or more is its own mapping, returned on free), and the RSS then follows the live bytes.
docs/guides/planning.md has the table of one run.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

M20 = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=32000)  # 20.2M parameters
M63: dict = {}  # benchmarks/memory.py's default: hidden 512, 8 layers, vocabulary 32k untied, 63.2M parameters
CONFIGS = [  # name, model overrides, micro-batch rows (per rank), sequence length, activation checkpointing, dp, chunk
    ("20M rows4 s256", M20, 4, 256, False, 1, 0),
    ("20M rows8 s256", M20, 8, 256, False, 1, 0),
    ("20M rows8 s256 ckpt", M20, 8, 256, True, 1, 0),
    ("20M rows8 s256 c256", M20, 8, 256, False, 1, 256),  # policy.logprob_chunk_size=256
    ("20M r8 s256 ckpt c256", M20, 8, 256, True, 1, 256),
    ("63M rows4 s256", M63, 4, 256, False, 1, 0),
    ("63M rows4 s512", M63, 4, 512, False, 1, 0),
    ("63M rows4 s512 ckpt", M63, 4, 512, True, 1, 0),
    ("20M rows4 s256", M20, 4, 256, False, 2, 0),
    ("20M rows8 s256", M20, 8, 256, False, 2, 0),
    ("20M rows8 s256 ckpt", M20, 8, 256, True, 2, 0),
    ("63M rows4 s256", M63, 4, 256, False, 2, 0),
    ("63M rows4 s512", M63, 4, 512, False, 2, 0),
    ("63M rows4 s512 ckpt", M63, 4, 512, True, 2, 0),
]


PAGE = os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def memory_now() -> tuple[int, int]:
    """``(RSS, bytes glibc's allocator has handed out and not taken back)`` of this process (``mallinfo2``: in-use heap
    chunks plus ``mmap``-ed blocks; glibc 2.33+)."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * PAGE
    info = _mallinfo2()()
    return resident, info.uordblks + info.hblkhd


def heap_free_kept() -> int:
    """Bytes glibc holds in free heap chunks (``mallinfo2().fordblks``): resident where they were touched, counted in
    the RSS, not in live bytes; what ``malloc_trim`` could give back at most."""
    return _mallinfo2()().fordblks


def mapped_weights() -> int:
    """Resident bytes of the safetensors files mapped into this process: a one-rank worker's parameters stay a
    copy-on-write mapping of the model file (no allocation of their own), so live bytes count them from here."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if not line[0].isupper():  # a mapping's header line: address range, permissions, ..., path
                inside = line.rstrip().endswith(".safetensors")
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


@functools.cache
def _mallinfo2():
    function = ctypes.CDLL("libc.so.6").mallinfo2
    function.restype = _MallInfo2
    return function


def measure(model_dir: str, rows: int, seq: int, checkpointing: bool, chunk: int, out: str, rank: int, world: int, port: int) -> None:
    """One rank: warm-up step, then the measured step's peak RSS above the level before it and above the level before
    the model was loaded."""
    import torch
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401 - imported before the pre-load level is read
    from memory import train_batch

    from nemo_like.algorithms.loss_functions import ClippedPGLossFn
    from nemo_like.config.loss import ClippedPGLossConfig
    from nemo_like.config.schema import OptimizerConfig
    from nemo_like.models.policy.worker import PolicyWorker

    threads = max(1, 2 // world)
    torch.set_num_threads(threads)
    before_load = memory_now()
    worker = PolicyWorker(
        rank=rank,
        world_size=world,
        model_name=model_dir,
        precision="float32",
        temperature=1.0,
        num_threads=threads,
        seed=0,
        loss_fn=ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)),
        optimizer=OptimizerConfig(),
        max_grad_norm=1.0,
        train_micro_batch_size=rows,
        shared_prompt_forward=False,  # sharded ranks run the model's own forward; so does the one-rank baseline
        dtensor_cfg={"activation_checkpointing": checkpointing},
        logprob_chunk_size=chunk or None,
    )
    if world > 1:
        worker.setup_distributed("127.0.0.1", port)
    worker.train([train_batch(rows=1, seq=16)])  # gradients and AdamW state allocated, nothing of the measured size cached
    baseline, kept, peak, running = memory_now(), heap_free_kept(), [0, 0], [True]

    def sample() -> None:
        while running[0]:
            now = memory_now()
            peak[0], peak[1] = max(peak[0], now[0]), max(peak[1], now[1])
            time.sleep(0.001)

    thread = threading.Thread(target=sample)
    thread.start()
    worker.train([train_batch(rows=rows, seq=seq)])
    running[0] = False
    thread.join()
    weights = mapped_weights()  # every page of the mapped weights was touched by the warm-up step already
    result = {
        "increase_rss": max(0, peak[0] - baseline[0]),
        "increase_live": max(0, peak[1] - baseline[1]),
        "rank_rss": peak[0] - before_load[0],
        "rank_live": peak[1] + weights - before_load[1],
        "kept_before_step": kept,
        "footprint": worker.memory_footprint(),
    }
    Path(out).write_text(json.dumps(result))


def planned(model_dir: str, rows: int, seq: int, checkpointing: bool, chunk: int, world: int):
    """The planner's :class:`~nemo_like.plan.memory.RoleMemory` of one policy rank for this configuration."""
    from nemo_like.config import DEFAULT_RECIPE, load_config
    from nemo_like.models.footprint import model_footprint
    from nemo_like.plan.memory import policy_memory

    overrides = [
        f"policy.model_name={model_dir}",
        f"policy.dp_size={world}",
        f"policy.train_micro_batch_size={rows}",
        f"policy.train_global_batch_size={rows * world}",
        f"policy.max_total_sequence_length={seq}",
        "policy.generation.max_new_tokens=16",
        f"policy.dtensor_cfg.activation_checkpointing={str(checkpointing).lower()}",
        "policy.logprob_batch_size=1",
        f"policy.logprob_chunk_size={chunk or 'null'}",
    ]
    cfg = load_config(DEFAULT_RECIPE, overrides, warn=False)
    params, shape = model_footprint(model_dir, "float32")
    return policy_memory(cfg, params, shape)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(model_dir: str, rows: int, seq: int, checkpointing: bool, chunk: int, world: int, tmp: Path) -> list[dict]:
    """The configuration's ranks, each in a fresh process; returns every rank's measurements."""
    port = free_port()
    outs = [tmp / f"rank{r}.json" for r in range(world)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--run",
                model_dir,
                str(rows),
                str(seq),
                str(int(checkpointing)),
                str(chunk),
                str(out),
                str(r),
                str(world),
                str(port),
            ],
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        for r, out in enumerate(outs)
    ]
    if any([p.wait() for p in procs]):
        raise SystemExit(f"a rank failed: {model_dir} rows {rows} seq {seq} dp {world}")
    return [json.loads(out.read_text()) for out in outs]


def main() -> None:
    from memory import build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["dp1", "dp2"], help="only the dp 1 or the dp 2 rows")
    parser.add_argument("--match", default="", help="only the configurations whose name contains this, e.g. 63M")
    opts = parser.parse_args()
    mib = 2**20
    print("MiB per rank (dp 2: rank 0 / rank 1); ratio: measured / planned, the rank furthest from 1")
    head = f"{'config':<21}{'dp':>3}{'planned':>9}{'RSS':>13}{'ratio':>7}{'live':>13}{'ratio':>7}"
    print(f"{'':<24}{'step increase (activations)':^49}{'per rank':^49}")
    print(head + head[24:] + "  exact p/g/o  free kept by glibc before the step")
    with tempfile.TemporaryDirectory() as tmp:
        built: dict[str, str] = {}
        for name, overrides, rows, seq, ckpt, world, chunk in CONFIGS:
            if (opts.only and opts.only != f"dp{world}") or opts.match not in name:
                continue
            key = json.dumps(overrides, sort_keys=True)
            if key not in built:
                built[key] = str(Path(tmp) / f"model{len(built)}")
                build_model(Path(built[key]), **overrides)
            ranks = run_ranks(built[key], rows, seq, ckpt, chunk, world, Path(tmp))
            plan = planned(built[key], rows, seq, ckpt, chunk, world)
            exact = all(
                (r["footprint"]["params"], r["footprint"]["grads"], r["footprint"]["optimizer"])
                == (plan.params, plan.grads, plan.optimizer)
                for r in ranks
            )
            cells = []
            for key_, expected in (
                ("increase_rss", plan.activations + plan.unsharded_root),
                ("increase_live", plan.activations + plan.unsharded_root),
                ("rank_rss", plan.total),
                ("rank_live", plan.total),
            ):
                values = [r[key_] for r in ranks]
                worst = max(values, key=lambda v: abs(v / expected - 1)) / expected
                cells.append((expected, " / ".join(f"{v / mib:.0f}" for v in values), worst))
            row = f"{name:<21}{world:>3}"
            for i, (expected, shown, worst) in enumerate(cells):
                row += (f"{expected / mib:>9.0f}" if i % 2 == 0 else "") + f"{shown:>13}{worst:>7.2f}"
            kept = " / ".join(f"{r['kept_before_step'] / mib:.0f}" for r in ranks)
            print(f"{row}  {'yes' if exact else 'NO':>11}  {kept}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        a = sys.argv[2:]
        measure(a[0], int(a[1]), int(a[2]), bool(int(a[3])), int(a[4]), a[5], int(a[6]), int(a[7]), int(a[8]))
    else:
        main()
