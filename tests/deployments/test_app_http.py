"""The Serve app over real HTTP: one local Ray (2 CPUs) and one app for the whole module, tiny float32 models.

The drafters autoscale between 1 and 2 replicas (target 0.5 draft calls in flight, 1 s upscale / 5 s downscale
delays): the load test first waits for one replica, then shows the second one coming under load. Greedy outputs do
not depend on which replica drafts; the seeded-sampling test runs first, while only one replica can exist.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from deployments import AppArgs
from ray_specdec.bandit import BanditState
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.engine import SpeculativeEngine
from ray_specdec.loadtest import LoadTestConfig, run_loadtest
from tests.deployments.conftest import PROMPTS, greedy_margin, post, serve_app, sse_chunks

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def bandit_path(tmp_path_factory):
    return tmp_path_factory.mktemp("bandit") / "bandit.json"


@pytest.fixture(scope="module")
def url(model_dirs, bandit_path):
    target, drafter = model_dirs
    args = AppArgs(
        target=str(target), drafter=str(drafter), drafter_num_cpus=0, target_num_cpus_per_rank=1,
        drafter_min_replicas=1, drafter_max_replicas=2, drafter_target_ongoing_requests=0.5,
        drafter_upscale_delay_s=1, drafter_downscale_delay_s=5, drafter_look_back_period_s=2,
        max_ongoing_requests=8, max_queued_requests=8, bandit_path=str(bandit_path),
    )  # fmt: skip
    with serve_app(args) as base:
        yield base


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    """Target-alone greedy ids per prompt, on paths without float32 near-ties."""
    alone = SpeculativeEngine(engine.target, None)
    out = {}
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        out[prompt] = alone.generate(ids, SamplingParams(max_new_tokens=MAX_TOKENS)).token_ids
        assert greedy_margin(engine.target, ids, out[prompt]) > 1e-3
    return out


def completion(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_seeded_sampling_matches_engine(url, engine):
    body = {"prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0.9, "top_k": 50, "seed": 7, "tree": "3,2,1"}
    got = completion(post(url, body))["choices"][0]["token_ids"]
    params = SamplingParams(temperature=0.9, top_k=50, seed=7, max_new_tokens=30)
    assert got == engine.generate(PROMPTS[1], params, TreeConfig((3, 2, 1))).token_ids


def test_greedy_matches_engine_and_target_alone(url, engine, reference):
    for prompt in PROMPTS:  # trees picked by the bandit
        body = completion(post(url, {"prompt": prompt, "max_tokens": MAX_TOKENS}))
        choice, spec = body["choices"][0], body["speculative"]
        assert choice["token_ids"] == reference[prompt]
        assert choice["token_ids"] == engine.generate(prompt, SamplingParams(max_new_tokens=MAX_TOKENS)).token_ids
        assert choice["text"] == engine.tokenizer.decode(reference[prompt]) and choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(engine.encode(prompt)), "completion_tokens": MAX_TOKENS,
                                 "total_tokens": len(engine.encode(prompt)) + MAX_TOKENS}  # fmt: skip
        assert spec["mean_accepted_length"] > 1.5 and sum(spec["trees"].values()) == spec["rounds"]
    alone = completion(post(url, {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "tree": "none"}))
    assert alone["choices"][0]["token_ids"] == reference[PROMPTS[0]]
    assert alone["speculative"]["rounds"] == MAX_TOKENS and alone["speculative"]["trees"] == {"none": MAX_TOKENS}


def test_streaming_yields_the_same_text(url, reference):
    body = {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "tree": "2,2,1,1"}
    whole = completion(post(url, body))
    chunks = sse_chunks(post(url, body | {"stream": True}))
    assert len(chunks) > 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference[PROMPTS[2]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"] == whole["usage"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stop_string_matches_engine(url, engine, reference):
    stop = " " + " ".join(engine.tokenizer.decode(reference[PROMPTS[3]]).split()[6:8])
    body = completion(post(url, {"prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "stop": [stop]}))
    want = engine.generate(PROMPTS[3], SamplingParams(max_new_tokens=MAX_TOKENS, stop=(stop,)))
    choice = body["choices"][0]
    assert (choice["token_ids"], choice["text"], choice["finish_reason"]) == (want.token_ids, want.text, "stop")
    assert len(want.token_ids) < MAX_TOKENS and stop not in want.text


@pytest.mark.parametrize(
    "content, status, needle",
    [
        (b'{"prompt": "w1", "max_tokens": ', 400, "not valid JSON"),
        (json.dumps({"prompt": "w1", "logprobs": 3}).encode(), 422, "logprobs: unknown field"),
        (json.dumps({"prompt": "w1", "temperature": -0.5}).encode(), 422, "temperature"),
        (json.dumps({"prompt": "w1", "max_tokens": 0}).encode(), 422, "max_tokens"),
        (json.dumps({"prompt": "w1", "top_p": 1.5}).encode(), 422, "top_p"),
        (json.dumps({"prompt": "w1", "tree": "2,x"}).encode(), 422, "tree"),
        (json.dumps({"max_tokens": 3}).encode(), 422, "prompt: Field required"),
        (json.dumps(["w1"]).encode(), 422, "invalid_request_error"),
        (json.dumps({"prompt": " ".join(["w1"] * 250), "max_tokens": 10}).encode(), 400, "context length of 256"),
        (json.dumps({"prompt": "w1", "model": "gpt-9"}).encode(), 404, "does not exist"),
        (json.dumps({"prompt": "   "}).encode(), 400, "encodes to no tokens"),
    ],
)
def test_bad_input_gets_a_clear_error(url, reference, content, status, needle):
    response = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"},
                          trust_env=False, timeout=30)  # fmt: skip
    assert response.status_code == status
    assert needle in response.text and response.json()["error"]["message"]
    ok = completion(post(url, {"prompt": PROMPTS[0], "max_tokens": 5}))  # still serving
    assert ok["choices"][0]["token_ids"] == reference[PROMPTS[0]][:5]


def test_info_endpoints(url):
    models = httpx.get(f"{url}/v1/models", trust_env=False).json()
    assert models["data"][0]["id"] == "target" and models["data"][0]["max_context"] == 256
    assert httpx.get(f"{url}/health", trust_env=False).json()["status"] == "ok"
    stats = httpx.get(f"{url}/v1/stats", trust_env=False).json()
    replicas = stats["replicas"]
    assert replicas.pop("drafter") in (1, 2) and replicas == {"router": 1, "target": 1, "bandit": 1}
    rounds = poll(lambda: sum(b["rounds"] for b in httpx.get(f"{url}/v1/bandit", trust_env=False).json()["buckets"]))
    assert rounds > 20  # the routers' records reached the shared hub


def poll(read, timeout_s: float = 10.0):
    """read() until truthy or timeout; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while not (value := read()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def drafter_replicas(url: str) -> int:
    return httpx.get(f"{url}/v1/stats", trust_env=False).json()["replicas"]["drafter"]


@pytest.mark.slow  # a new replica process takes tens of seconds to start on a busy 2-core machine
def test_load_scales_drafters_up(url):
    """Closed-loop load in 15 s phases until the second drafter replica is running (at most 2 minutes)."""
    assert poll(lambda: drafter_replicas(url) == 1, timeout_s=60)
    # every request drafts (a bandit free to choose may learn that no drafting pays best on a loaded CPU, and then
    # the drafters see little load)
    config = LoadTestConfig(url, concurrency=6, duration_s=15, prompts=tuple(PROMPTS), max_tokens=32, timeout_s=60,
                            tree="2,2,1,1")
    reports = []
    while len(reports) < 8 and (not reports or reports[-1]["replicas"][-1]["replicas"]["drafter"] < 2):
        reports.append(asyncio.run(run_loadtest(config)))
    drafters = [s["replicas"]["drafter"] for r in reports for s in r["replicas"]]
    assert drafters[0] == 1 and drafters[-1] == 2, drafters
    assert [r["errors"] for r in reports] == [{}] * len(reports)
    assert all(r["requests"]["ok"] >= 6 and r["mean_accepted_length"] > 1.5 for r in reports)


def test_eight_concurrent_requests(url, reference):
    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=120) as client:
            bodies = [{"prompt": p, "max_tokens": MAX_TOKENS, "stream": i % 2 == 1} for i, p in enumerate(PROMPTS * 2)]
            return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(go())
    for i, (prompt, response) in enumerate(zip(PROMPTS * 2, responses)):
        chunks = sse_chunks(response) if i % 2 else [completion(response)]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference[prompt]


