"""Peers that others cannot dial: the dial-back check, reverse connections, and a stage served by a non-listener."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
from hivemind import DHT

from conftest import LOOPBACK, ROOT, tiny_manifest_dict, wait_until
from swarm.dht.announcement_cache import AnnouncementCache
from swarm.dht.records import Announcement, announcement_lifetime, store_announcement
from swarm.manifests.loading import load_manifest
from swarm.manifests.validation import manifest_from_dict
from swarm.server.reachability import (
    BUSY,
    ReachabilityService,
    ReverseConnector,
    busy_helpers,
    check_reachability,
    direct_addresses,
    verdict_of,
)

PEER = "12D3KooWEKYnHv3sXsjiyHYCaWwTAudbWmyGtnL2RZJUbA9FnEdV"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- pure parts


def test_direct_addresses_keep_only_dialable_ones():
    good = "/ip4/127.0.0.1/tcp/4000"
    claimed = [
        good,
        f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}",  # its own id is dropped: the dial names the peer
        f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}/p2p-circuit/p2p/{PEER}",  # relays are not a direct path
        "not a multiaddr",
        42,
        "/ip4/" + "9" * 300,
    ]
    assert [str(a) for a in direct_addresses(claimed, PEER)] == [good, "/ip4/127.0.0.1/tcp/4001"]
    assert direct_addresses("/ip4/127.0.0.1/tcp/1", PEER) == []  # not a list
    assert len(direct_addresses([good] * 100, PEER)) == 8  # an asker cannot make a helper dial without end


def test_verdict_is_the_majority_of_those_that_answered():
    yes, no, silent = {"reachable": True}, {"reachable": False, "error": "refused"}, {"reachable": None, "error": "x"}
    assert verdict_of([yes, no, yes]).reachable is True
    assert verdict_of([yes, no]).reachable is False  # a tie is not a majority
    assert verdict_of([no, silent, silent]).reachable is False and "refused" in verdict_of([no]).detail
    assert verdict_of([silent, silent]).reachable is None
    assert verdict_of([]).reachable is None


# ------------------------------------------------------------------------------- real hivemind, in-process


@pytest.fixture
def helper():
    """A listening DHT node that answers reachability checks, from an event loop in a thread of its own."""
    dht = DHT(start=True, host_maddrs=[LOOPBACK])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    service = ReachabilityService()

    async def register():
        p2p = await dht.replicate_p2p()
        await service.add_p2p_handlers(p2p, namespace=ReachabilityService.NAMESPACE)
        return p2p

    p2p = asyncio.run_coroutine_threadsafe(register(), loop).result(30)
    try:
        yield dht, [str(a) for a in dht.get_visible_maddrs()]
    finally:
        asyncio.run_coroutine_threadsafe(service.shutdown(), loop).result(30)  # its probe daemon
        asyncio.run_coroutine_threadsafe(p2p.shutdown(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        dht.shutdown()


def test_check_tells_a_listening_peer_from_one_that_cannot_be_dialed(helper):
    _, bootstrap = helper
    started = time.monotonic()
    verdict = asyncio.run(check_reachability(bootstrap, [LOOPBACK], None))
    assert verdict.reachable is True, verdict.detail
    # it listens, but tells the world a port where nobody answers: as behind a NAT without port forwarding
    verdict = asyncio.run(check_reachability(bootstrap, [LOOPBACK], [f"/ip4/127.0.0.1/tcp/{closed_port()}"]))
    assert verdict.reachable is False and "could not dial it back" in verdict.detail, verdict.detail
    assert time.monotonic() - started < 30
    assert asyncio.run(check_reachability([], [LOOPBACK], None)).reachable is None  # nobody to ask


def test_only_busy_helpers_are_asked_again_and_only_while_nobody_answered():
    busy, gone, yes = (
        {"reachable": None, "error": BUSY},
        {"reachable": None, "error": "TimeoutError"},
        {"reachable": True},
    )
    assert busy_helpers({"a": busy, "b": gone, "c": busy}) == ["a", "c"]
    assert busy_helpers({"a": busy, "b": yes}) == []  # one answer is a verdict
    assert busy_helpers({"a": gone}) == []


def test_peers_that_check_at_once_through_one_helper_all_get_a_verdict(helper):
    """A helper checks one asker at a time and tells the others it is busy: they ask again after a pause, so
    peers started together (a demo, a machine with several GPUs) all learn whether they are reachable."""
    _, bootstrap = helper

    async def three_at_once():
        return await asyncio.gather(*[check_reachability(bootstrap, [LOOPBACK], None) for _ in range(3)])

    verdicts = asyncio.run(three_at_once())
    assert [v.reachable for v in verdicts] == [True, True, True], [v.detail for v in verdicts]


def test_reverse_connector_lets_others_call_a_peer_that_does_not_listen(helper):
    first, bootstrap = helper
    manifest = manifest_from_dict(tiny_manifest_dict())
    hidden = DHT(initial_peers=bootstrap, start=True, no_listen=True, client_mode=True)
    caller = DHT(initial_peers=bootstrap, start=True, host_maddrs=[LOOPBACK])
    try:
        caller_maddrs = tuple(str(a) for a in caller.get_visible_maddrs())

        async def scenario() -> tuple[bool, bool, set[str]]:
            hidden_p2p, caller_p2p = await hidden.replicate_p2p(), await caller.replicate_p2p()
            await ReachabilityService().add_p2p_handlers(hidden_p2p, namespace=ReachabilityService.NAMESPACE)
            stub = ReachabilityService.stub(caller_p2p, hidden_p2p.peer_id)

            async def can_call() -> bool:
                try:
                    await asyncio.wait_for(stub.rpc_check(_empty_request(), timeout=3), 3)
                    return True
                except Exception:
                    return False

            # the caller announces itself with its addresses, as every stage peer does
            caller_id = caller_p2p.peer_id.to_base58()
            announcement = Announcement(
                peer_id=caller_id, stage=0, state="online", throughput=1.0, maddrs=caller_maddrs
            )
            await store_announcement(caller, manifest.swarm_id, announcement, announcement_lifetime(5))
            view = AnnouncementCache(hidden, manifest.swarm_id, manifest.num_stages, max_age=0.0)
            connector = ReverseConnector(hidden_p2p, view, hidden_p2p.peer_id.to_base58(), 5.0)
            await connector.connect_all()  # reads the records (through the DHT) and dials whoever is missing
            assert connector.connected == {caller_id}
            # reading the DHT may itself have connected the two: cut that, so that only the dial can help
            await hidden_p2p._client.disconnect(caller_p2p.peer_id)
            deadline = asyncio.get_running_loop().time() + 15  # (the connection may take a moment to close)
            while (before := await can_call()) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.2)
            await connector.dial_missing({caller_id: caller_maddrs})
            result = before, await can_call(), connector.dialed
            await hidden_p2p.shutdown()
            await caller_p2p.shutdown()
            return result

        before, after, connected = asyncio.run(scenario())
        assert not before  # nobody can dial a node that does not listen
        assert after and connected == {str(caller.peer_id)}
    finally:
        hidden.shutdown()
        caller.shutdown()


def served(peer) -> int:
    lines = peer.status_lines()
    return (lines[-1].get("samples_served") or 0) if lines else 0


def _empty_request():
    from hivemind.proto import runtime_pb2

    return runtime_pb2.ExpertRequest()


# ------------------------------------------------------------------------------------ real peer processes


@pytest.mark.integration
@pytest.mark.slow(90)
def test_a_peer_that_does_not_listen_serves_a_stage_and_one_that_cannot_be_dialed_back_says_so(
    start_peer, write_manifest, tmp_path
):
    """One swarm for what were two tests: a peer that does not listen serves a stage (others reach it through the
    connections it opens), and peer-status shows it; a peer that others cannot dial back says so at its start."""
    original = write_manifest(tiny_manifest_dict(), "swarm.json")
    path = tmp_path / "published.json"
    flags = ("--stage", "0", "--no-trainer", "--public-name", "first")
    first = start_peer(original, "--new-swarm", "--write-manifest", str(path), *flags)
    first.wait_for("serving stage 0")
    assert load_manifest(path).initial_peers == (first.maddr(),)  # the copy, ready to publish
    assert load_manifest(original).initial_peers == ()  # the original is left alone
    # started together: the trainer's dial-back check asks the listening peers only (the first), and its
    # microbatches wait for stage 1 to be served
    status = ("--status-every", "1")
    hidden = start_peer(path, "--no-listen", "--stage", "1", "--no-trainer", "--public-name", "hidden", *status)
    # the only peer of stage 1 does not listen: this trainer's microbatches can only pass through it
    trainer = start_peer(path, "--stage", "0", "--public-name", "trainer", *status)
    assert trainer.wait_for(r"reachable: 1 of 1 peers dialed it back")
    # a peer that announces an address where nobody can dial it: it says so, and serves all the same (stage 0: it
    # takes the stage's state from a peer it can dial, not from the hidden one); it starts while the others train
    behind_nat = start_peer(
        path,
        "--stage",
        "0",
        "--no-trainer",
        "--public-name",
        "behind-nat",
        "--announce-maddrs",
        f"/ip4/127.0.0.1/tcp/{closed_port()}",
    )
    hidden.wait_for("serving stage 1")
    trained = wait_until(
        lambda: [s for s in trainer.status_lines() if (s.get("trainer_samples") or 0) >= 64],
        90,
        "the trainer to train 64 samples through the peer that does not listen",
    )
    assert trained[-1]["trainer_samples"] >= 64, trainer.tail()
    assert wait_until(lambda: served(hidden) > 0, 30, "the hidden peer's status to show samples served")
    behind_nat.wait_for("NOT reachable from other peers")
    behind_nat.wait_for("serving stage 0")
    assert "reachable at:" not in behind_nat.output()

    # peer-status shows who cannot be dialed: the peer that does not listen, and the one behind a NAT
    def peer_status() -> dict:
        result = subprocess.run(
            [sys.executable, "-m", "peers.peer_status", "--join", str(path), "--json"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def all_four() -> dict | None:  # the last one's first announcement may take a moment to be stored
        document = peer_status()
        return document if len(document["peers"]) >= 4 else None

    document = wait_until(all_four, 60, "peer-status to list the 4 peers")
    reachable = {p["public_name"]: p["reachable"] for p in document["peers"]}
    assert reachable == {"first": True, "hidden": False, "trainer": True, "behind-nat": False}, reachable
    assert document["swarm"]["peers_unreachable"] == 2
