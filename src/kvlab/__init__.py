"""kvlab: a reproducible lab for KV-cache tiering under vLLM."""

__version__ = "0.1.0"
