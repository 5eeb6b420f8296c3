"""What the fuzz tests share (tests/fuzz_rpc/, tests/test_fuzz_*.py): the fuzzed swarm's manifest, and the count
of cases tried.

Every case is counted by kind; `pytest -s -p no:xdist tests/fuzz_rpc` (or any of the files) prints the totals at
the end of each file.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import pytest

from conftest import tiny_manifest_dict
from swarm.manifests.validation import manifest_from_dict

CASES: collections.Counter[str] = collections.Counter()  # cases tried, by kind; printed at the end (pytest -s)
LOST: collections.Counter[str] = collections.Counter()  # replies that did not come the first time

FORWARD_TIMEOUT = 3.0  # the fuzzed swarm's: how long a peer waits for a request stream to finish
# two gradient slots per step: test_abuse leaves two training forwards cached on stage 0 (the step gate)
RAW_MANIFEST = tiny_manifest_dict(
    training={"microbatches_per_step": 2, "timeouts": {"forward": FORWARD_TIMEOUT, "backward": 5, "microbatch": 60}}
)
MANIFEST = manifest_from_dict(RAW_MANIFEST)
FIRST, LAST = 0, 1


@pytest.fixture(scope="module", autouse=True)
def print_case_counts() -> Iterator[None]:
    """At the end of each fuzz file (import it there): the cases it tried, by kind."""
    CASES.clear()
    LOST.clear()
    yield
    kinds = ", ".join(f"{kind}: {count}" for kind, count in sorted(CASES.items()))
    print(f"\nfuzz: {sum(CASES.values())} cases tried, all passed unless reported above ({kinds})")
    if LOST:
        print(f"fuzz: {dict(LOST)}")
