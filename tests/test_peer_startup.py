"""A peer's start-up as a library call (swarm/peer/startup.py), made here as another program would make it."""

from __future__ import annotations

import asyncio

import pytest

from conftest import tiny_manifest_dict
from swarm.dht import node
from swarm.errors import PeerStartError
from swarm.manifests.validation import manifest_from_dict
from swarm.peer.startup import JoinOptions, enter_swarm, start_node

pytestmark = pytest.mark.integration


def test_start_node_then_enter_swarm_gives_a_signed_node_and_stop_leaves_nothing_locked(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "cache"))
    manifest = manifest_from_dict(tiny_manifest_dict())
    identity = tmp_path / "identity.key"
    options = JoinOptions(join="unused", new_swarm=True, host_maddrs=node.LOOPBACK, identity_path=identity)
    said: list[str] = []
    started = start_node(options, manifest, said.append)
    try:
        assert started.reachable and started.dht.is_alive() and started.manifest is manifest
        assert identity.exists()
        # a second peer with the same identity file, on this machine, is refused while the first runs
        with pytest.raises(PeerStartError, match="identity"):
            start_node(options, manifest, said.append)

        async def enter() -> None:
            entered, p2p = await enter_swarm(started, options.join, said.append)
            assert entered is manifest and p2p.peer_id == started.dht.peer_id
            await p2p.shutdown()

        asyncio.run(enter())
        assert any(f"peer {started.dht.peer_id}" in line for line in said), said
        assert "reachability not checked" in said[0], said  # a new swarm: nobody to ask
    finally:
        started.stop()
    assert not started.dht.is_alive()
    again = start_node(options, manifest, said.append)  # the identity was released with the stop
    again.stop()
