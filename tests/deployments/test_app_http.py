"""The Serve app over real HTTP: one local Ray (2 CPUs), tiny float32 models, two apps for the whole module.

- "specdec" at /: engine replicas (the round loop beside the target and its drafter) autoscale between 1 and 2 (target
  2 requests in flight per replica, 1 s upscale delay). Engine replicas are what scales now: each is a data-parallel
  copy of the whole pipeline, and drafters no longer exist apart from them. The load test shows the second replica
  coming under closed-loop load, with every answer exact. Greedy outputs do not depend on the replica, nor on what
  else shares a step (batch invariance); seeded sampling does not either (same models, the request's own streams).
- "kv" at /kv: a KV budget that holds two requests and a queue of two: admission control over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from deployments import AppArgs
from ray_specdec.config import SamplingParams, TreeConfig
from ray_specdec.speculation.bandit import BanditState
from ray_specdec.tools.loadtest import LoadTestConfig, run_loadtest
from tests.helpers.bigram import PROMPTS, WORDS, greedy_reference
from tests.helpers.metrics import metric_sum, scrape_metrics
from tests.helpers.reference import greedy_margin
from tests.helpers.serve import post, serve_app, sse_chunks

MAX_TOKENS = 40
# The /kv app: greedy requests of KV_PROMPT (5 tokens), without drafting, reserve prompt + KV_TOKENS + 1 rows: two fit
# the budget, which is below the context (256), so that a request within the context can still never fit.
KV_PROMPT, KV_TOKENS = PROMPTS[0], 110
KV_BUDGET = 2 * (5 + KV_TOKENS + 1) + 8
KV_MAX_WAITING = 2
KV_TRIES = 5  # pairs sent until two run together (test_kv_budget_queues_then_answers_503)
BURST_N = (1, 1, 1, 2)  # choices (n) of the burst's requests, by position modulo 4
BANDIT_ARM = "1,1"  # a tree among the bandit's default arms: its rounds are the bandit's records
# Records reach the bandit hub within a sync interval (1 s) and the hub's answer (up to 10 s, then the push is
# retried): a minute leaves room for a couple of failed pushes on a loaded machine.
HUB_SYNC_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def bandit_path(tmp_path_factory):
    return tmp_path_factory.mktemp("bandit") / "bandit.json"


@pytest.fixture(scope="module")
def url(model_dirs, bandit_path):
    target, drafter = model_dirs
    args = AppArgs(
        target=str(target), drafter=str(drafter), num_cpus_per_rank=0.5, min_replicas=1, max_replicas=2,
        target_ongoing_requests=2, upscale_delay_s=1, downscale_delay_s=600, look_back_period_s=2,
        bandit_path=str(bandit_path),
    )  # fmt: skip
    kv = AppArgs(target=str(target), drafter=str(drafter), num_cpus_per_rank=0.5, tree="none", lookup=0,
                 kv_budget_tokens=KV_BUDGET, max_waiting=KV_MAX_WAITING)  # fmt: skip
    with serve_app(args, more={"kv": kv}) as base:
        yield base


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    return greedy_reference(engine, MAX_TOKENS)


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
        n = len(engine.encode(prompt))
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]  # prompts seen before are found whole
        assert body["usage"] == {"prompt_tokens": n, "completion_tokens": MAX_TOKENS, "total_tokens": n + MAX_TOKENS,
                                 "prompt_tokens_details": {"cached_tokens": cached}} and cached in (0, n - 1)
        # Whether a bandit-picked request drafts is the speculation controller's call (it acts on measured step
        # times, which a loaded machine moves): only consistency here.
        drafted = sum(n for tree, n in spec["trees"].items() if tree != "none")
        assert sum(spec["trees"].values()) == spec["rounds"] and spec["mean_accepted_length"] >= 1
        assert drafted or spec["mean_accepted_length"] == 1
    fixed = completion(post(url, {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "tree": "3,2,1"}))
    spec = fixed["speculative"]  # a client's tree drafts whatever the policy measured: greedy acceptance is exact
    assert fixed["choices"][0]["token_ids"] == reference[PROMPTS[1]] and spec["mean_accepted_length"] > 1.5
    assert {t.split("+")[0] for t in spec["trees"]} <= {"3,2,1", "3,2", "3"}
    assert sum(spec["trees"].values()) == spec["rounds"]
    alone = completion(post(url, {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "tree": "none"}))
    assert alone["choices"][0]["token_ids"] == reference[PROMPTS[0]]
    assert alone["speculative"]["rounds"] == MAX_TOKENS and alone["speculative"]["trees"] == {"none": MAX_TOKENS}


def test_streaming_yields_the_same_text(url, engine, reference):
    body = {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "tree": "2,2,1,1"}
    whole = completion(post(url, body))
    chunks = sse_chunks(post(url, body | {"stream": True, "stream_options": {"include_usage": True}}))
    usage = chunks.pop()  # include_usage: a last chunk with no choices, as OpenAI sends it
    # the same prompt again: every prefill row is found in the prefix cache (all but the last token, the first root)
    cached = len(engine.encode(PROMPTS[2])) - 1
    assert usage["choices"] == []
    assert usage["usage"] == whole["usage"] | {"prompt_tokens_details": {"cached_tokens": cached}}
    assert len(chunks) > 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == reference[PROMPTS[2]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"] is None
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
        (json.dumps({"prompt": "w1", "logprobz": 3}).encode(), 400, "logprobz: unknown field"),
        (json.dumps({"prompt": "w1", "temperature": -0.5}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "w1", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "w1", "top_p": 1.5}).encode(), 400, "top_p"),
        (json.dumps({"prompt": "w1", "tree": "2,x"}).encode(), 400, "tree"),
        (json.dumps({"max_tokens": 3}).encode(), 400, "prompt: Field required"),
        (json.dumps(["w1"]).encode(), 400, "invalid_request_error"),
        (json.dumps({"prompt": " ".join(["w1"] * 250), "max_tokens": 10}).encode(), 400, "context length of 256"),
        (json.dumps({"prompt": "w1", "model": "gpt-9"}).encode(), 404, "does not exist"),
        (json.dumps({"prompt": "   "}).encode(), 400, "encodes to no tokens"),
        (b'{"prompt": "w1 \\ud800", "max_tokens": 3}', 400, "prompt is not valid Unicode text"),  # was a 500
    ],
)
def test_bad_input_gets_a_clear_error(url, reference, content, status, needle):
    response = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"},
                          trust_env=False, timeout=30)  # fmt: skip
    assert response.status_code == status
    assert needle in response.text and response.json()["error"]["message"]
    ok = completion(post(url, {"prompt": PROMPTS[0], "max_tokens": 5}))  # still serving
    assert ok["choices"][0]["token_ids"] == reference[PROMPTS[0]][:5]


def test_unknown_routes_and_methods_answer_in_openais_error_shape(url):
    """Starlette's own 404 and 405 came as FastAPI's {"detail": ...}, which OpenAI clients cannot read."""
    missing = httpx.post(f"{url}/v1/embeddings", json={"input": "w1"}, trust_env=False, timeout=30)
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Not Found (POST /v1/embeddings)"
    wrong = httpx.get(f"{url}/v1/completions", trust_env=False, timeout=30)
    assert wrong.status_code == 405 and "POST" in wrong.headers["allow"]
    assert wrong.json()["error"]["type"] == "invalid_request_error"


def test_info_endpoints(url):
    models = get(url, "/v1/models")
    assert models["data"][0]["id"] == "target" and models["data"][0]["max_context"] == 256
    health = httpx.get(f"{url}/health", timeout=30, trust_env=False)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    # the controller's count (None while the controller is too busy to answer /health in time: asked again)
    assert poll(lambda: get(url, "/health")["engine_replicas"], timeout_s=30) >= 1
    stats = get(url, "/v1/stats")
    replicas = stats["replicas"]
    assert replicas.pop("engine") in (1, 2) and replicas == {"bandit": 1, "metrics": 1}  # engine mode: no router
    assert stats["engine"]["healthy"] is True and stats["engine"]["kv_budget"] > 0
    speculation = stats["engine"]["speculation"]  # None until the replica has stepped (tests/serving: the values)
    assert speculation is None or "fixed" in speculation["cost_weights"]
    # Rounds this test knows its engine recorded: sampled ones of an arm's whole tree (a greedy round may carry
    # prompt-lookup tokens, a bandit-picked one may not draft, a last round's tree may be cut: such rounds may go
    # unrecorded). The engines push their records to the hub every second; a push waits up to 10 s for the hub and
    # keeps its records for the next one when it fails: on a loaded machine that takes a while.
    before, own = bandit_rounds(url), 0
    for seed in range(10):
        body = {"prompt": PROMPTS[seed % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": seed,
                "tree": BANDIT_ARM}  # fmt: skip
        own += completion(post(url, body))["speculative"]["trees"].get(BANDIT_ARM, 0)
        if own > 20:
            break
    assert own > 20
    synced = poll(lambda: bandit_rounds(url) >= before + own, timeout_s=HUB_SYNC_WITHIN_S)
    assert synced, (before, own, bandit_rounds(url))  # the engines' records reached the shared hub


def get(url: str, path: str) -> dict:
    return httpx.get(f"{url}{path}", timeout=30, trust_env=False).json()


def bandit_rounds(url: str) -> int:
    """The rounds the shared hub holds, over every cell."""
    return sum(b["rounds"] for b in get(url, "/v1/bandit")["buckets"])


def poll(read, timeout_s: float = 10.0):
    """read() until truthy or timeout; returns the last value."""
    deadline = time.monotonic() + timeout_s
    while not (value := read()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def engine_replicas(url: str) -> int:
    return get(url, "/v1/stats")["replicas"]["engine"]


def test_load_scales_engine_replicas_up(url):
    """Closed-loop load in 10 s phases until the second engine replica is running (at most 80 s)."""
    assert engine_replicas(url) == 1  # the tests before sent one request at a time
    config = LoadTestConfig(url, concurrency=6, duration_s=10, prompts=tuple(PROMPTS), max_tokens=32, timeout_s=60,
                            tree="2,2,1,1")  # fmt: skip
    reports = []
    while len(reports) < 8 and (not reports or reports[-1]["replicas"][-1]["replicas"]["engine"] < 2):
        reports.append(asyncio.run(run_loadtest(config)))
    engines = [s["replicas"]["engine"] for r in reports for s in r["replicas"]]
    assert engines[0] == 1 and engines[-1] == 2, engines
    assert [r["errors"] for r in reports] == [{}] * len(reports)
    assert all(r["requests"]["ok"] >= 6 and r["mean_accepted_length"] > 1.5 for r in reports)


def mixed_requests(n: int = 24) -> list[dict]:
    """Greedy bodies of mixed prompt lengths (1 to 200 tokens), max_tokens, trees and streaming; seeded."""
    rng = random.Random(5)
    lengths, trees = [1, 2, 5, 9, 17, 33, 64, 120, 200], [None, "none", "3,2,1", "1,1,1,1", "2,2,1", "1,1+L6"]
    bodies = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        body = {"prompt": " ".join(rng.choice(WORDS) for _ in range(length)),
                "max_tokens": rng.choice([8, 16, 24, 40]) if length < 200 else 16, "stream": i % 3 == 2}  # fmt: skip
        if trees[i % len(trees)] is not None:
            body["tree"] = trees[i % len(trees)]
        bodies.append(body)
    return bodies


def test_concurrent_mixed_requests_give_exactly_what_each_gets_alone(url, engine):
    """24 greedy requests at once over both engine replicas, sharing steps with each other's prefills and trees:
    each gets exactly the tokens the in-process engine gives it alone (issue 18, Proof)."""
    bodies = mixed_requests()
    alone = []
    for body in bodies:
        tree = TreeConfig.parse(body["tree"]) if "tree" in body else None
        want = engine.generate(body["prompt"], SamplingParams(max_new_tokens=body["max_tokens"]), tree).token_ids
        assert greedy_margin(engine.target.model, engine.encode(body["prompt"]), want) > 1e-3
        alone.append(want)

    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=b) for b in bodies))

    for body, want, response in zip(bodies, alone, asyncio.run(go()), strict=True):
        chunks = sse_chunks(response) if body["stream"] else [completion(response)]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def kv_stats(url: str) -> dict:
    return httpx.get(f"{url}/kv/v1/stats", trust_env=False, timeout=30).json()["engine"]


def test_kv_budget_queues_then_answers_503(url, engine):
    """Two requests fill the KV budget; of a burst of 14 more, those beyond the queue bound get 503 with Retry-After
    (streams too: before their first token, so as an HTTP status); none gets a 500; every admitted one is exact.
    Every fourth asks for two choices: one may be queued and the other refused, and then the queued one is
    cancelled, not left running unread (a stream refused that way was a 500), so that nothing runs after the last
    answer."""
    want = engine.generate(KV_PROMPT, SamplingParams(max_new_tokens=KV_TOKENS), TreeConfig(())).token_ids
    assert greedy_margin(engine.target.model, engine.encode(KV_PROMPT), want) > 1e-3
    body = {"prompt": KV_PROMPT, "max_tokens": KV_TOKENS}

    async def go():
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            # the two must run together; on a loaded machine one may end before the other starts: then try again
            for _ in range(KV_TRIES):
                first = [asyncio.create_task(client.post(f"{url}/kv/v1/completions", json=body)) for _ in range(2)]
                deadline = time.monotonic() + 60
                while not any(f.done() for f in first) and (await asyncio.to_thread(kv_stats, url))["running"] < 2:
                    assert time.monotonic() < deadline, "the two requests did not run within 60 s"
                    await asyncio.sleep(0.02)
                if not any(f.done() for f in first):  # the budget is full
                    break
                for response in await asyncio.gather(*first):  # one ended first: it still ended right
                    assert response.status_code == 200 and completion(response)["choices"][0]["token_ids"] == want
            else:
                pytest.fail(f"in {KV_TRIES} tries the two requests never ran together")
            burst = [client.post(f"{url}/kv/v1/completions", json=body | {"stream": i % 2 == 1, "n": BURST_N[i % 4]})
                     for i in range(14)]  # fmt: skip
            return await asyncio.gather(*first, *burst)

    responses = asyncio.run(go())
    codes = [r.status_code for r in responses]
    choices = [1, 1] + [BURST_N[i % 4] for i in range(14)]
    assert codes[:2] == [200, 200] and set(codes) == {200, 503}, codes
    # the queue took some while the budget was full
    assert sum(n for n, code in zip(choices, codes) if code == 200) >= 2 + KV_MAX_WAITING
    for i, (response, n) in enumerate(zip(responses, choices)):
        if response.status_code == 503:
            assert response.headers["retry-after"] and "retry later" in response.json()["error"]["message"]
            continue
        chunks = sse_chunks(response) if i >= 2 and (i - 2) % 2 == 1 else [completion(response)]
        for index in range(n):  # greedy: every choice is the same
            assert [t for c in chunks for ch in c["choices"] if ch["index"] == index for t in ch["token_ids"]] == want
    stats = kv_stats(url)
    assert (stats["running"], stats["waiting"], stats["kv_reserved"]) == (0, 0, 0)  # everything was freed


@pytest.mark.parametrize("stream", [False, True])
def test_more_choices_than_the_queue_takes_get_400(url, stream):
    """Every choice is queued before any is admitted, so a request of more than max_waiting could only ever get 503:
    400 instead, naming the bound, and nothing of it runs."""
    response = post(f"{url}/kv", {"prompt": KV_PROMPT, "max_tokens": 5, "n": KV_MAX_WAITING + 1, "temperature": 1,
                                  "stream": stream})  # fmt: skip
    assert response.status_code == 400, response.text
    assert f"{KV_MAX_WAITING + 1} sequences" in response.json()["error"]["message"]
    assert "max_waiting" in response.json()["error"]["message"]
    stats = kv_stats(url)
    assert (stats["running"], stats["waiting"], stats["kv_reserved"]) == (0, 0, 0)
    ok = post(f"{url}/kv", {"prompt": KV_PROMPT, "max_tokens": 5, "n": KV_MAX_WAITING, "temperature": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == KV_MAX_WAITING


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_can_never_fit_the_kv_budget_gets_400(url, stream):
    response = post(f"{url}/kv", {"prompt": KV_PROMPT, "max_tokens": KV_BUDGET, "stream": stream})
    assert response.status_code == 400, response.text
    assert f"the KV budget is {KV_BUDGET} rows" in response.json()["error"]["message"]


def test_metrics_of_every_replica_come_from_any_replica(url):
    """GET /metrics (whichever replica answers) holds every engine replica's numbers, pushed to the metrics hub:
    the engines' finished requests add up to the choices the routes served, and each replica has its gauges."""
    served = "ray_specdec:router_requests_total"

    def read():
        s = scrape_metrics(url)
        replicas = {dict(labels)["replica"] for name, labels in s if name == "ray_specdec:num_requests_running"}
        ended = sum(metric_sum(s, "ray_specdec:request_success_total", finished_reason=r) for r in ("stop", "length"))
        return s if len(replicas) == engine_replicas(url) > 1 and ended == metric_sum(s, served, status="ok") else None

    samples = poll(read, timeout_s=30)
    assert samples, "no scrape with every replica's numbers"
    assert metric_sum(samples, "ray_specdec:spec_decode_num_accepted_tokens_total") > 0
    assert metric_sum(samples, "ray_specdec:time_to_first_token_seconds_count") > 0
    assert metric_sum(samples, "ray_specdec:bandit_best_arm") >= 1


