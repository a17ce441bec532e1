"""GRPO step time and its phases as the work grows: completions per prompt, completion length, model size.

Usage (from the repository root, with .venv's python):

    python benchmarks/scaling.py                     # 5 / 5 / 4 points, two rounds: ~8 min on a quiet 2-core machine
    python benchmarks/scaling.py --quick             # 3 points per knob, one round, fewer steps: ~3 min
    python benchmarks/scaling.py --plot docs/guides/images/scaling.png --json scaling.json
    python benchmarks/scaling.py --replot a.json b.json --plot scaling.png   # pool saved runs and redraw, no training

Every point is a real training run through the same ``train()`` that ``nemo-like train`` calls, of the shipped tiny
recipe (the embedded default, ``examples/configs/grpo_tiny_cpu.yaml``) with its default flags except the one knob
varied (and no validation, a 512-problem training set and quiet logging, none of which a step's cost depends on):

* **completions per prompt** (``grpo.num_generations_per_prompt``): 2, 4, 8 (the recipe's), 16, 32;
* **completion length** (``policy.generation.max_new_tokens``): 8 (the recipe's), 32, 64, 128, 256, with
  ``policy.max_total_sequence_length`` = 56 + that, so prompts keep the recipe's 56-token budget;
* **model size**: Qwen2 decoders of 4 layers like the shipped tiny model (hidden 128, 1.0M parameters), widened to
  hidden 256 (4.0M), 512 (15.4M) and 1024 (60.2M), intermediate 4 x hidden, heads of 64 dimensions (the tiny
  model's 4 heads of 32 at hidden 128), 2 KV heads; 4 layers throughout, so every size runs the same number of
  kernels and only their width grows.

The models are random-init Qwen2 configs built locally (no download) with the shipped tiny model's tokenizer and
vocabulary (359 tokens), and the end-of-sequence token is never sampled (the trick of ``benchmarks/vs_trl.py``: every
input embedding carries ``+4`` in dimension 0, the stop token's ``-4``, so under the tied head its logit sits tens of
nats below every other): every completion is exactly ``max_new_tokens`` long (the script checks
``train/truncated_fraction`` = 1). The rewards are ~0 (a random model), which changes nothing a step computes.

Each run trains ``--warmup`` + ``--steps`` + 1 steps; the first ``--warmup`` and the last are left out.
``--rounds`` repeats every point (each round in the opposite order to the one before, the shared base point once per
round), so a slow stretch of the machine falls on several points instead of one.

**A shared machine.** Our actors slow down far more than their share when anything else runs (a step can take 10-30x
its quiet time while another process keeps one core busy), so the script measures, per step, how much of the machine's
CPU other processes used while it ran (:class:`ForeignCpu`: ``/proc/stat`` against the CPU time of this process and
its descendants, the run's Ray daemons and actors). A step counts ("kept") when that share is at most
``--max-foreign`` (0.10; an idle machine shows 0.00-0.02); a run with fewer than half its measured steps kept is run
again, up to ``--retries`` (2) more times. A point whose steps were all contended falls back to all of them, and the
``kept`` column says so (``0/8``).

The phases are the run's own ``timing/train/*`` metrics (``metrics.jsonl``): generation; logprobs = the prev/reference
passes (they run concurrently; the loop times each as the driver's wait after the previous one, so the phase is
their sum: the time the driver waited for them); training
(``policy_training``); refit (0 with the CPU default, inline generation); scoring (``reward``: the wait for the
environments not hidden behind the logprob passes); other = the step minus those (advantages, collation, the driver's
bookkeeping). Per point: medians over the kept steps of every run. Per knob: the exponent ``b`` of ``time ~ x^b`` from
a least-squares line through ``(log x, log median)`` of all points (``b (all)``), and the slope between the last two
points (``b (top2)``, where fixed per-step costs weigh least). ``GFLOP`` is the run's own count of the step's model
FLOPs (``performance/model_flops``: 6N per trained token, 2N per scored or generated token; no attention ``seq x seq``
term), whose exponent is what a step would show if it were all matmul work.

The 1-minute load average before each run is printed beside it: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vs_trl import load1, save_random_qwen2, tiny_model_config

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

PROMPT_BUDGET = 56  # the tiny recipe's: max_total_sequence_length 64 - max_new_tokens 8
LAYERS = 4
BASE = {"generations": 8, "length": 8, "hidden": 128}  # the shipped tiny recipe's completions and length, its model's width
KNOBS = {
    "generations": ("completions per prompt", "grpo.num_generations_per_prompt"),
    "length": ("completion length (tokens)", "policy.generation.max_new_tokens"),
    "hidden": ("model parameters", "hidden size at 4 layers"),
}
POINTS = {"generations": [2, 4, 8, 16, 32], "length": [8, 32, 64, 128, 256], "hidden": [128, 256, 512, 1024]}
QUICK_POINTS = {"generations": [2, 8, 32], "length": [8, 64, 256], "hidden": [128, 512, 1024]}
PHASES = ("generation", "logprobs", "training", "refit", "scoring", "other")
LOGPROB_PASSES = ("prev_logprobs", "reference_logprobs", "teacher_logprobs")


# ---------------------------------------------------------------------------------------------------
# Models and runs
# ---------------------------------------------------------------------------------------------------
def build_model(directory: Path, hidden: int) -> tuple[str, int]:
    """A random-init Qwen2 of width ``hidden`` (4 layers) with the shipped tiny model's tokenizer, whose stop token is
    never sampled (see the module docstring); returns its directory and parameter count."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    heads = max(tiny_model_config().num_attention_heads, hidden // 64)  # hidden 128: the tiny model's 4 heads of 32
    return save_random_qwen2(
        directory,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )


