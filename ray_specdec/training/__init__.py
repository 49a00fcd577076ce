"""Training of the default model family on the Python standard library's own sources.

Stages (each a `python -m ray_specdec.training.<module>` script): `corpus` (file list, split, manifest),
`tokenizer` (byte-level BPE), `train` (targets from scratch, drafters by distillation), `export` (fp16 HF dirs
under ray_specdec/default_models), `evaluate` (held-out perplexity and chain acceptance, into docs/MODELS.md).
"""
