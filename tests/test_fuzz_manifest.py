"""Fuzz tests of the manifest loader: random mutations of a full manifest (as a dictionary and as JSON text),
random and broken JSON text, and crafted documents meant to exhaust a parser. Each must load (and survive its own
JSON) or raise ManifestError, never another exception."""

from __future__ import annotations

import collections
import copy
import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from fuzzing import CASES, RAW_MANIFEST, print_case_counts  # noqa: F401
from swarm.errors import ManifestError
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import manifest_from_dict, parse_manifest

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
FULL_MANIFEST = manifest_from_dict({**RAW_MANIFEST, "initial_peers": [PEER]}).to_dict()  # every field written out


def nested_list(depth: int) -> list:
    result: list = []
    for _ in range(depth):
        result = [result]
    return result


def random_value(rng: random.Random) -> Any:
    """A JSON value meant to break a field: wrong types, extremes, odd text, nested garbage."""
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            -1,
            1,
            2,
            2**31,
            2**63,
            -(2**64),
            10**30,
            1e308,
            -1e-308,
            0.5,
            float("nan"),
            float("inf"),
            float("-inf"),
            "",
            " ",
            "x" * rng.choice([1, 1000, 1_000_000]),
            "é🙂\u202e\x00\ud800",
            "/ip4/127.0.0.1/tcp/1",
            "/ip4/999.0.0.1/tcp/1/p2p/" + "A" * 46,
            "/dns4/" + "a" * 300 + "/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
            "adamw",
            "8bit",
            [],
            {},
            [1, 2, 3],
            [[0, 1], [1, 2]],
            {"a": {"b": [None, {"c": float("nan")}]}},
            nested_list(rng.choice([10, 200])),
            [rng.random() for _ in range(rng.choice([1, 10_000]))],
            rng.randbytes(16).decode("latin-1"),
        ]
    )


def slots(obj: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) of a manifest's dictionaries and lists, depth first."""
    found = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for key, value in items:
        found.append((obj, key))
        found += slots(value)
    return found


def mutate_manifest(raw: dict, rng: random.Random) -> Any:
    """Delete a field, change its value, add an unknown one, or replace the whole document."""
    container, key = rng.choice(slots(raw))
    pick = rng.random()
    if pick < 0.25:
        del container[key]
    elif pick < 0.8:
        container[key] = random_value(rng)
    elif pick < 0.95 and isinstance(container, dict):
        container[rng.choice(["", "unknown", "🙂", "\x00", "model ", "Name"])] = random_value(rng)
    elif pick < 0.97:
        return random_value(rng)
    return raw


def check_manifest_or_error(load: Callable[[Any], Manifest], source: Any, case: str) -> str:
    """A manifest that loads must survive its own JSON; anything else must be a ManifestError."""
    try:
        manifest = load(source)
    except ManifestError as e:
        assert str(e), case
        return "refused"
    except Exception as e:
        raise AssertionError(f"{case}: {type(e).__name__}: {str(e)[:200]}") from e
    assert parse_manifest(manifest.to_json()) == manifest, case
    return "parsed"


def test_random_manifest_mutations_parse_or_raise_manifest_error():
    rng = random.Random(11)
    outcomes: collections.Counter[str] = collections.Counter()
    for i in range(300):
        raw = copy.deepcopy(FULL_MANIFEST)
        for _ in range(rng.choice([1, 1, 2, 3])):
            raw = mutate_manifest(raw, rng) if isinstance(raw, dict) and slots(raw) else raw
        outcomes[check_manifest_or_error(manifest_from_dict, raw, f"mutation {i}")] += 1
        if i % 3 == 0:  # the same through JSON text, as files and URLs arrive
            outcomes[check_manifest_or_error(parse_manifest, json.dumps(raw), f"mutation {i} as JSON")] += 1
    CASES["manifest: mutations"] += sum(outcomes.values())
    assert outcomes["refused"] > 200 and outcomes["parsed"] > 5, outcomes  # the mutations do both


def test_random_manifest_text_parses_or_raises_manifest_error():
    rng = random.Random(12)
    text = json.dumps(FULL_MANIFEST, indent=1)
    for i in range(300):
        pick = i % 4
        if pick == 0:
            case = text[: rng.randrange(len(text))]
        elif pick == 1:
            chars = list(text)
            for _ in range(rng.choice([1, 3, 20])):
                chars[rng.randrange(len(chars))] = rng.choice('{}[]",:0123456789.eE-+ \\ntfa\x00é')
            case = "".join(chars)
        elif pick == 2:
            case = rng.randbytes(rng.choice([0, 1, 10, 1000])).decode("utf-8", errors="replace")
        else:
            case = rng.choice(
                ["null", "[]", '""', "1e999", "-0", "NaN", '{"name": "x"}', "{" * 50 + "}" * 50, "\ufeff{}"]
            )
        check_manifest_or_error(parse_manifest, case, f"text case {i}: {case[:80]!r}")
        CASES["manifest: text"] += 1


def manifest_with(section: str, key: str, value: Any) -> dict:
    raw = copy.deepcopy(FULL_MANIFEST)
    if section:
        raw[section][key] = value
    else:
        raw[key] = value
    return raw


@pytest.mark.parametrize(
    "load",
    [
        pytest.param(
            lambda: parse_manifest("[" * 100_000),
            id="JSON nested 100000 deep",
        ),
        pytest.param(
            lambda: parse_manifest('{"name": ' + "1" * 5000 + "}"),
            id="a JSON integer of 5000 digits",
        ),
        pytest.param(
            lambda: parse_manifest(json.dumps(manifest_with("training", "learning_rate", 10**400))),
            id="a 400-digit integer learning rate in JSON",
        ),
        pytest.param(
            lambda: manifest_from_dict(manifest_with("model", "width", 10**5000)),
            id="a 5000-digit integer width",
        ),
        pytest.param(
            lambda: manifest_from_dict(manifest_with("", "name", nested_list(5000))),
            id="a name nested 5000 deep",
        ),
        pytest.param(lambda: parse_manifest("[" * 500 + "]" * 500), id="JSON nested 500 deep"),
        pytest.param(lambda: parse_manifest('{"name": 1e400}'), id="a float that overflows"),
    ],
)
def test_crafted_manifests_raise_manifest_error(load: Callable[[], Manifest]):
    CASES["manifest: crafted"] += 1
    with pytest.raises(ManifestError):
        load()
