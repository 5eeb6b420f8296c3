"""The fuzzed swarm (fuzzed_swarm.py), started once for every test of this folder (a package-scoped fixture; the
folder is one unit of work under pytest-xdist, see tests/conftest.py) and stopped after the last one. The files
run in RUN_ORDER: the check that the peers are unchanged comes after every case, and the two cases that may
leave a peer's memory high or a peer dead come last."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fuzzing import print_case_counts  # noqa: F401 (an autouse fixture: each file's cases, by kind, with -s)

from .fuzzed_swarm import Swarm, fuzzed_swarm

RUN_ORDER = ["test_requests.py", "test_streams.py", "test_control.py", "test_abuse.py", "test_after_all_cases.py"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This folder's tests in RUN_ORDER (each file's in file order), in the places they were collected in."""
    here = Path(__file__).parent
    places = [i for i, item in enumerate(items) if item.path.parent == here]
    unordered = {items[i].path.name for i in places} - set(RUN_ORDER)
    assert not unordered, f"tests/fuzz_rpc/conftest.py: add {sorted(unordered)} to RUN_ORDER (where it must run)"
    ours = sorted((items[i] for i in places), key=lambda item: RUN_ORDER.index(item.path.name))
    for place, item in zip(places, ours):
        items[place] = item


@pytest.fixture(scope="package")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    yield from fuzzed_swarm(tmp_path_factory.mktemp("fuzz"))
