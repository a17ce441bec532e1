"""Deterministic fault injection for tests: make one actor call hang, die or raise at a given step.

Armed from ``cluster.fault_injection`` and ``$NEMO_LIKE_FAULT_INJECTION`` (the same keys as JSON, e.g.
``{"role": "generation", "step": 3, "action": "hang"}``, or a list of such objects; both may be set: every spec is
armed; ``cluster.fault_injection.action`` null, the default, is none) by ``nemo_like/train.py``. The hook points
(``models/generation/interface.py`` ``generate_on_group``, ``models/policy/inline.py``, the policy's training call,
``experience/env_calls.py`` for the environments' ``score`` and ``step`` calls) call :func:`inject` before they
submit their call; when nothing is armed that is one emptiness check. When the armed role, phase and
step match, the fault is queued on the target actor itself (Ray's ``__ray_call__``), just ahead of the real call,
so the real call then waits behind it inside the actor, exactly as a hung or dead engine would make it:

* ``hang``: the actor sleeps forever (:func:`_hang_forever`, visible in its stack);
* ``kill``: the actor's process exits (``os._exit(1)``): the call fails with Ray's actor-died error;
* ``raise``: the actor raises :class:`InjectedFault`, re-raised in the driver.

An armed fault fires ``times`` times (default once), then disarms.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from nemo_like.config.errors import ConfigError
from nemo_like.config.sections.run import FaultInjectionConfig
from nemo_like.utils.run_control import run_control

ENV_VAR = "NEMO_LIKE_FAULT_INJECTION"


class _Armed:
    """One armed spec and how many times it has fired."""

    def __init__(self, spec: FaultInjectionConfig) -> None:
        self.spec, self.fired = spec, 0


_ARMED: list[_Armed] = []  # empty: nothing armed (the hooks' one check)


class InjectedFault(RuntimeError):
    """The error an injected ``raise`` fault raises (it names the config key that asked for it)."""


def arm(spec: FaultInjectionConfig | None) -> list[FaultInjectionConfig]:
    """Arm ``spec`` and every spec in ``$NEMO_LIKE_FAULT_INJECTION`` (a JSON object, or a list of them: several
    faults in one run, e.g. one per role); returns what is armed (empty: nothing)."""
    global _ARMED
    specs = [] if spec is None or spec.action is None else [spec]
    if os.environ.get(ENV_VAR):
        try:
            loaded = json.loads(os.environ[ENV_VAR])
            specs += [FaultInjectionConfig(**item) for item in (loaded if isinstance(loaded, list) else [loaded])]
        except (ValueError, TypeError) as exc:  # one line (the CLI's exit 2), not a pydantic dump and two tracebacks
            errors = exc.errors() if hasattr(exc, "errors") else []
            detail = f"{'.'.join(map(str, errors[0]['loc'])) or 'value'}: {errors[0]['msg']}" if errors else str(exc)
            raise ConfigError(
                f"${ENV_VAR} must be a JSON object (or a list of them) with the keys of cluster.fault_injection (role, step, "
                f"phase, action, times): {detail}"
            ) from None
    _ARMED = [_Armed(s) for s in specs if s.action is not None]
    return [a.spec for a in _ARMED]


def hand_over(roles: tuple[str, ...]) -> list[FaultInjectionConfig]:
    """Disarm here the armed faults of ``roles`` and return them, each with the times it has left, for the process
    that makes those calls to arm (:func:`arm_specs`): the async trajectory collector generates and scores."""
    global _ARMED
    taken = [a for a in _ARMED if a.spec.role in roles]
    _ARMED = [a for a in _ARMED if a.spec.role not in roles]
    return [a.spec.model_copy(update={"times": a.spec.times - a.fired}) for a in taken]


def arm_specs(specs: list[FaultInjectionConfig]) -> None:
    """Arm exactly ``specs`` in this process (handed over by :func:`hand_over`)."""
    global _ARMED
    _ARMED = [_Armed(s) for s in specs if s.action is not None]


def disarm() -> list[FaultInjectionConfig]:
    """Nothing armed (the end of a run); returns the specs that had not fired their ``times`` (a spec leaves the list
    once it has): a chaos test built on a spec that never fired exercised nothing."""
    global _ARMED
    left, _ARMED = [a.spec for a in _ARMED], []
    return left


def inject(role: str, phase: str, workers: list[Any]) -> None:
    """Queue an armed fault on ``workers[0]`` when ``role`` and ``phase`` match at or after its step (each spec fires
    ``times`` times in all, then disarms)."""
    global _ARMED
    if not _ARMED or not workers:
        return
    step = run_control().step
    armed = next((a for a in _ARMED if a.spec.role == role and a.spec.phase == phase and step >= a.spec.step), None)
    if armed is None:
        return
    spec = armed.spec
    armed.fired += 1
    if armed.fired >= spec.times:
        _ARMED = [a for a in _ARMED if a is not armed]
    assert spec.action is not None
    print(f"[fault] injecting '{spec.action}' into {role} ({phase}) at step {step} (cluster.fault_injection)", flush=True)
    ref = workers[0].__ray_call__.remote(_ACTIONS[spec.action], f"{role}/{phase} at step {step}")
    if spec.action == "raise":
        import ray

        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            raise InjectedFault(f"cluster.fault_injection: {role} {phase} raised at step {step}") from exc


def _hang_forever(actor: Any, where: str) -> None:
    """Runs inside the actor: never returns (the stall watchdog's test case)."""
    while True:
        time.sleep(3600)


def _exit_process(actor: Any, where: str) -> None:
    """Runs inside the actor: the process dies as if killed."""
    os._exit(1)


def _raise_fault(actor: Any, where: str) -> None:
    """Runs inside the actor: an ordinary exception."""
    raise InjectedFault(f"injected fault: {where} (cluster.fault_injection)")


_ACTIONS = {"hang": _hang_forever, "kill": _exit_process, "raise": _raise_fault}
