"""TargetModel vs plain HF forwards (tiny float64 models): tree logits, commit, greedy decoding, loading, limits."""

from __future__ import annotations

import pytest
import torch

import ray_specdec.models.target.model as target_module
from ray_specdec.config import TreeConfig
from ray_specdec.models.target import attention_masks
from ray_specdec.models.target.model import TargetModel
from ray_specdec.speculation.tree import build_tree
from tests.helpers.models import tiny_gpt_neox, tiny_llama, tiny_mistral, tiny_tokenizer

FAMILIES = {"gpt_neox": tiny_gpt_neox, "llama_gqa": tiny_llama, "mistral_window8": tiny_mistral}
TREES = {"2,2,1": (2, 2, 1), "chain3": (1, 1, 1), "one_node": (1,), "empty": ()}
# Eager attention runs its softmax in float32 even for float64 models, so it only agrees to ~1e-7 with itself
# across different query shapes; sdpa stays at float64 precision.
ATOL = {"sdpa": 1e-12, "eager": 1e-6}
VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CPU they lose a lot waiting for them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[(f, a) for f in FAMILIES for a in ATOL], ids=lambda p: f"{p[0]}-{p[1]}")
def family_attn(request):
    family, attn = request.param
    return family, attn, FAMILIES[family](torch.float64, attn_implementation=attn)


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    return FAMILIES[request.param](torch.float64)


def random_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[S, V] logits of one plain causal forward, no cache."""
    with torch.no_grad():
        return model(tokens[None]).logits[0]


def hf_cache_kv(model, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) after a fresh prefill of `tokens` through the adapter."""
    target = TargetModel(model)
    cache = target.new_cache()
    target.prefill(cache, tokens)
    return [(layer.keys, layer.values) for layer in cache.kv.layers]


@pytest.mark.parametrize("prompt_len", [0, 1, 12])
@pytest.mark.parametrize("tree_name", list(TREES))
def test_tree_logits_equal_sequential(family_attn, tree_name, prompt_len):
    _, attn, model = family_attn
    target = TargetModel(model)
    tree = build_tree(TreeConfig(TREES[tree_name]).index_paths())
    prompt, rows = random_tokens(prompt_len, 1), random_tokens(1 + tree.num_nodes, 2)  # rows: [root, *nodes]
    cache = target.new_cache()
    target.prefill(cache, prompt)
    assert cache.length == prompt_len

    logits = target.verify(cache, int(rows[0]), tree, rows[1:])

    assert logits.shape == (1 + tree.num_nodes, VOCAB) and logits.dtype == torch.float64
    assert cache.length == prompt_len + 1 + tree.num_nodes
    for path in tree.leaf_paths:
        path = list(path)
        expected = hf_logits(model, torch.cat([prompt, rows[path]]))[prompt_len:]
        torch.testing.assert_close(logits[path], expected, atol=ATOL[attn], rtol=0)


@pytest.mark.parametrize("leaf", [0, -1])
@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_commit_equals_recompute(model, leaf, accepted):
    target = TargetModel(model)
    tree = build_tree(TreeConfig((2, 2, 1)).index_paths())
    prompt, rows = random_tokens(9, 3), random_tokens(1 + tree.num_nodes, 4)
    keep = list(tree.leaf_paths[leaf][: 1 + accepted])  # root + accepted path
    cache = target.new_cache()
    target.prefill(cache, prompt)
    target.verify(cache, int(rows[0]), tree, rows[1:])

    target.commit(cache, keep)

    kept_tokens = torch.cat([prompt, rows[keep]])
    assert cache.length == len(kept_tokens)
    for (k, v), layer in zip(hf_cache_kv(model, kept_tokens), cache.kv.layers, strict=True):
        torch.testing.assert_close(layer.keys, k, atol=1e-12, rtol=0)
        torch.testing.assert_close(layer.values, v, atol=1e-12, rtol=0)
    # The next round sees the same history: verify (explicit positions) then prefill (positions from the cache).
    fresh = target.new_cache()
    target.prefill(fresh, kept_tokens)
    next_tree, next_rows = build_tree(TreeConfig((2, 1)).index_paths()), random_tokens(5, 5)
    logits = target.verify(cache, int(next_rows[0]), next_tree, next_rows[1:])
    expected = target.verify(fresh, int(next_rows[0]), next_tree, next_rows[1:])
    torch.testing.assert_close(logits, expected, atol=1e-12, rtol=0)
    for c in (cache, fresh):
        target.commit(c, [0, 2])
        target.prefill(c, random_tokens(2, 6))
    assert cache.length == fresh.length == len(kept_tokens) + 4
    for a, b in zip(cache.kv.layers, fresh.kv.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-12, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=1e-12, rtol=0)


def test_greedy_decode_reproduces_generate(model):
    """prefill + verify(empty tree) + commit([0]) is plain greedy decoding, token for token."""
    target, prompt, steps = TargetModel(model), random_tokens(7, 7), 20
    empty = build_tree([])
    cache = target.new_cache()
    target.prefill(cache, prompt[:-1])
    root, produced = int(prompt[-1]), []
    while len(produced) < steps and (not produced or produced[-1] not in target.eos_token_ids):
        logits = target.verify(cache, root, empty, torch.empty(0, dtype=torch.long))
        target.commit(cache, [0])
        root = int(logits[0].argmax())
        produced.append(root)

    with torch.no_grad():
        expected = model.generate(prompt[None], max_new_tokens=steps, do_sample=False)[0, len(prompt) :]
    assert produced == expected.tolist()
    assert len(set(produced)) > 3  # a decoding that repeats one token would prove little


