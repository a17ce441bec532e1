"""Run-level decisions, made once from the validated config (and values read from the cluster, passed in): pure
functions that import nothing above ``config``. Today: which logprob passes a step runs
(:mod:`.logprob_passes`). docs/guides/architecture.md says where every other decision is made."""
