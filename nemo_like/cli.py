"""``nemo-like train`` and friends. User errors print one clear message, never a traceback."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_like.config import ConfigError, MasterConfig, load_config
from nemo_like.config.loader import recipe_yaml
from nemo_like.utils.stop_signals import command_stop, raise_if_stopped, signals_ignored, stop_signals_raise, stop_signals_restored


def _run_errors() -> tuple[type[BaseException], ...]:
    from nemo_like.algorithms.dynamic_sampling import DynamicSamplingExhausted
    from nemo_like.algorithms.grpo import NonFiniteTrainingError
    from nemo_like.distributed.worker_group import PlacementError, WorkerFailure
    from nemo_like.utils.checkpoint import CheckpointError
    from nemo_like.utils.run_lock import RunLockError

    return (
        WorkerFailure,
        PlacementError,
        CheckpointError,
        NonFiniteTrainingError,
        DynamicSamplingExhausted,
        RunLockError,
        ConnectionError,
    )


COMMANDS = {  # name: its line in `nemo-like --help` (and its description in `nemo-like NAME --help`)
    "train": "Run GRPO from a recipe (default: the embedded tiny CPU recipe).",
    "eval": "Score a model or checkpoint on the recipe's validation prompts: accuracy and pass@k.",
    "plot": "Render a run's metrics.jsonl to a PNG (the standard panel, or --metrics).",
    "merge": "Merge a LoRA checkpoint's adapters into its base model: a plain HF model directory.",
    "plan": "Before launching: every run-level decision, memory per role and device, whether it fits, step time.",
    "serve": "Serve the recipe's model (or eval.model_path) over an OpenAI-compatible API on 127.0.0.1, without training.",
}
TOP_LEVEL_FLAGS = ("-h", "--help", "--version")


def package_version() -> str:
    """The installed package's version, else the one in the checkout's pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nemo-like")
    except PackageNotFoundError:
        return pyproject_version(Path(__file__).resolve().parents[1] / "pyproject.toml")


