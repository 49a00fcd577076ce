"""A simulated two-node cluster (ray.cluster_utils.Cluster): the target on the head node, two drafter replicas on a
second node; then one drafter replica is killed while requests run, and every request still completes exactly.

The drafter node has no CPUs, so the target rank's placement group (1 CPU) can only land on the head; drafters need
the drafter node's custom resource.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import ray
from ray import serve

from deployments import AppArgs
from ray_specdec.config import SamplingParams
from ray_specdec.engine import SpeculativeEngine
from tests.deployments.conftest import PROMPTS, greedy_margin, post, serve_app

MAX_TOKENS = 200  # long enough that the kill lands while every request is still running


@pytest.fixture(scope="module")
def cluster_url(model_dirs):
    from ray.cluster_utils import Cluster

    target, drafter = model_dirs
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head_node": 1},
                                                            "include_dashboard": False})  # fmt: skip
    cluster.add_node(num_cpus=0, resources={"drafter_node": 2})
    args = AppArgs(
        target=str(target), drafter=str(drafter), drafter_replicas=2, drafter_num_cpus=0,
        drafter_resources={"drafter_node": 1}, target_resources={"head_node": 0.1}, tree="2,2,1,1",
    )  # fmt: skip
    try:
        with serve_app(args, address=cluster.address) as url:
            yield url, cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    alone = SpeculativeEngine(engine.target, None)
    out = {}
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        out[prompt] = alone.generate(ids, SamplingParams(max_new_tokens=MAX_TOKENS)).token_ids
        assert greedy_margin(engine.target, ids, out[prompt]) > 1e-3
    return out


def running_drafters() -> list[dict]:
    """The drafter replicas Serve reports RUNNING: replica_id, actor_name, node_id, ... (no dashboard needed)."""
    controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    details = ray.get(controller.get_serve_instance_details.remote())
    replicas = details["applications"]["specdec"]["deployments"]["drafter"]["replicas"]
    return [r for r in replicas if r["state"] == "RUNNING"]


def test_target_and_drafters_run_on_different_nodes(cluster_url, reference):
    url, cluster = cluster_url
    head, other = cluster.head_node.node_id, cluster.list_all_nodes()[1].node_id
    drafters = running_drafters()
    assert len(drafters) == 2 and {r["node_id"] for r in drafters} == {other} != {head}
    # the target's rank actors run in its placement group's bundles
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    assert len(groups) == 1 and set(groups[0]["bundles_to_node_id"].values()) == {head}
    for prompt in PROMPTS[:2]:
        body = post(url, {"prompt": prompt, "max_tokens": 60}).json()
        assert body["choices"][0]["token_ids"] == reference[prompt][:60]
        assert body["speculative"]["mean_accepted_length"] > 1.5  # drafts crossed nodes and were accepted


def drafter_stats() -> dict[str, dict]:
    """Per-replica drafter stats, gathered through the handle (session ids spread the calls over the replicas)."""
    handle = serve.get_deployment_handle("drafter", app_name="specdec")
    stats = [handle.options(session_id=f"probe-{i}").stats.remote().result() for i in range(16)]
    return {s["replica"]: s for s in stats}


def test_killing_a_drafter_replica_loses_no_request(cluster_url, reference):
    url, _ = cluster_url
    prompts = PROMPTS + PROMPTS[:2]
    progress = [0] * len(prompts)

    async def one(client: httpx.AsyncClient, i: int) -> list[int]:
        body = {"prompt": prompts[i], "max_tokens": MAX_TOKENS, "stream": True}
        ids = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0]["token_ids"]
                    progress[i] = len(ids)
        return ids

    async def run_and_kill():
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(len(prompts))]
            while min(progress) < 8:
                await asyncio.sleep(0.05)
            stats = await asyncio.to_thread(drafter_stats)
            victim = max(stats.values(), key=lambda s: s["sessions"])
            name = next(r["actor_name"] for r in running_drafters() if r["replica_id"] == victim["replica"])
            ray.kill(ray.get_actor(name, namespace="serve"))
            in_flight = sum(0 < p < MAX_TOKENS for p in progress)
            return victim, in_flight, await asyncio.gather(*tasks)

    victim, in_flight, outputs = asyncio.run(run_and_kill())
    assert victim["sessions"] > 0 and in_flight > 0  # the killed replica held live requests' states
    assert outputs == [reference[p] for p in prompts]
    # the live replicas built the states of their own requests, and rebuilt some of the victim's from token ids
    rebuilds = sum(s["rebuilds"] for s in drafter_stats().values())
    assert rebuilds > len(prompts) - victim["sessions"]
    after = httpx.get(f"{url}/v1/stats", trust_env=False).json()
    assert after["replicas"]["router"] == 1 and post(url, {"prompt": PROMPTS[0], "max_tokens": 10}).status_code == 200
