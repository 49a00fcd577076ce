"""The serving sides without Ray: per-request target and drafter workers, the router's round loop, the HTTP models.

deployments/ wraps these plain classes in Ray actors and Serve deployments; everything here runs in one process.
"""
