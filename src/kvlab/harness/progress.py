"""The progress bar: the plan's steps, counted as they run, its estimates rescaled by the pace so far."""

from __future__ import annotations

import sys
import time

from kvlab.harness.plan import Step, fmt_s


def note(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Progress:
    """What runs now and how much is left: the plan's steps, their estimates rescaled by the pace so far."""

    def __init__(self, steps: list[Step] | tuple[Step, ...]):
        self.steps = list(steps)
        self.i = 0
        self.t0 = time.monotonic()
        self.done_est = 0.0
        self.total_est = sum(s.est_s for s in steps)

    def advance(self, step: Step) -> None:
        """The previous step is done; `step` (the plan's next one) runs now."""
        if 0 < self.i <= len(self.steps):
            self.done_est += self.steps[self.i - 1].est_s
        self.i += 1
        elapsed = time.monotonic() - self.t0
        left_est = max(0.0, self.total_est - self.done_est)
        pace = elapsed / self.done_est if self.done_est > 30 else 1.0
        note(
            f"[{min(self.i, len(self.steps))}/{len(self.steps)} · {fmt_s(elapsed)} elapsed · "
            f"~{fmt_s(left_est * pace)} left] {step.setup}: {step.what}"
        )

    def skip_setup(self, setup: str) -> None:
        """A setup that failed: its remaining planned steps will not run."""
        keep = self.steps[: self.i] + [s for s in self.steps[self.i :] if s.setup != setup]
        self.total_est -= sum(s.est_s for s in self.steps[self.i :] if s.setup == setup)
        self.steps = keep
