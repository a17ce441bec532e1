"""The thread split counts the ranks that a packing placement strategy may put on one node, not an even spread."""

from __future__ import annotations

from pathlib import Path

from nemo_like.config import load_config
from nemo_like.plan.logprob_passes import decide_logprob_passes
from nemo_like.plan.threads import thread_split

SYNC = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_tiny_cpu.yaml"
TWO_NODES_DP4 = ["cluster.num_nodes=2", "policy.dp_size=4", "policy.dtensor_cfg.enabled=true"]


def test_pack_puts_a_whole_group_on_one_node_and_the_split_counts_it() -> None:
    """2 nodes x 4 CPUs, dp 4: PACK (the default) placed the 4 policy ranks and the 4 reference ranks on one node each
    when they fit, and the split gave each 2 threads for ceil(4/2) = 2 ranks per node: 8 threads on a 4-CPU node."""
    packed = load_config(SYNC, TWO_NODES_DP4)
    assert packed.cluster.placement_strategy == "PACK"
    split = thread_split(packed, 4, decide_logprob_passes(packed))
    assert (split.policy, split.reference) == (1, 1)  # 4 ranks of a role on the node: 4 CPUs // 4
    spread = load_config(SYNC, [*TWO_NODES_DP4, "cluster.placement_strategy=SPREAD"])
    split = thread_split(spread, 4, decide_logprob_passes(spread))
    assert (split.policy, split.reference) == (2, 2)  # 2 per node: 4 // 2


def test_ranks_per_node_is_the_worst_case_of_the_strategy() -> None:
    from nemo_like.plan.threads import bundles_per_node, ranks_per_node

    assert [ranks_per_node(4, 2, s, fit=4) for s in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")] == [4, 4, 2, 2]
    assert ranks_per_node(8, 2, "PACK", fit=3) == 4  # 3 fit on a node, but 8 over 2 nodes put 4 on one at least
    assert ranks_per_node(4, 2, "PACK", fit=1) == 2
    assert ranks_per_node(0, 2, "PACK", fit=4) == 0 and ranks_per_node(3, 1, "SPREAD", fit=1) == 3
    cfg = load_config(SYNC, [*TWO_NODES_DP4, "policy.num_cpus_per_worker=1.5"])
    assert bundles_per_node(cfg, 4) == 2  # floor(4 / 1.5)
    gpu = load_config(SYNC, [*TWO_NODES_DP4, "cluster.gpus_per_node=2"])
    assert bundles_per_node(gpu, 64) == 2  # one GPU per bundle
