"""The app as an OpenAI server, driven by the official `openai` client: completions and chat, streaming and not, n,
logprobs, stream_options, penalties, the model endpoints, and API-key auth. One local app with `api_key` set, of one
engine replica: it keeps the bandit and its metrics itself (no hub deployments; AppArgs.hubs)."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from scipy.stats import chisquare

from deployments import AppArgs
from ray_specdec.config import NO_TREE, SamplingParams
from ray_specdec.engine.llm import SpeculativeEngine
from ray_specdec.speculation.bandit import BanditState
from tests.helpers.bigram import PROMPTS
from tests.helpers.metrics import metric_sum, scrape_metrics
from tests.helpers.serve import serve_app

KEY = "sk-test-key"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def bandit_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bandit") / "bandit.json"


@pytest.fixture(scope="module")
def url(model_dirs, bandit_path):
    target, drafter = model_dirs
    args = AppArgs(target=str(target), drafter=str(drafter), model_name="tiny", api_key=KEY, kv_budget_tokens=8192,
                   bandit_path=str(bandit_path))  # fmt: skip
    with serve_app(args) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, http_client=httpx.Client(trust_env=False, timeout=120))


def test_a_missing_or_wrong_key_is_401_in_openais_shape(url):
    for headers in ({}, {"Authorization": "Bearer nope"}):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "w1"}, headers=headers, trust_env=False,
                              timeout=30)  # fmt: skip
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/health", trust_env=False, timeout=30).status_code == 200  # health stays open
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", http_client=httpx.Client(trust_env=False, timeout=30))
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="w1", max_tokens=2)


def test_completions_greedy_and_streamed_equal_the_engine(client, engine):
    expected = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=MAX_TOKENS))
    done = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].text == expected.text and done.usage.completion_tokens == MAX_TOKENS
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_n_samples_with_a_seed_are_the_engines_whatever_the_tree(client, engine):
    """Choice j of a seeded sampled request is the engine's draw under the key (seed, j) (coupled sampling): the same
    text with the tree the request asks for, none, or the engine's own."""
    done = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=1.0, n=3, seed=5,
                                     extra_body={"tree": "2,1"})  # fmt: skip
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert len({c.text for c in done.choices}) > 1
    for j, choice in enumerate(done.choices):
        params = SamplingParams(temperature=1.0, seed=5, choice=j, max_new_tokens=12)
        alone = engine.generate(PROMPTS[1], params, NO_TREE).text
        assert choice.text == alone == engine.generate(PROMPTS[1], params).text
    assert done.usage.completion_tokens == 3 * 12


