"""--identity: a peer keeps its id across restarts; two peers with one identity get a clear error."""

from __future__ import annotations

import shutil
import signal

import pytest

from conftest import tiny_manifest_dict
from swarm.errors import PeerStartError
from swarm.trust.identity import claim_identity, without_own_address

pytestmark = pytest.mark.integration


def test_identity_file_is_created_locked_and_validated(tmp_path):
    path = tmp_path / "peer.key"
    peer_id, handle = claim_identity(path)
    assert path.exists() and peer_id.startswith("Qm")  # hivemind's identities are RSA keys
    with pytest.raises(PeerStartError, match="in use by another peer on this machine"):
        claim_identity(path)
    handle.release()  # the lock is released
    again, handle = claim_identity(path)
    assert again == peer_id
    handle.release()

    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    with pytest.raises(PeerStartError, match="is not an identity file"):
        claim_identity(garbage)
    with pytest.raises(PeerStartError, match="does not exist"):
        claim_identity(tmp_path / "missing" / "peer.key")


def test_own_address_is_dropped_from_initial_peers():
    peers = ["/ip4/10.0.0.1/tcp/1/p2p/QmA", "/ip4/10.0.0.2/tcp/1/p2p/QmB"]
    assert without_own_address(peers, "QmA") == ["/ip4/10.0.0.2/tcp/1/p2p/QmB"]
    assert without_own_address(peers, "QmC") == peers


@pytest.mark.slow(50)
def test_identity_survives_restart_and_cannot_be_shared(start_peer, write_manifest, tmp_path):
    identity = tmp_path / "first.key"
    fast = {"averaging": {"mode": "none"}}  # no averager process to start: identities have nothing to do with it
    path = write_manifest(tiny_manifest_dict(**fast))
    flags = ("--no-trainer", "--throughput", "100", "--bandwidth", "1000")  # nothing to measure
    first = start_peer(path, "--stage", "0", *flags, "--identity", str(identity))
    first_id = first.peer_id()
    # its DHT is up and the file is locked: its twin and its clone start at once (each is refused by itself)
    joined = write_manifest(tiny_manifest_dict(initial_peers=[first.maddr()], **fast), "joined.json")
    copy = tmp_path / "copy.key"
    shutil.copy(identity, copy)
    twin = start_peer(path, "--stage", "1", *flags, "--identity", str(identity))
    clone = start_peer(joined, "--stage", "1", *flags, "--identity", str(copy))
    first.wait_for("serving stage 0")

    # the same file on this machine: refused at once, by the lock
    assert twin.process.wait(timeout=60) == 2
    assert "is in use by another peer on this machine" in twin.output()

    # a copy of the file (as on another machine): the swarm says the id is connected already
    assert clone.process.wait(timeout=60) == 2
    assert "a peer with this id" in clone.output() and "already in the swarm" in clone.output()

    # killed and restarted: the same id, and its own address among the initial peers does not stop it
    first.signal_all(signal.SIGKILL)
    first.kill()
    again = start_peer(joined, "--stage", "0", *flags, "--identity", str(identity))
    assert again.peer_id() == first_id
    again.wait_for("serving stage 0")
