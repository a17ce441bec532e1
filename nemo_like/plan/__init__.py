"""The run plan: every run-level decision, made once from the validated config (and values read from the cluster,
passed in) by pure functions that import nothing above ``config``. :func:`.run_plan.decide_run_plan` gathers them
into one frozen :class:`.run_plan.RunPlan` that setup hands to the run's components: the logprob passes
(:mod:`.logprob_passes`), the generation backend (:mod:`.backend`), the LoRA refit mode (:mod:`.refit`), the thread
split (:mod:`.threads`) and the multi-turn settings (:mod:`.multi_turn`)."""
