"""The Mamba, Mamba2, Jamba and Bamba target (models/target/ssm.py): tree verification through its SSM layers (and a
hybrid's attention layers) against HF's forward along every path, the committed state against a prefill of the
accepted tokens, batched and chunked forwards against single ones, the prefix cache's states, and loading
(unsupported classes refused with what is supported)."""

from __future__ import annotations

import pytest
import torch
from transformers import FalconMambaConfig, NemotronHConfig, RwkvConfig, RwkvForCausalLM, Zamba2Config

from transformers import BambaForCausalLM, JambaForCausalLM, Mamba2ForCausalLM

from ray_specdec.config import SamplingParams
from ray_specdec.engine.target_backend import LocalTarget
from ray_specdec.factory import LoadError, load_engine, load_target
from ray_specdec.models.target.forward_layout import Segment
from ray_specdec.models.native import library
from ray_specdec.models.target.kinds import UnsupportedTarget, load_target_model
from ray_specdec.models.target.ssm import SSMTargetModel
from ray_specdec.serving import target_worker
from ray_specdec.speculation.tree import build_tree
from tests.helpers.inputs import random_prompt
from tests.helpers.models import SSM_TARGETS, tiny_llama, tiny_mamba2_lm, tiny_mamba_lm, tiny_tokenizer

TREES = [[], [(0,), (0, 0), (0, 0, 0)], [(0,), (1,), (2,), (3,)],
         [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)]]


@pytest.fixture(scope="module", params=sorted(SSM_TARGETS))
def target(request) -> SSMTargetModel:
    return SSMTargetModel(SSM_TARGETS[request.param]())


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double()


def state_of(target: SSMTargetModel, cache) -> list[torch.Tensor]:
    """The request's SSM layers' conv and SSM states, and a hybrid's attention layers' K and V."""
    pool = target._pool
    return [pool.conv[cache.slot].clone(), pool.ssm[cache.slot].clone(),
            *(t[:cache.committed].clone() for kv in cache.kv for t in kv)]