def test_the_same_seeded_request_gets_the_same_text_under_any_load(client):
    """One seeded request sent alone, twice, with `tree` none, and among 12 concurrent others: one text."""
    body = dict(model="tiny", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.95, seed=77)
    first = client.completions.create(**body).choices[0].text
    assert client.completions.create(**body).choices[0].text == first
    assert client.completions.create(**body, extra_body={"tree": "none"}).choices[0].text == first
    others = [dict(body, prompt=PROMPTS[i % len(PROMPTS)], seed=i, temperature=0.8 + 0.1 * (i % 3)) for i in range(12)]
    with ThreadPoolExecutor(13) as pool:
        loaded = pool.submit(client.completions.create, **body, extra_body={"tree": "3,2,1"})
        for other in [pool.submit(client.completions.create, **o) for o in others]:
            other.result()
        assert loaded.result().choices[0].text == first


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 5, 1.0), (0.6, 5, 1.0), (1.5, 4, 0.9)])
def test_seeded_sampling_through_http_has_the_targets_distribution(url, temperature, top_k, top_p):
    """The first token of 800 seeded choices (50 seeds, n = 16: key (seed, choice) each), drafted with a tree,
    against the target's distribution there after temperature, top-k and top-p, computed from the raw logprobs the
    responses return (the top-k of them: all the mass top-k leaves). Chi-square, rare outcomes pooled."""
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": temperature, "top_k": top_k,
            "top_p": top_p, "logprobs": top_k, "n": 16, "tree": "2,2,1"}

    def send(seed: int) -> list[dict]:
        response = httpx.post(f"{url}/v1/completions", json={**body, "seed": seed},
                              headers={"Authorization": f"Bearer {KEY}"}, trust_env=False, timeout=300)
        assert response.status_code == 200, response.text
        return [choice["logprobs"] for choice in response.json()["choices"]]

    counts, raw = Counter(), None
    with ThreadPoolExecutor(8) as pool:
        for choices in pool.map(send, range(50)):
            for logprobs in choices:
                raw = raw or logprobs["top_logprobs"][0]
                assert logprobs["top_logprobs"][0] == pytest.approx(raw, abs=1e-5)
                counts[logprobs["tokens"][0]] += 1
    tokens = sorted(raw, key=raw.get, reverse=True)
    p = np.exp((np.array([raw[t] for t in tokens]) - raw[tokens[0]]) / temperature)
    p /= p.sum()
    keep = np.cumsum(p) - p < top_p  # top-p after top-k: the smallest prefix whose mass reaches top_p
    p = np.where(keep, p, 0.0) / p[keep].sum()
    assert set(counts) <= {t for t, kept in zip(tokens, keep) if kept}
    observed, expected = np.array([counts[t] for t in tokens]), p * 800
    big = expected >= 5
    observed = np.append(observed[big], observed[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    assert chisquare(observed[expected > 0], expected[expected > 0]).pvalue > 0.01


def test_logprobs_are_the_targets_with_drafting_on_or_off(client, url):
    def logprobs(tree):
        body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "logprobs": 2}
        if tree:
            body["tree"] = tree
        response = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                              trust_env=False, timeout=120)  # fmt: skip
        return response.json()["choices"][0]["logprobs"]

    drafted, plain = logprobs("2,2,1"), logprobs("none")
    assert drafted["tokens"] == plain["tokens"] and len(drafted["token_logprobs"]) == 12
    assert drafted["token_logprobs"] == pytest.approx(plain["token_logprobs"], abs=1e-5)
    assert all(len(top) == 2 for top in drafted["top_logprobs"])
    done = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=2)
    assert done.choices[0].logprobs.tokens == plain["tokens"]


def test_penalties_through_http_equal_the_engine(client, engine):
    params = SamplingParams(max_new_tokens=MAX_TOKENS, presence_penalty=1.5, frequency_penalty=0.5)
    expected = engine.generate(PROMPTS[3], params).text
    done = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                                     presence_penalty=1.5, frequency_penalty=0.5)  # fmt: skip
    assert done.choices[0].text == expected
    plain = SpeculativeEngine(engine.target, None).generate(PROMPTS[3], params).text
    assert expected == plain


