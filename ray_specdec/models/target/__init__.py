"""The Transformer target: `model.TargetModel` and what its forwards run on (the lean forward, KV caches and pool,
masks, the forward's layout, CUDA graphs, tensor-parallel shards, batch invariance)."""
