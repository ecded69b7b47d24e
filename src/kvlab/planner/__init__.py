"""The restore planner: KV bytes, restore and recompute times and the memory bill for a model
on a node, from public geometry and the node's links, calibrated on a run's records.

One job per module: `geometry` (KV bytes per token and per GPU), `presets` (public model
geometry), `modelconfig` (a config.json or model folder), `node` (links, drives, GPUs),
`restore` (per-tier restore with layer overlap and shared links), `recompute` (prefill),
`bill`, `calibrate` (a fit on a run's records), `predict` (all of it per length), `cli`.
"""
