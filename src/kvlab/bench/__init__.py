"""Benchmarks: the connector's (store, memory, overhead), the demo, fio's drive limit."""
