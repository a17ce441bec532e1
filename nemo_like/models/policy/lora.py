"""Moved to :mod:`nemo_like.models.lora` (the policy and the vLLM engine both use it); this old path keeps working.
Its ``refit_mode`` keeps the old config-only form (it resolves the backend itself); a run takes the mode from its plan
(:mod:`nemo_like.plan.run_plan`)."""

from nemo_like.models.lora import *  # noqa: F403
from nemo_like.models.lora import __all__, apply_lora, check_lora_targets, merge_checkpoint, parameter_counts  # noqa: F401
from nemo_like.plan.refit import VLLM_MAX_LORA_RANKS, vllm_max_lora_rank  # noqa: F401
from nemo_like.plan.refit import refit_mode_of_config as refit_mode  # noqa: F401
