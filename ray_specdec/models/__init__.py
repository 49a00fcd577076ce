"""Model adapters: the Transformer target and the Mamba drafter, plus shared loading helpers.

Import the adapters from their modules (`ray_specdec.models.target`, `ray_specdec.models.mamba_drafter`) so that
using one does not import the other.
"""