@pytest.mark.parametrize("paths", TREES, ids=["root", "chain", "wide", "deep"])
def test_verify_logits_are_hf_logits_along_every_path(target, paths):
    tree = build_tree(paths)
    prompt = random_prompt(13, seed=2)
    nodes = torch.tensor(random_prompt(tree.num_nodes, seed=3)) if tree.num_nodes else torch.empty(0, dtype=torch.long)
    cache = target.new_cache()
    target.prefill(cache, torch.tensor(prompt[:-1]))
    logits = target.verify(cache, prompt[-1], tree, nodes)
    rows = torch.cat([torch.tensor(prompt[-1:]), nodes])
    for leaf in tree.leaf_paths:
        expected = hf_logits(target.model, prompt[:-1] + rows[list(leaf)].tolist())[len(prompt) - 1:]
        # HF's float64 Mamba rounds its skip connections, norms and parts of its scan to float32
        torch.testing.assert_close(logits[list(leaf)], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("paths", TREES[1:], ids=["chain", "wide", "deep"])
def test_committed_state_is_the_state_after_the_accepted_tokens(target, paths):
    """Every root-to-node path committed: the state equals a prefill of the context plus the path's tokens (the
    replay of the accepted tokens), so no rejected branch's state is left behind."""
    tree = build_tree(paths)
    prompt = random_prompt(9, seed=4)
    nodes = torch.tensor(random_prompt(tree.num_nodes, seed=5))
    rows = torch.cat([torch.tensor(prompt[-1:]), nodes])
    for node in range(tree.num_nodes + 1):
        path, a = [], node
        while a != -1:
            path.append(a)
            a = int(tree.parents[a])
        path.reverse()
        cache = target.new_cache()
        target.prefill(cache, torch.tensor(prompt[:-1]))
        target.verify(cache, prompt[-1], tree, nodes)
        target.commit(cache, path)
        replay = target.new_cache()
        target.prefill(replay, torch.tensor(prompt[:-1] + rows[path].tolist()))
        assert cache.length == replay.length == len(prompt) - 1 + len(path)
        for got, want in zip(state_of(target, cache), state_of(target, replay)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        target.release(cache)
        target.release(replay)


def test_commit_refuses_what_is_not_a_path(target):
    tree = build_tree([(0,), (1,), (0, 0)])
    cache = target.new_cache()
    target.prefill(cache, torch.tensor([5, 6, 7]))
    target.verify(cache, 8, tree, torch.tensor([9, 10, 11]))
    with pytest.raises(ValueError, match="path"):
        target.commit(cache, [0, 2, 3])  # row 3's parent is row 1
    with pytest.raises(ValueError, match="path"):
        target.commit(cache, [0, 1, 4])  # no row 4
    with pytest.raises(ValueError, match="commit first"):
        target.prefill(cache, torch.tensor([1]))
    with pytest.raises(ValueError, match="at least the verify's root"):
        target.commit(cache, [])  # the root's state is already the slot's
    target.commit(cache, [0, 1, 3])
    assert cache.length == 6 and cache.pending_rows == 0
    with pytest.raises(ValueError, match="not a chunk's end"):
        target.verify(cache, 3, tree, torch.tensor([4, 5, 6]))
        target.save_chunk(cache, 0, 6)


def test_chunked_prefill_carries_the_state_across_chunks(target):
    prompt = torch.tensor(random_prompt(41, seed=6))
    whole = target.new_cache()
    target.prefill(whole, prompt)
    for size in (1, 3, 16):
        cache = target.new_cache()
        for start in range(0, 41, size):
            target.prefill(cache, prompt[start:start + size])
        for got, want in zip(state_of(target, cache), state_of(target, whole)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_one_forward_of_many_requests_equals_each_alone(target):
    """Prefill chunks, verifies and a chunk followed by its request's first verify in one forward: each request's
    logits and states are those of its own forward."""
    trees = [build_tree(TREES[3]), build_tree(TREES[2]), build_tree([])]
    prompts = [random_prompt(n, seed=n) for n in (7, 12, 20, 5)]

    def setup():
        caches = [target.new_cache() for _ in prompts]
        for cache, prompt in zip(caches[:3], prompts):
            target.prefill(cache, torch.tensor(prompt[:-1]))
        segments = [Segment(caches[i], torch.tensor([prompts[i][-1]] + random_prompt(trees[i].num_nodes, seed=i)),
                            trees[i]) for i in range(3)]  # fmt: skip
        chunk = Segment(caches[3], torch.tensor(prompts[3][:-1]))
        first = Segment(caches[3], torch.tensor([prompts[3][-1]] + random_prompt(3, seed=9)), build_tree(TREES[1]))
        return caches, [segments[0], chunk, segments[1], first, segments[2]]

    caches, segments = setup()
    together = target.forward_batch(segments)
    alone_caches, alone_segments = setup()
    alone = [target.forward_batch([s])[0] for s in alone_segments]
    assert together[1] is None and alone[1] is None
    for got, want in zip(together, alone):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(caches, alone_caches):
        for cache in (a, b):
            if cache.pending_rows:
                target.commit(cache, [0])
        for got, want in zip(state_of(target, a), state_of(target, b)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_prefix_cache_chunks_hold_the_state_at_their_end(target):
    prompt = torch.tensor(random_prompt(24, seed=8))
    first = target.new_cache()
    target.prefill(first, prompt[:16])
    saved = target.save_chunk(first, 0, 16)
    target.prefill(first, prompt[16:])
    second = target.new_cache()
    target.load_chunk(second, saved)
    assert second.length == 16
    target.prefill(second, prompt[16:])
    for got, want in zip(state_of(target, second), state_of(target, first)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="continue"):
        target.load_chunk(second, saved)


def test_states_live_in_a_pool_of_fixed_size_slots(target):
    """A request's state is the same size at any context; released slots are reused, and the pool doubles when
    every slot is taken."""
    pool = target._pool
    used = target.state_pool_stats["used"]  # (the module's other tests leave states behind)
    caches = [target.new_cache() for _ in range(pool.slots + 1)]
    assert pool.slots >= len(caches) and len({c.slot for c in caches}) == len(caches)
    size = pool.conv.numel() + pool.ssm.numel()
    target.prefill(caches[0], torch.tensor(random_prompt(300, seed=1)))
    assert pool.conv.numel() + pool.ssm.numel() == size
    assert target.state_pool_stats["used"] == used + len(caches)
    assert LocalTarget(target).kv_pool is None  # what the engine's metrics read as a KV pool's: there is none
    slot = caches[1].slot
    target.release(caches[1])
    reused = target.new_cache()
    assert reused.slot == slot and not pool.ssm[slot].any()
    for cache in caches + [reused]:
        target.release(cache)
    # [L, d_conv - 1, conv channels] + [L, d_inner, N] in float64 over 2 SSM layers; Mamba2 convolves x, B and C
    # (2 groups of 8)
    conv_channels = 64 + 2 * 2 * 8 if isinstance(target.model, (Mamba2ForCausalLM, BambaForCausalLM)) else 64
    assert target.state_bytes == (2 * (4 - 1) * conv_channels + 2 * 64 * 8) * 8
    # per token of context: a hybrid's 2 attention layers' K and V (2 heads of 8), nothing for a pure SSM
    hybrid = isinstance(target.model, (JambaForCausalLM, BambaForCausalLM))
    assert target.attention_bytes_per_token == (2 * 2 * 2 * 8 * 8 if hybrid else 0)


# ---- loading ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(SSM_TARGETS))
def test_a_directory_of_an_ssm_class_loads_as_an_ssm_target(tmp_path, kind):
    model = SSM_TARGETS[kind]()
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    target = load_target(str(tmp_path), dtype="float64", device="cpu")
    assert isinstance(target, SSMTargetModel) and target.vocab_size == 128
    prompt = random_prompt(6, seed=1)
    cache = target.new_cache()
    logits = target.verify(cache, prompt[0], build_tree([]), torch.empty(0, dtype=torch.long))
    torch.testing.assert_close(logits[0], hf_logits(model, prompt[:1])[0], rtol=0, atol=1e-5)
    engine = load_engine(str(tmp_path), "none", dtype="float64", device="cpu")
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, 6, dtype=torch.long))[0, 6:].tolist()
    assert engine.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True)).token_ids == expected
    # tensor parallelism shards attention targets only: a clear error before any weights load, and a rank says so
    # before its rendezvous (no peer ever joins here: it must not wait)
    with pytest.raises(UnsupportedTarget, match="tp_size=1"):
        target_worker.load_target(str(tmp_path), dtype="float32", device=torch.device("cpu"), tp_size=2)
    with pytest.raises(UnsupportedTarget, match="tp_size=1"):
        target_worker.TargetWorker(str(tmp_path), dtype="float32", rank=0, world_size=2)
    worker = target_worker.TargetWorker(str(tmp_path), dtype="float64")  # one rank: the SSM target itself
    assert isinstance(worker.target, SSMTargetModel) and worker.info()["tp_size"] == 1


