"""ray_specdec: lossless tree speculative decoding with Mamba drafters, served with Ray Serve."""

from ray_specdec.config import SamplingParams, TreeConfig

__all__ = ["SamplingParams", "TreeConfig"]
__version__ = "0.1.0"
