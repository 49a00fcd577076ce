"""A tiny target / Mamba drafter pair that agree often, saved to a tmp dir with a 128-word tokenizer.

Random tiny models almost never agree, which would leave the accepted paths and the drafter's commit over the wire
untested. Here both models share one embedding table and an output head built from a "bigram" successor table, so
the drafter proposes what the target mostly predicts; the target's attention and MLP (scaled up) make it depart from
the bigram in a context-dependent way, so rounds see full, partial and no acceptance, and the target's KV cache
matters. The successor table is a permutation of the word tokens (long cycles: varied text; never <eos> or <unk>), so
generations run to max_tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import httpx
import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM, PreTrainedModel

from ray_specdec.defaults import CHAT_TEMPLATE
from ray_specdec.engine import SpeculativeEngine
from ray_specdec.models.mamba_drafter import MambaDrafter
from ray_specdec.models.target import TargetModel
from tests.tiny_models import tiny_gpt_neox, tiny_tokenizer

VOCAB, HIDDEN = 128, 64
WORDS = [f"w{i}" for i in range(VOCAB - 2)]  # + <eos> (id 0, the target's EOS) and <unk>: 128 ids
PROMPTS = ["w3 w14 w15 w92 w65", "w35 w89 w79 w32 w38 w46", "w26 w43 w38", "w32 w79 w50 w28 w84 w19 w71"]
LOGIT_GAIN = 16.0  # scale of the bigram logits: larger margins between the top tokens
MIX_GAIN = 1.5  # scale of every attention / MLP / mixer output: how far the models stray from the bigram


def bigram_pair(seed: int = 0) -> tuple[PreTrainedModel, MambaForCausalLM]:
    """(GPTNeoX target, Mamba drafter), float32, sharing embeddings and a bigram output head."""
    g = torch.Generator().manual_seed(seed)
    target = tiny_gpt_neox(torch.float32, vocab=VOCAB, hidden=HIDDEN, seed=seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    embed -= embed.mean(dim=1, keepdim=True)  # zero-mean rows: LayerNorm and RMSNorm agree on them
    normed = embed / embed.pow(2).mean(dim=1, keepdim=True).sqrt()  # [V, H]
    successor = torch.cat([torch.randint(2, VOCAB, (2,), generator=g), 2 + torch.randperm(VOCAB - 2, generator=g)])
    head = torch.zeros(VOCAB, HIDDEN).index_add_(0, successor, normed) * (LOGIT_GAIN / HIDDEN)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, state_size=8, expand=2,
                         conv_kernel=4, initializer_range=0.1, tie_word_embeddings=False, eos_token_id=0)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        drafter = MambaForCausalLM(config).eval()
    with torch.no_grad():
        target.get_input_embeddings().weight.copy_(embed)
        target.get_output_embeddings().weight.copy_(head)
        target.gpt_neox.final_layer_norm.weight.fill_(1.0)
        target.gpt_neox.final_layer_norm.bias.zero_()
        drafter.backbone.embeddings.weight.copy_(embed)
        drafter.lm_head.weight.copy_(head)
        drafter.backbone.norm_f.weight.fill_(1.0)
        outputs = [p for layer in target.gpt_neox.layers for p in (*layer.attention.dense.parameters(),
                                                                  *layer.mlp.dense_4h_to_h.parameters())]
        outputs += [layer.mixer.out_proj.weight for layer in drafter.backbone.layers]
        for p in outputs:
            p.mul_(MIX_GAIN)
    return target, drafter


def word_tokenizer():
    tokenizer = tiny_tokenizer([" ".join(WORDS)])
    tokenizer.chat_template = CHAT_TEMPLATE  # the shipped models' (their role markers encode to <unk> words here)
    return tokenizer


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(target dir with tokenizer, drafter dir), saved once per test session."""
    root = tmp_path_factory.mktemp("models")
    target, drafter = bigram_pair()
    tokenizer = word_tokenizer()
    assert len(tokenizer) == VOCAB
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    # as the shipped models' config says: decode greedily unless a request sets a temperature (the app's default)
    (root / "target" / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 0}))
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture(scope="session")
def engine(model_dirs) -> SpeculativeEngine:
    """The in-process engine over the saved models (the reference for serving outputs)."""
    target_dir, drafter_dir = model_dirs
    target = TargetModel.from_pretrained(str(target_dir))
    return SpeculativeEngine(target, MambaDrafter.from_pretrained(str(drafter_dir)))


def greedy_margin(target: TargetModel, prompt_ids: list[int], generated: list[int]) -> float:
    """Smallest top-1 minus top-2 target logit along a greedy path: float32 tree and single-token forwards may
    disagree in the last bits, so exact-equality tests must not sit on a near-tie."""
    ids = torch.tensor(prompt_ids + generated)
    with torch.no_grad():
        logits = target.model(ids[None]).logits[0, len(prompt_ids) - 1 : -1]
    top = logits.topk(2, dim=-1).values
    return float((top[:, 0] - top[:, 1]).min())


def greedy_reference(engine: SpeculativeEngine, max_tokens: int) -> dict[str, list[int]]:
    """Target-alone greedy ids of each of PROMPTS, checked to sit on paths without float32 near-ties."""
    from ray_specdec.config import SamplingParams

    alone = SpeculativeEngine(engine.target, None)
    out = {}
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        out[prompt] = alone.generate(ids, SamplingParams(max_new_tokens=max_tokens)).token_ids
        assert greedy_margin(engine.target, ids, out[prompt]) > 1e-3
    return out


# ---- Ray Serve apps for the HTTP tests --------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
# Workers import this checkout; autoscaling metrics are pushed every second (default 10 s) so tests see scaling soon;
# the proxy gets a minute to come up (default 5 s: too short when a shared 2-core box is busy).
RAY_ENV = {
    "PYTHONPATH": str(REPO),
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(args, address: str | None = None, num_cpus: int = 2, more: dict[str, object] | None = None,
              env: dict[str, str] | None = None):
    """Start Ray (or join `address`), Serve on a free loopback port and the app; yield its base URL. `more`: other
    apps, by name, served beside it at /<name>; `env`: more environment for this Ray alone (Serve's own settings)."""
    import ray
    from ray import serve

    from deployments import app

    os.environ.update(RAY_ENV)  # for the driver's own handles too
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # a Ray started here inherits them; the workers get them with RAY_ENV
    ray_env = RAY_ENV | (env or {})
    if address is None:
        ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": ray_env},
                 _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
    else:
        ray.init(address=address, runtime_env={"env_vars": ray_env})
    port = free_port()
    try:
        # one HTTP proxy, on the head: simulated nodes share this machine's ports
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        for name, more_args in (more or {}).items():
            serve.run(app(more_args), name=name, route_prefix=f"/{name}")
        serve.run(app(args), name="specdec", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        for k, v in saved.items():  # the next Ray of this test session starts without them
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def post(url: str, body, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, trust_env=False)


def scrape_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics (no API key), parsed: {(sample name, sorted label pairs): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics", timeout=60, trust_env=False)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}  # fmt: skip


def metric_sum(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of a scrape's samples named `name` whose labels include `labels`."""
    return sum(v for (n, pairs), v in samples.items() if n == name and labels.items() <= dict(pairs).items())


def sse_chunks(response: httpx.Response) -> list:
    """The JSON chunks of a server-sent event stream, checking it ends with [DONE]."""
    data = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]
