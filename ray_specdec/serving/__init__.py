"""The serving sides without Ray: the OpenAI-compatible HTTP server, the engine loop and the target worker of an
engine replica, the router's side of a request, the HTTP models and metrics.

deployments/ wraps these plain classes in Ray actors and Serve deployments; everything here runs in one process.
"""