def pyproject_version(path: Path) -> str:
    """``project.version`` of a pyproject.toml; ``unknown`` when it cannot be read."""
    import tomllib

    try:
        return str(tomllib.loads(path.read_text())["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def top_level_help() -> str:
    """`nemo-like --help`'s text under the usage line: one line per command, and how to see its options."""
    width = max(map(len, COMMANDS)) + 2
    lines = ["Ray-distributed GRPO trainer.", "", "commands:"]
    lines += [f"  {name:<{width}}{summary}" for name, summary in COMMANDS.items()]
    lines += [
        "",
        "`nemo-like COMMAND --help` lists a command's options (e.g. `nemo-like train --help`).",
        "`nemo-like KEY=VALUE ...` (or `nemo-like` alone) means `nemo-like train KEY=VALUE ...`.",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nemo-like",
        usage="%(prog)s [-h] [--version] COMMAND [ARGS ...]",
        description=top_level_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", prog="nemo-like", help=argparse.SUPPRESS)  # listed in the description, one line each
    adders = {"train": add_train_arguments, "eval": add_eval_arguments, "plot": add_plot_arguments, "merge": add_merge_arguments}
    adders |= {"serve": add_serve_arguments, "plan": add_plan_arguments}
    for name, summary in COMMANDS.items():
        adders[name](sub.add_parser(name, help=summary, description=summary))
    return parser


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``nemo-like merge``."""
    parser.add_argument(
        "checkpoint",
        help="A LoRA run's checkpoint step directory (results/grpo/step_N), its policy/ adapter directory, or its "
        "checkpointing.checkpoint_dir (its latest valid step).",
    )
    parser.add_argument("--out", required=True, help="Output directory of the merged HF model (weights, config, tokenizer).")
    parser.add_argument("--base-model", default=None, help="Base model (default: the adapter's base_model_name_or_path).")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer the merged model ships (default: the one saved in the checkpoint, else the base model's); "
        "the run's policy.tokenizer_name for a checkpoint that holds none.",
    )
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"], help="dtype of the merged weights.")


def run_merge(args: argparse.Namespace) -> int:
    """Merge a LoRA checkpoint into a plain HF model directory and print its path. ``CHECKPOINT`` resolves as
    ``nemo-like eval`` / ``serve`` resolve ``eval.model_path`` (a checkpoint directory: its latest valid step)."""
    from nemo_like.models.loading import check_model_source, resolve_checkpoint_model
    from nemo_like.models.lora import merge_checkpoint, refuse_overwriting_base
    from nemo_like.utils.preflight import refuse_overwriting

    out = Path(args.out).expanduser()  # `--out=~/x`: the shell leaves that ~ alone
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {args.out} is a file; the merged model is a directory")
    path = Path(args.checkpoint).expanduser()
    if not path.is_dir():
        problem = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
        raise ConfigError(f"CHECKPOINT {args.checkpoint} {problem}")
    adapter_dir = Path(resolve_checkpoint_model(str(path), "CHECKPOINT"))
    if adapter_dir not in (path, path / "policy"):  # a checkpoint directory: say which step it merges
        print(f"[merge] {args.checkpoint}: merging its latest valid step, {adapter_dir}", file=sys.stderr)
    if args.base_model is not None:
        check_model_source(args.base_model, "--base-model")
    if args.tokenizer is not None:
        check_model_source(args.tokenizer, "--tokenizer")
    refuse_overwriting(out, adapter_dir, "--out", "the checkpoint it merges")
    refuse_overwriting_base(out, adapter_dir, "--out", args.base_model)  # no adapters: merge_checkpoint says so
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {args.out} is not empty; merge into a new directory (or remove this one first)")
    print(merge_checkpoint(adapter_dir, out, args.base_model, tokenizer=args.tokenizer, precision=args.precision))
    return 0


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log_dir", help="A run's logger.log_dir (holding metrics.jsonl), or the metrics.jsonl itself.")
    parser.add_argument("--metrics", nargs="+", default=None, help="Plot these metrics, one panel each, instead of the standard panel.")
    parser.add_argument(
        "--out", default=None, help="Output PNG (default: LOG_DIR/metrics.png); a directory gets metrics.png, a name without a suffix .png."
    )


def run_plot(args: argparse.Namespace) -> int:
    """Render the metrics of a run to a PNG and print its path."""
    from nemo_like.utils.plot import plot_metrics

    path = Path(args.log_dir).expanduser()
    metrics_path = path if path.is_file() else path / "metrics.jsonl"
    if not metrics_path.is_file():
        print(f"nemo-like: error: no metrics.jsonl at {metrics_path}", file=sys.stderr)
        return 2
    try:
        print(plot_metrics(metrics_path, args.out and os.path.expanduser(args.out), args.metrics))  # keeps a trailing "/"
    except ValueError as exc:  # a line that is not JSON, or a --metrics name the file does not hold
        raise ConfigError(str(exc)) from None
    except OSError as exc:  # the figure's place not writable (--out, or the run's log directory)
        target = exc.filename or args.out or metrics_path.with_name("metrics.png")
        hint = "" if args.out else " (pass --out PATH)"
        raise ConfigError(f"cannot write the plot {target}: {exc.strerror or exc}{hint}") from None
    return 0


class GivenOnce(argparse.Action):
    """An option that may be given once: a second ``--config`` silently replaced the first recipe."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, option: str | None = None) -> None:
        if getattr(namespace, self.dest) is not None:
            parser.error(
                f"{option} given twice ({getattr(namespace, self.dest)}, {value}); to combine recipes write one with "
                "defaults: [a.yaml, b.yaml]"
            )
        setattr(namespace, self.dest, value)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, action=GivenOnce, help="Recipe YAML (default: examples/configs/grpo_tiny_cpu.yaml).")
    parser.add_argument("--dry-run", action="store_true", help="Print the resolved recipe and exit.")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides: a.b=1, +a.c=2, ++a.b=3, ~a.d")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=None, action=GivenOnce, help="Recipe YAML (its data, env, policy.generation and eval sections)."
    )
    parser.add_argument("--dry-run", action="store_true", help="Print the resolved recipe and exit.")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra-style overrides, e.g. eval.model_path=results/grpo/step_50 eval.num_samples_per_prompt=4 'eval.pass_k=[1,4]'",
    )


def load_checked_recipe(args: argparse.Namespace) -> MasterConfig | None:
    """The validated recipe with its environments checked (before any actor starts); ``None`` after printing it
    for ``--dry-run``."""
    from nemo_like.algorithms.names import check_plugin_names

    cfg = load_config(args.config, args.overrides)
    check_plugin_names(cfg)  # a wrong plug-in name (estimator, loss plug-in, env class, tool) or env key fails here
    if args.dry_run:
        print(recipe_yaml(cfg.model_dump(mode="json")), end="")
        return None
    return cfg