def test_chunked_prefill_matches_one_pass(model, monkeypatch):
    tokens = random_tokens(23, 8)
    whole = hf_cache_kv(model, tokens)
    monkeypatch.setattr(target_module, "PREFILL_CHUNK", 5)
    for (k, v), (ck, cv) in zip(whole, hf_cache_kv(model, tokens), strict=True):
        torch.testing.assert_close(ck, k, atol=1e-12, rtol=0)
        torch.testing.assert_close(cv, v, atol=1e-12, rtol=0)


def test_attributes(model):
    target = TargetModel(model)
    expected_eos = {"GPTNeoXForCausalLM": {0}, "LlamaForCausalLM": {2, 3}, "MistralForCausalLM": {2}}
    assert target.eos_token_ids == frozenset(expected_eos[type(model).__name__])
    assert (target.vocab_size, target.max_context, target.dtype) == (VOCAB, 256, torch.float64)
    assert target.device == torch.device("cpu") and target.tokenizer is None


def test_over_length_requests_raise(model):
    target = TargetModel(model)
    cache = target.new_cache()
    with pytest.raises(ValueError, match="needs 257 positions but the target's context is 256"):
        target.prefill(cache, random_tokens(257, 9))
    assert cache.length == 0
    target.prefill(cache, random_tokens(250, 9))
    deep = build_tree(TreeConfig.chain(6).index_paths())
    with pytest.raises(ValueError, match="verify of a depth-6 tree needs 257 positions"):
        target.verify(cache, 1, deep, random_tokens(6, 10))
    target.verify(cache, 1, build_tree(TreeConfig.chain(5).index_paths()), random_tokens(5, 10))  # fits exactly


def test_misuse_raises(model):
    target, tree = TargetModel(model), build_tree(TreeConfig((2, 1)).index_paths())
    cache = target.new_cache()
    with pytest.raises(ValueError, match="commit without a verify"):
        target.commit(cache, [0])
    with pytest.raises(ValueError, match="tree has 4 nodes but 3 tokens"):
        target.verify(cache, 1, tree, random_tokens(3, 11))
    target.verify(cache, 1, tree, random_tokens(4, 11))
    with pytest.raises(ValueError, match="uncommitted verify rows"):
        target.prefill(cache, random_tokens(2, 12))
    for bad in ([1, 0], [0, 0], [0, 5]):
        with pytest.raises(ValueError, match="keep_rows must be ascending"):
            target.commit(cache, bad)


def test_rejects_attention_without_4d_masks():
    model = tiny_llama(torch.float32)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="needs a 4D attention mask"):
        TargetModel(model)


def test_from_pretrained_fp16_checkpoint_loads_fp32(tmp_path):
    model, tokenizer = tiny_llama(torch.float16), tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    target = TargetModel.from_pretrained(str(tmp_path))

    assert target.dtype == torch.float32 and target.device == torch.device("cpu") and not target.model.training
    for (name, saved), loaded in zip(model.state_dict().items(), target.model.state_dict().values(), strict=True):
        assert torch.equal(loaded, saved.float()), name
    text = "the lazy fox is verified"
    assert target.tokenizer(text).input_ids == tokenizer(text).input_ids
    assert target.eos_token_ids == frozenset({2, 3})


@pytest.mark.parametrize("window", [None, 3, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tree_masks_are_the_built_masks(window, dtype, monkeypatch):
    """Every view TreeMasks hands out equals the mask tree_attention_mask builds for that cache length, bit for bit,
    across buffer growth (a small first width), shapes coming back after eviction, and windows."""
    monkeypatch.setattr(attention_masks, "MASK_MIN_WIDTH", 4)
    masks = attention_masks.TreeMasks(dtype, torch.device("cpu"), window, shapes=2)
    trees = [build_tree(TreeConfig(t).index_paths()) for t in [(), (1,), (3, 2, 1), (2, 2, 1), ()]]
    for cache_len in [0, 1, 3, 4, 5, 17, 2, 100, 0, 64]:
        for tree in trees:
            view = masks(cache_len, tree)
            built = attention_masks.tree_attention_mask(cache_len, tree, dtype, torch.device("cpu"), window)
            assert view.shape == built.shape and view.dtype == built.dtype and view.stride(-1) == 1
            assert torch.equal(view, built)
    assert len(masks._buffers) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aligned_masks_are_the_masks_in_the_layout_sdpa_reads(dtype):
    """Off the CPU, masks are handed to sdpa with rows at multiples of 16 elements in a buffer of their own, so its
    memory-efficient kernel does not pad and copy them again at every layer (forced on here, on the CPU)."""
    masks = attention_masks.TreeMasks(dtype, torch.device("cpu"), None, aligned=True)
    assert not attention_masks.TreeMasks(dtype, torch.device("cpu"), None).aligned  # the CPU's default
    for cache_len in [0, 1, 15, 16, 17, 300]:
        for tree in [build_tree(TreeConfig(t).index_paths()) for t in [(), (3, 2, 1)]]:
            mask = masks(cache_len, tree)
            built = attention_masks.tree_attention_mask(cache_len, tree, dtype, torch.device("cpu"))
            assert torch.equal(mask, built) and mask.stride(-1) == 1
            assert all(stride % 16 == 0 for stride in mask.stride()[:-1])
            assert mask.storage_offset() == 0
    causal = attention_masks.prefill_mask(40, 7, None, dtype)
    placed = masks.place(causal)
    assert torch.equal(placed, causal) and placed.stride(-2) % 16 == 0
    flags = attention_masks.prefill_mask(40, 7, None, None)
    assert masks.place(flags).dtype == torch.bool  # bool masks pass as they are
