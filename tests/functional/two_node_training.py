"""Run by test_multi_node.py in a subprocess (its own two-node Ray cluster must not meet the session's):
policy ranks placed across two Ray nodes train two optimizer steps; prints one JSON line of results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
import torch
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from functional.helpers import tiny_config  # noqa: E402

from nemo_like.algorithms.loss_functions import ClippedPGLossFn
from nemo_like.distributed.planning import plan_on_cluster
from nemo_like.models.policy.policy import Policy  # noqa: E402


def random_batch(rows: int = 8, seq: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(6, seq + 1, (rows,), generator=g)
    cols = torch.arange(seq)
    attention = (cols[None] < lengths[:, None]).long()
    token_mask = ((cols[None] >= 4) & (attention == 1)).float()
    return {
        "input_ids": torch.randint(3, 300, (rows, seq), generator=g) * attention,
        "attention_mask": attention,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "generation_logprobs": -torch.rand(rows, seq, generator=g) * token_mask,
        "advantages": torch.randn(rows, 1, generator=g).expand(rows, seq) * token_mask,
    }


def main(tmp: str, strategy: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20})
    cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cfg = tiny_config(
            Path(tmp),
            "policy.dp_size=2",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=2",
            "policy.num_cpus_per_worker=0.5",
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=4",
            "loss_fn.reference_policy_kl_penalty=0",
            "cluster.num_nodes=2",
            f"cluster.placement_strategy={strategy}",
        )
        # a laptop recipe (cluster.num_nodes 1) on these two nodes: the run's split counts the cluster's nodes
        laptop = tiny_config(Path(tmp), "policy.dp_size=2", "cluster.placement_strategy=SPREAD")
        laptop_nodes = plan_on_cluster(laptop).nodes
        policy = Policy(cfg, loss_fn=ClippedPGLossFn(cfg.loss_fn))
        nodes = [info["node_id"] for info in ray.get(policy.group.run_all("device_info"))]
        before = policy.parameter_checksums()
        result = policy.train({**random_batch(16)})  # 16 samples / 8 per step = two optimizer steps
        after = policy.parameter_checksums()
        policy.shutdown()
        print(
            json.dumps(
                {
                    "nodes": nodes,
                    "cluster_nodes": len(ray.nodes()),
                    "laptop_recipe_nodes": laptop_nodes,
                    "before": before,
                    "after": after,
                    "grad_norms": result.grad_norms,
                    "loss": result.metrics["loss"],
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