@pytest.mark.parametrize("config", [
    NemotronHConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, hybrid_override_pattern="M*",
                    num_attention_heads=2, num_key_value_heads=1, mamba_num_heads=2, mamba_head_dim=16,
                    ssm_state_size=4, n_groups=1),
    Zamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
                 num_attention_heads=2, mamba_d_state=4, n_mamba_heads=2, mamba_headdim=32),
    FalconMambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4),
], ids=["nemotron-h", "zamba2", "falcon-mamba"])
def test_other_recurrent_classes_are_refused_naming_what_is_supported(tmp_path, config):
    config.save_pretrained(tmp_path)  # the class is read from the config before any weights load
    with pytest.raises(UnsupportedTarget, match="supported: .*MambaForCausalLM"):
        load_target_model(str(tmp_path))
    with pytest.raises(LoadError, match="is not supported as a target; supported: .*sdpa.*MambaForCausalLM"):
        load_target(str(tmp_path))


def test_a_class_without_sdpa_attention_is_refused_naming_what_is_supported(tmp_path):
    config = RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                        intermediate_size=64)
    RwkvForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(LoadError, match="RwkvForCausalLM has no sdpa attention .*; supported: .*MambaForCausalLM"):
        load_target(str(tmp_path))


def test_ssm_target_refuses_other_models():
    with pytest.raises(TypeError, match="MambaForCausalLM, Mamba2ForCausalLM, JambaForCausalLM or BambaForCausalLM"):
        SSMTargetModel(tiny_llama())


