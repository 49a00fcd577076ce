"""Ray Serve wrappers of the serving classes in ray_specdec/serving/: `serve run deployments:app key=value ...`."""

from deployments.app import AppArgs, app

__all__ = ["AppArgs", "app"]