def overrides_for(point: dict, model_dir: str) -> list[str]:
    """The recipe overrides of one point (the recipe's defaults except the knobs in ``point``)."""
    return [
        f"policy.model_name={model_dir}",
        f"grpo.num_generations_per_prompt={point['generations']}",
        f"policy.generation.max_new_tokens={point['length']}",
        f"policy.max_total_sequence_length={PROMPT_BUDGET + point['length']}",
        "data.train.num_problems=512",
    ]


@contextlib.contextmanager
def output_to(path: Path):
    """This process's stdout and stderr (file descriptors, so the actors' lines Ray forwards too) into ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


class ForeignCpu:
    """How much of the machine's CPU other processes used during each step of a run (Linux ``/proc``).

    A thread samples every ``interval`` seconds the machine's busy CPU time (``/proc/stat``) and the CPU time of this
    process and its descendants (the Ray daemons and actors a run starts are; each live one's own time plus what its
    exited children left it, ``cutime``/``cstime``), and notes when each line of the run's ``metrics.jsonl`` appears
    (one is written as each step ends; the file is checked every 20 ms). :meth:`shares` gives, per step, the other
    processes' CPU seconds over the step's wall seconds x cores: 0 on an otherwise idle machine, 0.5 when something else
    kept one of two cores busy throughout."""

    def __init__(self, metrics: Path, interval: float = 0.1) -> None:
        import threading

        self.metrics, self.interval = metrics, interval
        self.samples: list[tuple[float, float, float]] = []  # (time, machine busy s, our tree's s)
        self.ends: list[float] = []  # when each metrics line appeared
        self.cores, self.tick = os.cpu_count() or 1, os.sysconf("SC_CLK_TCK")
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _busy(self) -> float:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / self.tick  # user nice system irq softirq steal

    def _tree(self) -> float:
        parents, cpu = {}, {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            parents[int(name)] = int(fields[1])
            cpu[int(name)] = sum(int(x) for x in fields[11:15]) / self.tick  # utime stime cutime cstime
        root, tree = os.getpid(), {os.getpid()}
        for pid in cpu:
            p, chain = pid, []
            while p and p not in tree:
                chain.append(p)
                p = parents.get(p, 0)
            if p in tree:
                tree.update(chain)
        return sum(cpu.get(pid, 0.0) for pid in tree | {root})

    def _loop(self) -> None:
        size, next_sample = -1, 0.0
        while self.running:
            now = time.perf_counter()
            if now >= next_sample:
                self.samples.append((now, self._busy(), self._tree()))
                next_sample = now + self.interval
            try:
                if self.metrics.stat().st_size != size:
                    data = self.metrics.read_bytes()
                    size = len(data)
                    self.ends += [now] * (data.count(b"\n") - len(self.ends))
            except OSError:
                pass
            time.sleep(0.02)

    def stop(self) -> None:
        self.running = False
        self.thread.join()

    def _at(self, t: float) -> tuple[float, float]:
        """(machine busy, ours) at ``t``, linearly interpolated between samples."""
        for (t0, b0, o0), (t1, b1, o1) in zip(self.samples, self.samples[1:]):
            if t0 <= t <= t1:
                w = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
                return b0 + w * (b1 - b0), o0 + w * (o1 - o0)
        _, b, o = self.samples[-1] if t > self.samples[-1][0] else self.samples[0]
        return b, o

    def shares(self, step_seconds: list[float]) -> list[float | None]:
        """Per step (``step_seconds``: each step's ``total_step_time``), the other processes' share of the machine's CPU
        over the step (from its end, when its metrics line appeared, back by its duration); None if not seen."""
        out: list[float | None] = []
        for i, seconds in enumerate(step_seconds):
            if i >= len(self.ends) or seconds <= 0:
                out.append(None)
                continue
            (b0, o0), (b1, o1) = self._at(self.ends[i] - seconds), self._at(self.ends[i])
            out.append(max(0.0, (b1 - b0) - (o1 - o0)) / (seconds * self.cores))
        return out


def phases_of(record: dict) -> dict[str, float]:
    """One step's seconds by phase (module docstring) from its ``timing/train/*`` metrics."""
    t = {k[len("timing/train/") :]: float(v) for k, v in record.items() if k.startswith("timing/train/") and "/share/" not in k}
    out = {
        "total": t["total_step_time"],
        "generation": t.get("generation", 0.0),
        "logprobs": sum(t.get(k, 0.0) for k in LOGPROB_PASSES),  # consecutive waits (grpo.gather_logprob_passes)
        "training": t.get("policy_training", 0.0),
        "refit": t.get("refit", 0.0),
        "scoring": t.get("reward", 0.0),
    }
    out["other"] = max(0.0, out["total"] - sum(out[p] for p in PHASES if p != "other"))
    return out


def run_point(point: dict, model_dir: str, steps: int, log: Path, tmp: str) -> dict:
    """Train ``steps`` steps at ``point``, and one more that is not returned (so no step returned borders the run's
    shutdown, where exiting actors would blur the CPU accounting); returns every step's phases, counters and the other
    processes' share of the CPU during it (:class:`ForeignCpu`), and the run's wall seconds."""
    from recipe_runs import run_recipe

    start, load = time.perf_counter(), load1()
    log_dir = Path(tempfile.mkdtemp(dir=tmp, prefix="run-"))
    monitor = ForeignCpu(log_dir / "metrics.jsonl")
    try:
        with output_to(log):
            history = run_recipe(steps + 1, str(log_dir), overrides_for(point, model_dir))
    finally:
        monitor.stop()
    records = [r for r in history if "timing/train/total_step_time" in r][:steps]
    foreign = monitor.shares([float(r["timing/train/total_step_time"]) for r in records])
    return {
        "steps": [
            {
                **phases_of(r),
                "gflop": float(r.get("performance/model_flops", 0.0)) / 1e9,
                "truncated_fraction": float(r.get("train/truncated_fraction", float("nan"))),
                "response_length": float(r.get("train/mean_response_length", 0.0)),
                "foreign_cpu": share,
            }
            for r, share in zip(records, foreign)
        ],
        "wall_s": time.perf_counter() - start,
        "load1": load,
    }


# ---------------------------------------------------------------------------------------------------
# Fits, tables, plot
# ---------------------------------------------------------------------------------------------------
def exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``log y`` against ``log x`` (None when a value is not positive)."""
    if len(xs) < 2 or min(ys) <= 0:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def clean_steps(run: dict, warmup: int, max_foreign: float) -> list[dict]:
    """The measured steps of ``run`` (after the warm-up) during which other processes used at most ``max_foreign`` of
    the machine's CPU."""
    return [s for s in run["steps"][warmup:] if s.get("foreign_cpu") is not None and s["foreign_cpu"] <= max_foreign]


def summarise(results: dict, max_foreign: float) -> dict:
    """Per knob and point: medians over every clean measured step of every run of the point (every measured step when
    none is clean), per-run medians of the step, fits."""
    warmup = results["warmup"]
    out = {}
    for knob, values in results["points"].items():
        rows = []
        for value in values:
            runs = results["runs"][point_key(point_of(knob, value))]
            measured = [s for run in runs for s in run["steps"][warmup:]]
            clean = [s for run in runs for s in clean_steps(run, warmup, max_foreign)]
            used = clean or measured
            row = {
                "value": value,
                "x": results["params"][str(value)] if knob == "hidden" else value,
                "runs": [statistics.median(s["total"] for s in run["steps"][warmup:]) for run in runs],
                "load1": [run["load1"] for run in runs],
                "kept": f"{len(clean)}/{len(measured)}",
                "foreign": statistics.median([s["foreign_cpu"] for s in used if s.get("foreign_cpu") is not None] or [math.nan]),
                "full_length": all(s["truncated_fraction"] == 1.0 for s in measured),
            }
            for name in ("total", *PHASES, "gflop"):
                row[name] = statistics.median(s[name] for s in used)
            rows.append(row)
        xs = [r["x"] for r in rows]
        fits = {}
        for name in ("total", *PHASES, "gflop"):
            ys = [r[name] for r in rows]
            fits[name] = (exponent(xs, ys), exponent(xs[-2:], ys[-2:]))
        out[knob] = {"rows": rows, "fits": fits}
    return out


def fmt_exp(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_tables(summary: dict) -> None:
    for knob, data in summary.items():
        title, key = KNOBS[knob]
        base = ", ".join(f"{k} {v}" for k, v in BASE.items() if k != knob)
        print(f"\n== step time vs {title} ({key}; the others at the recipe's: {base}) ==")
        head = (
            f"{'x':>8}{'step s':>9}" + "".join(f"{p:>11}" for p in PHASES) + f"{'GFLOP':>9}  {'kept':>5} {'foreign':>7}  run medians / load"
        )
        print(head)
        for r in data["rows"]:
            label = f"{r['x'] / 1e6:.1f}M" if knob == "hidden" else str(r["x"])
            runs = " ".join(f"{v:.2f}" for v in r["runs"])
            loads = " ".join(f"{v:.1f}" for v in r["load1"])
            full = "" if r["full_length"] else "  (NOT all completions full length)"
            print(
                f"{label:>8}{r['total']:>9.3f}"
                + "".join(f"{r[p]:>11.3f}" for p in PHASES)
                + f"{r['gflop']:>9.2f}  {r['kept']:>5} {r['foreign']:>7.2f}  {runs} / {loads}{full}"
            )
        fits = data["fits"]
        for i, what in enumerate(("b (all)", "b (top2)")):  # the exponents: all points, the last two
            print(
                f"{what:>8}{fmt_exp(fits['total'][i]):>9}"
                + "".join(f"{fmt_exp(fits[p][i]):>11}" for p in PHASES)
                + f"{fmt_exp(fits['gflop'][i]):>9}"
            )


def plot(summary: dict, path: Path) -> bool:
    """Three log-log panels (one per knob): the step and each phase against the knob, fitted exponents in the legend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install -e '.[logging]' installs it)")
        return False
    fig = Figure(figsize=(4.4 * len(summary), 4.2), dpi=80)
    FigureCanvasAgg(fig)
    styles = {"total": ("k", "o", 2.2), "generation": ("C0", "s", 1.2), "logprobs": ("C1", "^", 1.2), "training": ("C2", "D", 1.2)}
    styles["other"] = ("C7", "v", 1.0)
    for i, (knob, data) in enumerate(summary.items()):
        ax = fig.add_subplot(1, len(summary), i + 1)
        xs = [r["x"] for r in data["rows"]]
        first = data["rows"][0]["total"]  # a guide: what the step would take if it grew in proportion to x
        ax.plot(xs, [first * x / xs[0] for x in xs], color="0.6", linestyle="--", linewidth=1, label="x^1 (from the first step)")
        for name, (color, marker, width) in styles.items():
            ys = [r[name] for r in data["rows"]]
            if min(ys) <= 0:
                continue
            b = data["fits"][name][0]
            label = f"{'step' if name == 'total' else name}: x^{b:.2f}" if b is not None else name
            ax.plot(xs, ys, color=color, marker=marker, linewidth=width, markersize=4, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(KNOBS[knob][0])
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x / 1e6:.0f}M" if knob == "hidden" else str(x) for x in xs])
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.3)
        if i == 0:
            ax.set_ylabel("seconds per step (median)")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("GRPO step time vs one knob at a time (tiny CPU recipe; exponents of log-log fits)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return True


# ---------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------
def point_of(knob: str, value: int) -> dict:
    return {**BASE, knob: value}


def point_key(point: dict) -> str:
    return f"n{point['generations']}-len{point['length']}-h{point['hidden']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 points per knob, one round, --warmup 1 --steps 3")
    parser.add_argument("--rounds", type=int, help="runs of every point (default 2; --quick: 1)")
    parser.add_argument("--warmup", type=int, help="first steps of each run left out (default 2; --quick: 1)")
    parser.add_argument("--steps", type=int, help="measured steps per run (default 4; --quick: 3)")
    parser.add_argument("--knobs", default="generations,length,hidden", help="which knobs to vary (comma-separated)")
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.10,
        help="a step counts when other processes used at most this share of the machine's CPU during it (default 0.10)",
    )
    parser.add_argument("--retries", type=int, default=2, help="reruns of a run with fewer than half its steps clean (default 2)")
    parser.add_argument("--plot", type=Path, help="write the PNG here")
    parser.add_argument("--json", type=Path, help="write every step's figures here (for --replot)")
    parser.add_argument("--replot", type=Path, nargs="+", help="read --json files (their runs pooled) instead of training")
    args = parser.parse_args()

    if args.replot:
        results = merge([json.loads(path.read_text()) for path in args.replot])
    else:
        results = measure(args)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    summary = summarise(results, args.max_foreign)
    print(f"\nmedians over the measured steps during which other processes used <= {args.max_foreign:.0%} of the CPU ('kept')")
    print_tables(summary)
    if args.plot and plot(summary, args.plot):
        print(f"\nplot: {args.plot}")


def merge(saved: list[dict]) -> dict:
    """Several ``--json`` files as one: every run of a point pooled (same points and warm-up required)."""
    out = json.loads(json.dumps(saved[0]))
    for other in saved[1:]:
        if other["points"] != out["points"] or other["warmup"] != out["warmup"]:
            raise SystemExit("--replot: the files measured different points or warm-ups")
        for key, runs in other["runs"].items():
            out["runs"].setdefault(key, []).extend(runs)
    return out


def measure(args) -> dict:
    quick = args.quick
    rounds = args.rounds or (1 if quick else 2)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    steps = args.steps or (3 if quick else 4)
    knobs = [k for k in args.knobs.split(",") if k]
    points = {k: (QUICK_POINTS if quick else POINTS)[k] for k in knobs}
    order: list[dict] = []
    for knob, values in points.items():
        for value in values:
            point = point_of(knob, value)
            if point not in order:
                order.append(point)
    results = {"points": points, "warmup": warmup, "params": {}, "runs": {}, "rounds": rounds, "steps": steps}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for hidden in sorted({p["hidden"] for p in order}):
            models[hidden], results["params"][str(hidden)] = build_model(Path(tmp) / f"qwen2-h{hidden}", hidden)
        log = Path(tmp) / "runs.log"
        print(f"{len(order)} points x {rounds} round(s), {warmup} + {steps} (+1) steps each; run output in {log}")
        for r in range(rounds):
            for point in order if r % 2 == 0 else order[::-1]:
                for _ in range(1 + args.retries):
                    try:
                        run = run_point(point, models[point["hidden"]], warmup + steps, log, tmp)
                    except BaseException:
                        print("".join(log.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
                        raise
                    results["runs"].setdefault(point_key(point), []).append(run)
                    median = statistics.median(s["total"] for s in run["steps"][warmup:])
                    clean = len(clean_steps(run, warmup, args.max_foreign))
                    foreign = " ".join(f"{s['foreign_cpu']:.2f}" if s["foreign_cpu"] is not None else "?" for s in run["steps"][warmup:])
                    print(
                        f"round {r + 1}/{rounds} {point_key(point):<18} median step {median:.3f}s, {clean}/{steps} steps clean "
                        f"(other processes' CPU share: {foreign}; run {run['wall_s']:.0f}s, load {run['load1']:.1f}, "
                        f"{time.perf_counter() - started:.0f}s so far)",
                        flush=True,
                    )
                    if 2 * clean >= steps:
                        break
    return results


if __name__ == "__main__":
    main()