def test_a_hybrids_attention_rows_live_in_buffers_of_its_grant(target):
    """K and V are written in place into buffers of the cache's capacity (allocated once: no copy of the context per
    round), and grow past it only when the grant grows."""
    if not target._attention_layers:
        pytest.skip("no attention layers")
    cache = target.new_cache(capacity=40)
    target.prefill(cache, torch.tensor(random_prompt(20, seed=3)))
    buffers = [t.data_ptr() for kv in cache.kv for t in kv]
    assert all(t.shape[0] == 40 for kv in cache.kv for t in kv)
    tree = build_tree(TREES[2])
    for round_ in range(3):
        target.verify(cache, 5, tree, torch.tensor([6, 7, 8, 9]))
        target.commit(cache, [0, 1 + round_])
    assert cache.length == 26 and [t.data_ptr() for kv in cache.kv for t in kv] == buffers
    target.resize(cache, 60)
    target.prefill(cache, torch.tensor(random_prompt(20, seed=4)))
    assert all(t.shape[0] == 60 for kv in cache.kv for t in kv)
    target.release(cache)


@pytest.mark.parametrize("kind", ["mamba", "mamba2", "mamba2-odd-widths"])
def test_float32_logits_and_states_do_not_depend_on_the_batch(kind):
    """Batch invariance (float32 on CPU, the native GEMM and row kernels): a verify's logits and states are the same
    bits alone or beside other requests' trees and chunks, and a root's logits the same alone or under a tree. Widths
    of a real model's order, so that the products take the GEMM's blocked paths and the elementwise kernels run over
    many threads' worth of rows; and widths that leave partial vectors (hidden size 200, gate groups of 200), which
    the row kernels take as they take any width (torch's elementwise ops could not)."""
    if library.load() is None:
        pytest.skip(library.why_unavailable())
    build = {"mamba": lambda: tiny_mamba_lm(torch.float32, hidden=256, state=16),
             "mamba2": lambda: tiny_mamba2_lm(torch.float32, hidden=256, heads=16, head_dim=32, state=32),
             "mamba2-odd-widths": lambda: tiny_mamba2_lm(torch.float32, hidden=200, heads=10, head_dim=40,
                                                         state=24)}[kind]  # fmt: skip
    target = SSMTargetModel(build())
    assert target.batch_invariant, target.batch_invariant_why
    if kind == "mamba2-odd-widths":
        torch_rows = SSMTargetModel(target.model, native_scan=False)
        assert "hidden size 200" in torch_rows.batch_invariant_why and "scalar tails" in torch_rows.batch_invariant_why
    tree = build_tree(TREES[3])

    def run(others: int, paths=TREES[3]):
        cache = target.new_cache()
        target.prefill(cache, torch.tensor(random_prompt(40, seed=1)))
        nodes = random_prompt(len(paths), seed=2)
        segments = [Segment(cache, torch.tensor([7] + nodes), build_tree(paths))]
        for i in range(others):
            other = target.new_cache()
            target.prefill(other, torch.tensor(random_prompt(5 + 3 * i, seed=10 + i)))
            tokens = torch.tensor(random_prompt(1 + tree.num_nodes if i % 2 else 30, seed=20 + i))
            segments.append(Segment(other, tokens, tree if i % 2 else None))
        logits = target.forward_batch(segments)[0]
        target.commit(cache, [0, 1] if paths else [0])
        return logits, state_of(target, cache)

    alone, state = run(0)
    replay = target.new_cache()  # the committed path's state (replayed from the verify's scan inputs) is a prefill's
    target.prefill(replay, torch.tensor(random_prompt(40, seed=1) + [7] + random_prompt(len(TREES[3]), seed=2)[:1]))
    assert all(torch.equal(a, b) for a, b in zip(state_of(target, replay), state))
    for others in (1, 5):
        logits, batched_state = run(others)
        assert torch.equal(logits, alone)
        assert all(torch.equal(a, b) for a, b in zip(batched_state, state))
    root, _ = run(3, [])
    assert torch.equal(root[0], alone[0])


