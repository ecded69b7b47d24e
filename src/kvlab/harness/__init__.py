"""The campaign harness: the seeds' restore, sweep, agents and memory scenarios, end to end.

A campaign file (`campaigns/*.yml`, schema in `campaign.py`) names setups from the setup
registry, scenarios and their parameters, with seeds. `runner.py` starts each setup's
engine through `kvlab.engines.local`, runs the scenarios (`scenarios.py`) and writes an
append-only results folder (`results.py`); `summary.py` and `report.py` derive the
summary JSON, the Markdown tables and the PNG plots from its raw records.
"""
