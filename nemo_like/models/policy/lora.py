"""Moved to :mod:`nemo_like.models.lora` (the policy and the vLLM engine both use it); this old path keeps working.
Its ``refit_mode`` keeps the old config-only form (it resolves the backend itself); the run decides the mode once in
setup and hands it to the :class:`~.policy.Policy`."""

from nemo_like.models.generation.choice import run_refit_mode
from nemo_like.models.lora import *  # noqa: F403
from nemo_like.models.lora import __all__, apply_lora, check_lora_targets, merge_checkpoint, parameter_counts  # noqa: F401

refit_mode = run_refit_mode
