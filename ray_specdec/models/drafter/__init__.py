"""The Mamba drafter: `mamba.MambaDrafter`, its scan, its state slots and its CUDA graphs."""
