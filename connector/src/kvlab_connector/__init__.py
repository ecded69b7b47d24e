"""kvlab-connector: vLLM KV cache on NVMe drives, striped and checksummed, no DRAM tier."""

__version__ = "0.1.0"
