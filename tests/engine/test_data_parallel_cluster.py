"""Two Ray nodes on one box (`ray.cluster_utils.Cluster`, one Ray start for this
module): `LLM(data_parallel_size=2, ray_address=...)` joins the cluster as
`--ray-address` does, places one replica on each node and routes to both."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from engine.llm import LLM
from scheduler import SamplingParams

pytestmark = pytest.mark.model  # loads the real default model

PROMPTS = [[1, 504, 3303, 314, 1500 + 7 * i, 30] for i in range(8)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # One CPU per node and one per replica: the two replicas must land on two nodes.
    two = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    two.add_node(num_cpus=1)
    two.wait_for_nodes()
    try:
        yield two
    finally:
        two.shutdown()


def test_replicas_on_both_nodes_serve(cluster: Cluster) -> None:
    llm = LLM(data_parallel_size=2, ray_address=cluster.address, max_num_seqs=4,
              max_model_len=512, kv_cache_memory_bytes=32 << 20)
    try:
        assert ray.is_initialized()
        nodes = {replica.info["node_id"] for replica in llm.replicas.replicas}  # type: ignore[union-attr]
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        assert len(nodes) == 2 and nodes == alive
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
        assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
        assert [o.prompt_token_ids for o in outputs] == PROMPTS  # prompt order kept
        routed = [r["num_routed"] for r in llm.get_metrics()["replicas"]]
        assert sum(routed) == len(PROMPTS) and min(routed) > 0, routed
    finally:
        llm.close()
    assert not ray.is_initialized()  # it joined the cluster, and left it
