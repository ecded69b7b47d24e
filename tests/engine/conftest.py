"""Engine tier: the real vLLM CPU engine and the tiny model, built once into the user cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvlab.images import build
from kvlab.model import ensure_tiny

IMAGE_BUILD_TIMEOUT_S = 1800


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny(seed=0)


@pytest.fixture(scope="session", autouse=True)
def serving_image(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], None]]:
    """The CPU serving image, built in the background from the tier's start when a collected test
    needs it and no build of its inputs is cached: niced on the first core beside the engines it
    takes longer than the tests before it (20 min, cold), which is why test_container_engine.py
    runs last (pytest_collection_modifyitems). Under `make test` its build began in the unit tier
    (scripts/test-tiers); the `ensure` here then waits for that one. Yields `wait`, which that
    test's fixture calls before it loads the image; a build still running at the session's end is
    interrupted (its own clean-up removes its work folder) and then killed, by its process group."""
    needs = any(_needs_image(item) for item in request.session.items)
    proc = None
    if needs and build.cached(build.plan("serve", "cpu")) is None:
        log = tmp_path_factory.mktemp("serving-image") / "build.log"
        with log.open("wb") as out:
            # On the first core this process may use, niced: the engines' forward pass is bound
            # to every other core (kvlab.setups.registry.compute_cores), and the first one
            # mostly waits on them (the API servers, the tests' clients).
            first_core = str(min(os.sched_getaffinity(0)))
            proc = subprocess.Popen(
                ["nice", "-n", "10", "taskset", "-c", first_core,
                 str(Path(sys.executable).parent / "kvlab"), "image", "ensure", "serve", "--flavor", "cpu"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait() -> None:
        if proc is None:
            return
        rc = proc.wait(timeout=IMAGE_BUILD_TIMEOUT_S)
        if rc != 0:
            pytest.fail(f"kvlab image ensure serve --flavor cpu exited {rc}:\n{log.read_text()[-4000:]}")

    try:
        yield wait
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of the serving image run last: its cold build (`serving_image`) runs beside
    every other test of the tier, and in file order test_container_engine.py came fifth and
    waited 171 s for it (a cold tier, 2 cores)."""
    items.sort(key=_needs_image)


def _needs_image(item: pytest.Item) -> bool:
    return Path(str(item.fspath)).name == "test_container_engine.py"
