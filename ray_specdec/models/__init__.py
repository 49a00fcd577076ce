"""Model adapters: the Transformer target (target/), the Mamba drafter (drafter/), the native CPU kernels beside their
Python wrappers (native/), and shared loading helpers.

Import the adapters from their modules (`ray_specdec.models.target.model`, `ray_specdec.models.drafter.mamba`) so that
using one does not import the other.
"""