def test_a_streaming_client_that_leaves_aborts_its_request(url):
    """A client that closes its stream after the first chunk: the server notices (Serve cancels the response, whose
    body then closes: serving/event_stream.py) and the engine ends the request as "abort" rather than running it to
    its max_tokens."""
    body = {"max_tokens": 200, "temperature": 0}
    finish = {p: post(url, body | {"prompt": p}).json()["choices"][0]["finish_reason"] for p in PROMPTS}
    prompt = next(p for p, reason in finish.items() if reason == "length")  # one that runs to max_tokens

    def aborted() -> float:
        return metric_sum(scrape_metrics(url), "ray_specdec:request_success_total", finished_reason="abort")

    def settled() -> tuple[float] | None:  # the same count twice, the metrics push (every second) in between
        first = aborted()
        time.sleep(2.5)
        return (first,) if aborted() == first else None

    before = poll(settled, timeout_s=30)
    assert before, "the abort count did not settle"
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"prompt": prompt, "stream": True}, timeout=60,
                      trust_env=False) as response:  # fmt: skip
        assert response.status_code == 200
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
    assert poll(lambda: aborted() == before[0] + 1, timeout_s=30)


def test_bandit_state_is_persisted(url, bandit_path):
    """The hub saves at a push 10 s or more after its last save, and the engines push every second: by now the file
    holds the module's rounds, and no more than the hub does (read after the file: the hub's count only grows)."""
    saved = poll(lambda: bandit_path.exists() and int(BanditState.load(bandit_path).steps.sum()), timeout_s=30)
    assert 0 < saved <= bandit_rounds(url)
