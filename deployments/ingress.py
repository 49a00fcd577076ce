"""Serve's direct ingress seen from the app: whether it is on, and the base URLs of an app's replicas' own HTTP servers
(deployments/router.py announces them and lists them in /v1/stats)."""

from __future__ import annotations


def direct_ingress_on() -> bool:
    """Whether this Serve runs replicas' own HTTP servers (its direct ingress: RAY_SERVE_ENABLE_DIRECT_INGRESS=1,
    or set by RAY_SERVE_THROUGHPUT_OPTIMIZED=1 or RAY_SERVE_ENABLE_HA_PROXY=1), as the process's Serve read it."""
    try:
        from ray.serve._private import constants
    except ImportError:
        return False
    return bool(getattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS", False))


def target_urls(groups, app_name: str, host: str | None, proxy_port: int | None = None) -> list[str]:
    """The base URLs of `app_name`'s HTTP targets among Serve's target groups (TargetGroup: protocol, route_prefix,
    targets of ip and port), sorted. A replica binds the app's HTTP host: Serve's default, the loopback one (None:
    `serve run` leaves it unset), unless opened up to every interface (then a target is reached at its node's IP).
    Targets at `proxy_port` are left out: while an app has no running replica (still starting, or all lost) Serve
    names its proxies instead, and those are not a replica's own address."""
    host = host or "127.0.0.1"
    urls = set()
    for group in groups:
        if group.app_name == app_name and str(getattr(group.protocol, "value", group.protocol)) == "HTTP":
            prefix = group.route_prefix.rstrip("/")
            urls.update(f"http://{t.ip if host in ('0.0.0.0', '::') else host}:{t.port}{prefix}"
                        for t in group.targets if t.port != proxy_port)  # fmt: skip
    return sorted(urls)
