"""tp_shards: which DeepSpeed AutoTP layers a shard's batch-invariant forward goes through, and how (the whole path
runs over real ranks in tests/deployments/test_target_tp.py)."""

from __future__ import annotations

import torch

from ray_specdec.models.target import batch_invariant, tp_shards

from tests.helpers.models import tiny_gpt_neox


def deepspeed_layer(kind: str, **attributes) -> torch.nn.Module:
    """A module of a class named `kind` from DeepSpeed's module_inject (what AutoTP puts in a model)."""
    cls = type(kind, (torch.nn.Module,), {"__module__": "deepspeed.module_inject.layers"})
    module = cls()
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def test_a_plain_model_is_no_shard():
    model = tiny_gpt_neox()
    assert not tp_shards.is_shard(model) and tp_shards.why_unsupported(model) is None
    assert tp_shards.row_shard(model.gpt_neox.layers[0].attention.dense) is None


def test_known_layers_and_the_input_features_each_rank_holds():
    model = tiny_gpt_neox()
    layer = model.gpt_neox.layers[0]
    layer.attention.dense = deepspeed_layer("LinearAllreduce", mp_group=None)
    layer.mlp.dense_h_to_4h = deepspeed_layer("LinearLayer", gather_output=False)
    model.embed_out = deepspeed_layer("LmHeadLinearAllreduce", mp_group=None, _partition_sizes=[40, 24], tp_index=1)
    assert tp_shards.is_shard(model) and tp_shards.why_unsupported(model) is None
    assert tp_shards.row_shard(layer.attention.dense).inputs == slice(None)  # its input is this rank's share already
    assert tp_shards.row_shard(layer.mlp.dense_h_to_4h) is None  # a column block: whole on this rank
    assert tp_shards.row_shard(model.embed_out).inputs == slice(40, 64)  # the head cuts its slice of the hidden state


def test_unknown_layers_keep_a_shard_out_of_batch_invariance():
    model = tiny_gpt_neox()
    model.gpt_neox.embed_in = deepspeed_layer("VocabParallelEmbedding")
    assert tp_shards.why_unsupported(model) == "its layer gpt_neox.embed_in is a DeepSpeed VocabParallelEmbedding"
    assert "VocabParallelEmbedding" in batch_invariant.why_unsupported(model)
    model = tiny_gpt_neox()
    model.gpt_neox.layers[1].mlp.dense_h_to_4h = deepspeed_layer("LinearLayer", gather_output=True)
    assert "gathers its output" in tp_shards.why_unsupported(model)
    model.gpt_neox.layers[1].mlp.dense_h_to_4h = deepspeed_layer("LmHeadLinearAllreduce")
    assert "does not say which input features" in tp_shards.why_unsupported(model)