@pytest.mark.parametrize("kind", sorted(SSM_TARGETS))
def test_a_verify_after_its_chunk_in_one_forward_commits_any_path(kind):
    """A prompt's last chunk and its first verify in one forward (the slot then holds the chunk's end, not the root's
    state): committing any path leaves the state a prefill of the prompt and the path leaves, in float32 on the
    native kernels and in the fixture's float64 on torch's."""
    models = {"float64": SSM_TARGETS[kind]()}
    if library.load() is not None:
        models["float32"] = SSM_TARGETS[kind]().float()
    tree = build_tree(TREES[3])
    prompt, nodes = random_prompt(13, seed=2), random_prompt(tree.num_nodes, seed=3)
    rows = [prompt[-1]] + nodes
    for dtype, model in models.items():
        target = SSMTargetModel(model)
        assert (target.native_scan_why is None) == (dtype == "float32"), target.native_scan_why
        for leaf in tree.leaf_paths:
            for path in (list(leaf[:1]), list(leaf)):
                cache = target.new_cache()
                target.prefill(cache, torch.tensor(prompt[:5]))
                target.forward_batch([Segment(cache, torch.tensor(prompt[5:-1])),
                                      Segment(cache, torch.tensor(rows), tree)])  # fmt: skip
                target.commit(cache, path)
                replay = target.new_cache()
                target.prefill(replay, torch.tensor(prompt[:-1] + [rows[r] for r in path]))
                tol = dict(rtol=1e-12, atol=1e-12) if dtype == "float64" else dict(rtol=1e-5, atol=1e-5)
                for got, want in zip(state_of(target, cache), state_of(target, replay)):
                    torch.testing.assert_close(got, want, **tol)
                target.release(cache)
                target.release(replay)


@pytest.mark.parametrize("kind", ["jamba", "bamba", "mamba2"])
def test_float32_products_take_the_native_gemm_and_leave_the_hf_model_as_loaded(kind):
    """On float32 CPU every product takes the native GEMM, a hybrid's MLPs too, through copies of its feed-forward
    blocks that share the weights: the HF model (the reference) keeps its own nn.Linear layers. The logits are
    F.linear's to float32 rounding; with native_gemm=False the products are F.linear's and nothing is
    batch-invariant."""
    if library.load() is None:
        pytest.skip(library.why_unavailable())
    model = SSM_TARGETS[kind](torch.float32)
    native, plain = SSMTargetModel(model), SSMTargetModel(model, native_gemm=False)
    assert native.native_gemm_why is None and plain.native_gemm_why == "native_gemm=False"
    assert "native GEMM" in plain.batch_invariant_why
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    ffns = [layer.ffn for layer in native._layers if layer.ffn is not None]
    assert bool(ffns) == (kind != "mamba2")
    for ffn, hf_layer in zip(ffns, [layer for layer in model.model.layers] if ffns else []):
        assert ffn is not hf_layer.feed_forward
        ours = {n: p.data_ptr() for n, p in ffn.named_parameters()}
        assert ours == {n: p.data_ptr() for n, p in hf_layer.feed_forward.named_parameters()}  # shared, not copied
    prompt = torch.tensor(random_prompt(24, seed=3))
    tree, nodes = build_tree(TREES[3]), torch.tensor(random_prompt(len(TREES[3]), seed=4))
    logits = []
    for target in (native, plain):
        cache = target.new_cache()
        target.prefill(cache, prompt)
        logits.append(target.verify(cache, 7, tree, nodes))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