def test_chat_renders_the_template_and_streams_deltas(client, engine):
    messages = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": PROMPTS[0]}]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = engine.generate(engine.tokenizer(ids, add_special_tokens=False)["input_ids"],
                               SamplingParams(max_new_tokens=MAX_TOKENS)).text  # fmt: skip
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert done.choices[0].message.role == "assistant" and done.choices[0].message.content == expected
    assert done.choices[0].finish_reason == "length"
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))  # fmt: skip
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_unsupported_fields_and_other_models_get_clear_errors(client):
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="w1", max_tokens=2)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_metrics_are_open_and_move_by_what_the_requests_did(url):
    """GET /metrics needs no key; after three completions (one tree each: fixed, none, the bandit's), the counters
    and histograms moved by exactly what the responses report. Engines push about once a second: poll."""
    served = "ray_specdec:router_requests_total"

    def settled() -> dict | None:
        """A scrape in which every choice the routes served is in the engines' numbers too."""
        s = scrape_metrics(url)
        ended = sum(metric_sum(s, "ray_specdec:request_success_total", finished_reason=r) for r in ("stop", "length"))
        return s if ended == metric_sum(s, served, status="ok") else None

    def poll(read, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while not (value := read()):
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.2)
        return value

    before = poll(settled)
    bodies = []
    for prompt, tree in zip(PROMPTS, ("2,1", "none", None)):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        body |= {"tree": tree} if tree else {}
        response = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                              trust_env=False, timeout=120)  # fmt: skip
        bodies.append(response.json())
    served_before = metric_sum(before, served, status="ok")
    after = poll(lambda: (s := settled()) and metric_sum(s, served, status="ok") == served_before + 3
                 and metric_sum(s, "ray_specdec:bandit_arm_pulls") > 0 and s)  # the bandit hub syncs every second

    def moved(name: str, **labels) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    trees = Counter()
    for b in bodies:
        trees.update(b["speculative"]["trees"])
    accepted = sum(round((b["speculative"]["mean_accepted_length"] - 1) * b["speculative"]["rounds"]) for b in bodies)
    assert moved("ray_specdec:request_success_total", finished_reason="length") == 3
    assert moved("ray_specdec:prompt_tokens_total") == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert moved("ray_specdec:generation_tokens_total") == sum(b["usage"]["completion_tokens"] for b in bodies) == 48
    for tree, rounds in trees.items():
        assert moved("ray_specdec:rounds_total", tree=tree) == rounds
    assert moved("ray_specdec:spec_decode_num_drafts_total") == trees.total() - trees["none"] > 0
    assert moved("ray_specdec:spec_decode_num_accepted_tokens_total") == accepted > 0
    assert moved("ray_specdec:spec_decode_num_draft_tokens_total") >= accepted
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert moved(f"ray_specdec:{name}_count") == 3 and moved(f"ray_specdec:{name}_bucket", le="+Inf") == 3
    assert moved("ray_specdec:inter_token_latency_seconds_count") == trees.total() - 3
    assert metric_sum(after, "ray_specdec:num_requests_running") == 0


def readme_block(after: str, language: str) -> str:
    """The first ```language block of the README after the line containing `after`."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rest = text[text.index(after):]
    start = rest.index(f"```{language}\n") + len(language) + 4
    return rest[start:rest.index("```", start)]


def test_the_only_replica_keeps_the_bandit_and_saves_it(url, bandit_path):
    """No hub deployment runs; /v1/bandit reads the replica's own bandit, which its rounds moved, and the replica
    saves it to bandit_path every 10 s."""
    stats = httpx.get(f"{url}/v1/stats", trust_env=False, timeout=30).json()
    assert stats["replicas"] == {"engine": 1}

    def rounds() -> int:
        return sum(b["rounds"] for b in httpx.get(f"{url}/v1/bandit", trust_env=False, timeout=30).json()["buckets"])

    before = rounds()
    # sampled rounds of a tree among the bandit's arms: each whole one is a record (a bandit-picked greedy round the
    # controller runs undrafted may not be)
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 16, "temperature": 0.8, "seed": 3, "tree": "1,1"}
    response = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          trust_env=False, timeout=120)  # fmt: skip
    assert response.status_code == 200, response.text
    own = response.json()["speculative"]["trees"].get("1,1", 0)
    after = rounds()
    assert own > 0 and after >= before + own  # the request's rounds, at once (no hub to sync with)
    # the replica saves every 10 s from its event loop (on a thread): a minute leaves room for a loaded machine
    deadline = time.monotonic() + 60
    while not (bandit_path.exists() and int(BanditState.load(bandit_path).steps.sum()) >= after):
        assert time.monotonic() < deadline, "the bandit state was not saved"
        time.sleep(0.5)
    assert int(BanditState.load(bandit_path).steps.sum()) <= rounds()


def test_the_readmes_curl_and_openai_examples_run(url, monkeypatch, capsys):
    """README, "Calling it": both examples, pointed at this app (its address, model name and key)."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    curl = readme_block("## Calling it", "bash").replace("http://127.0.0.1:8000", url).replace("\\\n", " ")
    curl = curl.replace("curl -s", f"curl -s -H 'Authorization: Bearer {KEY}'", 1)
    done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 64
    snippet = readme_block("Or with the official `openai` client", "python")
    snippet = snippet.replace("http://127.0.0.1:8000", url).replace('api_key="unused"', f'api_key="{KEY}"')
    exec(compile(snippet.replace('model="target-neox"', 'model="tiny"'), "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and all(printed)  # the completion's text, then the streamed chat's
