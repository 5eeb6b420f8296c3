"""What a restart on the same machine reuses of earlier starts (swarm/network/startup_cache.py)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from swarm.network.startup_cache import StartupCache, reachability_key


def test_a_reachability_verdict_is_reused_only_for_the_same_fixed_addresses(tmp_path):
    cache = StartupCache(tmp_path / "startup.json")
    key = reachability_key(["/ip4/0.0.0.0/tcp/31337"], ["/ip4/1.2.3.4/tcp/31337"])
    assert key is not None and reachability_key(["/ip4/0.0.0.0/tcp/0"], None) is None  # a random port: never
    assert cache.reachability(key) is None
    cache.remember_reachability(key, False, "nobody could dial it")
    assert cache.reachability(key) == (False, "nobody could dial it")
    assert cache.reachability(reachability_key(["/ip4/0.0.0.0/tcp/31338"], None)) is None


def test_an_old_or_damaged_cache_is_ignored(tmp_path):
    path = tmp_path / "startup.json"
    cache = StartupCache(path)
    key = reachability_key(["/ip4/0.0.0.0/tcp/31337"], None)
    cache.remember_reachability(key, True, "dialed back")
    data = json.loads(path.read_text())
    data[key]["time"] -= 7200  # two hours ago
    path.write_text(json.dumps(data))
    assert cache.reachability(key) is None
    for text in ("not json", "[1, 2]", json.dumps({key: {"time": "soon", "reachable": "yes"}})):
        path.write_text(text)
        assert cache.reachability(key) is None and not cache.identity_ran_here(tmp_path / "id.key")


def test_an_identity_is_known_to_have_run_here_once_remembered(tmp_path):
    cache = StartupCache(tmp_path / "startup.json")
    identity = tmp_path / "peer.key"
    assert not cache.identity_ran_here(identity)
    cache.remember_identity(identity)
    assert cache.identity_ran_here(identity)
    assert not cache.identity_ran_here(tmp_path / "copy.key")  # another file: the twin check runs


def _remember_identities(path: str, name: str, count: int) -> None:
    cache = StartupCache(Path(path))
    for i in range(count):
        cache.remember_identity(Path(path).parent / f"{name}-{i}.key")


def test_peers_that_start_together_keep_each_others_entries(tmp_path):
    """Four processes write at once, as the peers of a machine started together do: no entry is lost (each
    restart would otherwise check again what its first start found), and no temporary file is left."""
    path, count = tmp_path / "startup.json", 12
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_remember_identities, args=(str(path), f"p{k}", count)) for k in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
        assert writer.exitcode == 0
    cache = StartupCache(path)
    assert all(cache.identity_ran_here(tmp_path / f"p{k}-{i}.key") for k in range(4) for i in range(count))
    assert not list(tmp_path.glob("*.tmp"))
