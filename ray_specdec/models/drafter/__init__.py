"""The drafters: `mamba.MambaDrafter` (its scan, state slots and CUDA graphs), `mamba2.Mamba2Drafter`, and `kinds`,
which picks one for a checkpoint."""
