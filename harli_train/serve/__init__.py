"""Serving over HTTP: the OpenAI-compatible API in front of the decode engine (``harli-train serve``)."""
