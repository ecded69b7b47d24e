"""The unit tier's folders mirror the packages they test (the connector's store/, worker/, io/,
lmcache_l2/; the CLI's engines/, bench/, setups/). A test may import a helper from another
test module by its name (`from test_store import put`), wherever that module sits: every
folder of the tier is on the path. Test file names stay unique across the folders."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for folder in sorted(p for p in [HERE, *HERE.iterdir()] if p.is_dir() and not p.name.startswith((".", "_"))):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))


@pytest.fixture(autouse=True)
def no_thread_outlives_its_test() -> Iterator[None]:
    """A thread a test starts ends with that test. One left running (a daemon, say, abandoned
    by a timeout) may still be in torch's or kvikio's native code when the interpreter exits,
    and that aborts the whole run after every test passed ("terminate called without an active
    exception", exit 134)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2.0
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    while left and time.monotonic() < deadline:
        left[0].join(max(0.0, deadline - time.monotonic()))
        left = [t for t in left if t.is_alive()]
    assert not left, f"threads this test started are still running: {sorted(t.name for t in left)}"