def test_overload_is_503_and_the_rest_complete(url, reference):
    """max_ongoing_requests=8 + max_queued_requests=8: a burst of 32 long requests gets 503s for what does not fit,
    never a wrong or hung answer."""

    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            body = {"prompt": PROMPTS[0], "max_tokens": 150}
            return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body) for _ in range(32)))

    responses = asyncio.run(go())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 503} and codes.count(200) >= 8, codes
    for r in responses:
        if r.status_code == 200:
            assert r.json()["choices"][0]["token_ids"][:MAX_TOKENS] == reference[PROMPTS[0]]
    ok = completion(post(url, {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS}))
    assert ok["choices"][0]["token_ids"] == reference[PROMPTS[0]]


def test_prometheus_metrics(url):
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port

    def scrape() -> str:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False, timeout=10).text
        return text if "ray_specdec_rounds_total" in text and "ray_specdec_bandit_arm_pulls" in text else ""

    text = poll(scrape, timeout_s=30)
    for name in ("specdec_requests_total", "specdec_tokens_total", "specdec_mean_accepted_length",
                 "specdec_acceptance_rate", "specdec_seconds_total", "specdec_bandit_best_arm"):  # fmt: skip
        assert f"ray_{name}" in text


def test_bandit_state_is_persisted(url, bandit_path):
    """The hub saves every 10 s while routers push; by now the file holds the module's rounds."""
    rounds = sum(b["rounds"] for b in httpx.get(f"{url}/v1/bandit", trust_env=False).json()["buckets"])
    saved = poll(lambda: bandit_path.exists() and int(BanditState.load(bandit_path).steps.sum()), timeout_s=15)
    assert 0 < saved <= rounds
