"""Every counter of the connector, declared once.

A counter's `name` is its key everywhere: the store's stats (StoreStats) or the worker's
attribute, the worker's counters() and stats(), and vLLM's connector stats (vllm_stats.py).
`prometheus` is the name the metrics port serves it under (metrics.py), where it is served.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Counter:
    name: str
    help: str
    # Who counts it: "store" (StoreStats.<name>), "worker" (WorkerSide.<name>), or
    # "scheduler" (the lookup and the scrub, in the scheduler's process: Prometheus only).
    source: str
    prometheus: str | None = None


COUNTERS: tuple[Counter, ...] = (
    Counter("hit_tokens", "prompt tokens found on the drives at lookup", "scheduler", "kvlab_hit_tokens"),
    Counter(
        "miss_tokens", "prompt tokens not found on the drives at lookup", "scheduler", "kvlab_miss_tokens"
    ),
    Counter("bytes_read", "bytes read from the drives", "store", "kvlab_read_bytes"),
    Counter("bytes_written", "bytes written to the drives", "store", "kvlab_written_bytes"),
    Counter("read_s", "seconds of section reads", "store"),
    Counter("write_s", "seconds of section writes", "store"),
    Counter("objects_written", "objects committed", "store"),
    Counter("missing", "objects looked for and not on the drives", "store"),
    Counter("checksum_failures", "sections that failed verification", "store", "kvlab_checksum_failures"),
    Counter("sections_failed", "sections whose read failed", "store"),
    Counter("writes_aborted", "objects given up before they committed", "store"),
    Counter("evictions", "objects evicted to hold the capacity", "store", "kvlab_evictions"),
    Counter("evicted_bytes", "bytes evicted to hold the capacity", "store"),
    Counter("out_of_space", "drives found full below the capacity bound", "store", "kvlab_out_of_space"),
    Counter("scrubbed_bytes", "bytes scrub re-verified at rest", "scheduler", "kvlab_scrubbed_bytes"),
    Counter("scrub_removed", "objects scrub found damaged at rest and removed", "scheduler", "kvlab_scrub_removed"),
    Counter("admission_refused", "objects not saved: the admission policy refused them", "scheduler",
            "kvlab_admission_refused"),
    Counter("over_write_budget", "objects not saved: over the write budget", "scheduler",
            "kvlab_over_write_budget"),
    Counter("saves_dropped", "objects not saved: ring or drives saturated", "worker", "kvlab_saves_dropped"),
    Counter(
        "load_error_blocks", "blocks reported to vLLM for recompute", "worker", "kvlab_load_error_blocks"
    ),
)
# Counted per drive (wear: each drive's rated endurance is in writes of its own capacity):
# StoreStats.<name> is a list, one per drive in the store's order; Prometheus labels each
# drive's count with its path (`drive`).
PER_DRIVE: tuple[Counter, ...] = (
    Counter("drive_bytes_written", "bytes written to each drive", "store", "kvlab_drive_written_bytes"),
)
BY_NAME = {c.name: c for c in COUNTERS}
# What a worker reports each interval (vLLM's connector stats, campaign records): the store's,
# then its own. WorkerSide.counters() reads them each step with one attrgetter per source.
STORE_REPORTED = tuple(c.name for c in COUNTERS if c.source == "store")
WORKER_OWN = tuple(c.name for c in COUNTERS if c.source == "worker")
WORKER_REPORTED = STORE_REPORTED + WORKER_OWN