def port_number(text: str) -> int:
    """``--port``: an integer in 0..65535 (0: a free one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {port}")
    return port


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Fail before a model loads when ``host:port`` cannot be listened on (taken, or privileged)."""
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"--port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); choose another, or 0 for a free one"
            ) from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        action=GivenOnce,
        help="Recipe YAML (its policy model, tokenizer and context; eval.model_path to serve a checkpoint).",
    )
    parser.add_argument("--port", type=port_number, default=0, help="Port on 127.0.0.1 (default: a free one).")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. eval.model_path=results/grpo/step_50")


DEFAULT_MFU = 0.4  # nemo-like plan's assumed model FLOPs utilisation


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, action=GivenOnce, help="Recipe YAML (default: examples/configs/grpo_tiny_cpu.yaml).")
    parser.add_argument(
        "--device-memory-gib", type=float, default=None, help="Memory of one GPU (or of one node on a CPU cluster): check the fit."
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="Peak dense TFLOP/s of one device: estimate the step time.")
    parser.add_argument(
        "--mfu",
        type=float,
        default=None,
        help=f"Model FLOPs utilisation assumed for the step time (default {DEFAULT_MFU}; needs --peak-tflops).",
    )
    parser.add_argument("--model-config", default=None, help="The model's config.json when the model is not on this machine.")
    parser.add_argument(
        "--teacher-config",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="A teacher model's config.json when that model is not on this machine (NAME as in teacher.model_name or "
        "teacher.by_task); repeat for each.",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides, as for train")


def run_plan(args: argparse.Namespace) -> int:
    """Print the run plan and the memory plan; exit 3 when a device is over ``--device-memory-gib``."""
    from nemo_like.algorithms.names import check_plugin_names
    from nemo_like.algorithms.roles import declared_cluster_problem, idle_gpus_warning, scorer_specs
    from nemo_like.algorithms.setup import check_sampled_model, multi_turn_warnings, plan_model_checks
    from nemo_like.data.datasets import is_arithmetic, resolve_source
    from nemo_like.distributed.planning import plan_on_cluster
    from nemo_like.experience.agent_rollouts import load_agents
    from nemo_like.models.engines import ignored_engine_keys
    from nemo_like.models.footprint import memory_report, model_config_here, model_config_path, model_config_warning
    from nemo_like.models.loading import model_configs_given, policy_model, refuse_checkpoint_as_model

    for flag, value, low_open, high in (("--mfu", args.mfu, 0.0, 1.0), ("--peak-tflops", args.peak_tflops, 0.0, None),
                                         ("--device-memory-gib", args.device_memory_gib, 0.0, None)):  # fmt: skip
        if value is not None and (not math.isfinite(value) or value <= low_open or (high is not None and value > high)):
            expected = f"in (0, {high:g}]" if high is not None else "a finite number above 0"
            raise ConfigError(f"{flag} must be {expected}, got {value:g}")
    teacher_configs = {}
    for item in args.teacher_config:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--teacher-config {item}: expected NAME=PATH (a teacher model and its config.json)")
        teacher_configs[name] = path
    cfg = load_config(args.config, args.overrides)
    env_specs = check_plugin_names(cfg)  # what train refuses at once (an unknown estimator, env class or tool) plan refuses too
    refuse_checkpoint_as_model(cfg.policy.model_name, "policy.model_name")
    for line in multi_turn_warnings(cfg, env_specs):  # the turns' no-effect lines train prints
        print(f"[plan] warning: {line}", file=sys.stderr, flush=True)
    for line in plan_model_checks(cfg, args.model_config, teacher_configs):  # train's checks of the models' configs
        print(f"[plan] warning: {line}", file=sys.stderr, flush=True)
    if args.mfu is not None and not args.peak_tflops:
        print("[plan] warning: --mfu has no effect without --peak-tflops (no step time is estimated)", file=sys.stderr, flush=True)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    mfu = DEFAULT_MFU if args.mfu is None else args.mfu
    for role in ("train", "validation"):  # where each split's prompts come from (train's check at its data's load)
        if not is_arithmetic(cfg.data, role):
            resolve_source(cfg.data, role)
    policy_name = cfg.policy.model_name
    given = {policy_name: model_config_path(policy_name, args.model_config)} if args.model_config else {}
    with model_configs_given(given):
        model = policy_model(policy_name, local_only=True)  # what the backend and refit choices need to know of it
        plan = plan_on_cluster(cfg, turn_end_ids(cfg), planning_only=True, model=model)
        if given or model_config_here(policy_name):  # train's refusal of a model its resolved sampler cannot sample
            check_sampled_model(cfg, plan.backend.value, local_only=True, experts=model.experts)
    load_agents(env_specs, plan.agent_tasks)  # an agent that does not import: train refuses it before any actor starts
    for line in ignored_engine_keys(cfg, plan.backend.value):  # the engine keys train warns about when it builds it
        print(f"[plan] warning: {line}", file=sys.stderr, flush=True)
    lines, fits = memory_report(
        cfg, plan, args.device_memory_gib, peak, mfu, args.model_config, teacher_configs,
        lambda config: declared_cluster_problem(config, plan), scorer_specs(cfg),
    )  # fmt: skip
    if args.model_config and (line := model_config_warning(cfg.policy.model_name, args.model_config)):
        print(f"[plan] warning: {line}", file=sys.stderr, flush=True)  # before the figures it is about
    for line in lines:
        print(f"[plan] {line}", flush=True)
    if idle := idle_gpus_warning(cfg, plan):
        print(f"[plan] warning: {idle}", file=sys.stderr, flush=True)
    return 3 if fits is False else 0


def turn_end_ids(cfg: MasterConfig) -> tuple[int, ...]:
    """The ids that end a model turn, as a run reads them (the tokenizer's and the generation config's eos), for the
    multi-turn line of ``nemo-like plan``; ``()`` (the line then says they were not read) when the run is single-turn
    or the tokenizer is not on this machine (``plan`` needs only a config.json)."""
    if cfg.grpo.max_rollout_turns == 1:
        return ()
    from nemo_like.models.loading import end_of_sequence_ids, load_tokenizer

    try:
        tokenizer = load_tokenizer(cfg.policy.tokenizer_name or cfg.policy.model_name)
        return tuple(end_of_sequence_ids(tokenizer, cfg.policy.model_name))
    except (OSError, ValueError, ConfigError):
        return ()


def run_serve(args: argparse.Namespace) -> int:
    """Print the server's base URL and key, serve until Ctrl-C (``docs/guides/agents.md``)."""
    from nemo_like.models.loading import check_model_source, check_tokenizer_source
    from nemo_like.serving.standalone import serve

    cfg = load_config(args.config, args.overrides)
    serves_policy_model = cfg.eval.model_path is None  # else eval.model_path is resolved and checked as the served model
    if serves_policy_model:
        check_model_source(cfg.policy.model_name, "policy.model_name")
    check_tokenizer_source(cfg, model_checked=serves_policy_model)  # a bad path was a transformers traceback
    check_port_free(args.port)
    return serve(cfg, args.port)


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate ``eval.model_path`` (default ``policy.model_name``) and write summary.json / results.jsonl."""
    cfg = load_checked_recipe(args)
    if cfg is not None:
        from nemo_like.evaluation.run import evaluate

        evaluate(cfg)
    return 0


def run_train(args: argparse.Namespace) -> int:
    """Validate the recipe, then train (or print it with ``--dry-run``)."""
    cfg = load_checked_recipe(args)
    if cfg is not None:
        from nemo_like.train import train

        train(cfg, sys.argv)  # the command a stopped run prints back to resume it
    return 0


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args``, with overrides allowed on both sides of a flag (``train a=1 --dry-run b=2``): argparse
    takes a ``nargs="*"`` positional once, so what follows a flag came back as "unrecognized arguments"."""
    args, extra = parser.parse_known_args(argv)
    looks_like_override = [e for e in extra if not e.startswith("-") and ("=" in e or e.startswith("~"))]
    if extra and (len(looks_like_override) < len(extra) or not hasattr(args, "overrides")):
        command = _subcommand_parser(parser, getattr(args, "command", None)) or parser
        flags = [o for a in command._actions for o in a.option_strings]  # noqa: SLF001 - argparse keeps them only here
        close = [m for e in extra if e.startswith("-") for m in difflib.get_close_matches(e.split("=")[0], flags, n=1)]
        hint = f" (did you mean {' '.join(dict.fromkeys(close))}?)" if close else ""
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if extra:
        args.overrides = [*args.overrides, *extra]  # in the order given: a later override of the same key wins
    return args


def _subcommand_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    """The subcommand's own parser (its usage and flags), or None."""
    for action in parser._actions:  # noqa: SLF001 - argparse exposes its subparsers only here
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:  # noqa: SLF001
            return action.choices[command]
    return None


#: A file the CLI writes its exit status to when it ends (set by the Slurm launcher: ``ray job stop`` leaves a stopped
#: job without the driver's status, and a requeue rule must tell a stop that saved from one that did not).
EXIT_STATUS_FILE_ENV = "NEMO_LIKE_EXIT_STATUS_FILE"


PACKAGE_DIR = Path(__file__).resolve().parent
_python_warning_format = warnings.formatwarning


def format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    """A warning the project raises (set-up checks: ``warnings.warn(..., RuntimeWarning)``) as one ``warning: ...``
    line, without Python's source location and code line; any other library's as Python writes it."""
    if Path(filename).resolve().is_relative_to(PACKAGE_DIR):
        return f"warning: {message}\n"
    return _python_warning_format(message, category, filename, lineno, line)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``nemo-like`` command; returns its exit status (also written to ``$NEMO_LIKE_EXIT_STATUS_FILE`` when set)."""
    status: int | None = None
    python_format, warnings.formatwarning = warnings.formatwarning, format_warning
    previous = stop_signals_raise()  # every command's cleanups run on SIGTERM too (train stops between steps instead)
    try:
        status = _main(argv)
        return status
    except SystemExit as exc:  # argparse's usage errors and --help
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except KeyboardInterrupt as exc:  # a Ctrl-C or SIGTERM outside a training run's own handlers: one line, no traceback
        stopped = command_stop(exc)
        status = stopped.status
        print(f"nemo-like: stopped by {stopped.signal.name} (exit status {status})", file=sys.stderr, flush=True)
        return status
    finally:
        with signals_ignored():  # the status is decided: a signal now killed the process mid-write of the status file
            record_exit_status(1 if status is None else status)
        stop_signals_restored(previous)  # in-process callers (tests) get their own handlers back
        warnings.formatwarning = python_format  # and Python's format


def console_main() -> None:
    """The ``nemo-like`` command as a process: :func:`main`, then exit with its status; once the command is over a
    SIGINT or SIGTERM leaves at once with that status (:func:`~nemo_like.utils.run_control.leave_at_once_on_stop_signals`:
    the exit's teardown still shuts a private Ray cluster down)."""
    from nemo_like.utils.run_control import leave_at_once_on_stop_signals

    try:
        status = main()
    except SystemExit as exc:  # a stopped run (RunInterrupted), argparse's usage errors and --help
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # a crash: its traceback and status 1, as Python's; a signal during the teardown no longer
        traceback.print_exc()  # printed a KeyboardInterrupt traceback (SIGINT) or turned the status into 143 (SIGTERM)
        status = 1
    leave_at_once_on_stop_signals(status)
    sys.exit(status)


def record_exit_status(status: int) -> None:
    """Write ``status`` to ``$NEMO_LIKE_EXIT_STATUS_FILE`` when set (whole, or not at all); a failure only warns."""
    path = os.environ.get(EXIT_STATUS_FILE_ENV)
    if not path:
        return
    from nemo_like.utils.files import replace_file

    try:
        replace_file(path, f"{status}\n")
    except OSError as exc:
        print(f"nemo-like: warning: cannot write the exit status to {path}: {exc}", file=sys.stderr)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    implicit_train = not argv or (argv[0] not in TOP_LEVEL_FLAGS and (argv[0].startswith(("-", "~")) or "=" in argv[0]))
    if implicit_train:
        argv = ["train", *argv]  # `nemo-like` alone, or with train's options / overrides only, means train
    args = parse_arguments(build_parser(), argv)
    RUN_ERRORS = _run_errors()
    raise_if_stopped()  # a signal whose exception torch's import of numpy swallowed: the whole command ran after it
    try:
        if args.command == "train":
            return run_train(args)
        if args.command == "eval":
            return run_eval(args)
        if args.command == "plot":
            return run_plot(args)
        if args.command == "merge":
            return run_merge(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "plan":
            return run_plan(args)
        build_parser().print_help()
        return 2
    except ConfigError as exc:
        print(f"nemo-like: error: {exc}", file=sys.stderr)
        return 2
    except RUN_ERRORS as exc:  # faults with a clear cause: no traceback, non-zero exit
        print(f"nemo-like: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    console_main()
