"""Signed records (swarm/trust/signing.py): only the peer that owns a libp2p identity writes the records under its peer id.

Real hivemind DHT nodes on loopback: a victim and an honest node run the swarm's validator; the forger runs a bare
hivemind node (it stores whatever it likes in its own storage and sends it to the others) or one that signs with
its own key.
"""

from __future__ import annotations

import asyncio

import pytest
from hivemind import DHT
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from conftest import tiny_manifest_dict
from swarm.dht import node
from swarm.dht.records import (
    Announcement,
    PeerState,
    TrainerReport,
    fetch_announcements,
    fetch_trainer_reports,
    stage_key,
    store_announcement,
    store_trainer_report,
    trainers_key,
)
from swarm.manifests.manifest import Manifest
from swarm.manifests.validation import manifest_from_dict
from swarm.trust.signing import (
    OWNER_KEY_FIELD,
    SIGNATURE_FIELD,
    IdentityKey,
    SignedRecordValidator,
    peer_id_bytes,
    rejected_records,
)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def swarm():
    manifest = manifest_from_dict(tiny_manifest_dict())
    victim_key, honest_key = IdentityKey.generate(), IdentityKey.generate()
    nodes = []
    try:
        victim = node.start_dht([], LOOPBACK, identity=victim_key)
        nodes.append(victim)
        maddrs = [str(a) for a in victim.get_visible_maddrs()]
        honest = node.start_dht(maddrs, LOOPBACK, identity=honest_key)
        nodes.append(honest)
        forger = DHT(initial_peers=maddrs, start=True, host_maddrs=LOOPBACK)  # no validator: stores anything
        nodes.append(forger)
        node.sign_records(victim, manifest, victim_key)
        node.sign_records(honest, manifest, honest_key)
        yield manifest, victim, victim_key, honest, forger
    finally:
        for dht in nodes:
            dht.shutdown()


def run(coroutine):
    """(A store's result is the answer of whichever replica answered first, the forger's included: tests look at
    what readers see instead.)"""
    return asyncio.run(coroutine)


def announcement(peer_id: str, **fields) -> Announcement:
    return Announcement(**{"peer_id": peer_id, "stage": 1, "state": PeerState.ONLINE, "throughput": 5.0, **fields})


def raw_store(dht: DHT, key: str, subkey: str, value: dict, expiration: float) -> bool:
    return dht.store(key, value, expiration_time=expiration, subkey=subkey)


def raw_record(dht: DHT, key: str, subkey: str) -> tuple[dict, float] | None:
    """A record with its signature fields, as any reader gets it."""
    found = dht.get(key, latest=True)
    if found is None or subkey not in found.value:
        return None
    item = found.value[subkey]
    return item.value, item.expiration_time


def seen_by(dht: DHT, manifest: Manifest, peer_id: str) -> Announcement | None:
    return next((a for a in run(fetch_announcements(dht, manifest.swarm_id, 1)) if a.peer_id == peer_id), None)


def test_a_peer_signs_its_records_and_others_read_them(swarm):
    manifest, victim, victim_key, honest, forger = swarm
    assert str(victim.peer_id) == victim_key.peer_id  # the DHT runs on the key that signs
    run(store_announcement(victim, manifest.swarm_id, announcement(victim_key.peer_id), 30))
    assert seen_by(honest, manifest, victim_key.peer_id).throughput == 5.0
    value, _ = raw_record(honest, stage_key(manifest.swarm_id, 1), victim_key.peer_id)
    # what binds the record to the libp2p identity: its key hashes to the peer id
    assert peer_id_bytes(value[OWNER_KEY_FIELD]) == victim.peer_id.to_bytes()
    assert isinstance(value[SIGNATURE_FIELD], bytes)
    assert value["throughput"] == 5.0  # readers that check nothing still read the record


def test_a_forger_cannot_overwrite_or_replace_another_peers_announcement(swarm):
    manifest, victim, victim_key, honest, forger = swarm
    run(store_announcement(victim, manifest.swarm_id, announcement(victim_key.peer_id, throughput=7.0), 30))
    rejected_before = rejected_records(honest)
    key = stage_key(manifest.swarm_id, 1)
    forged = announcement(victim_key.peer_id, throughput=999.0).to_record()
    forged["state"] = "offline"  # "the victim left": would take it out of every route
    stolen, _ = raw_record(honest, key, victim_key.peer_id)  # a real signature, on another record
    raw_store(forger, key, victim_key.peer_id, forged, get_dht_time() + 60)  # later expiration: would win
    stolen = {**forged, OWNER_KEY_FIELD: stolen[OWNER_KEY_FIELD], SIGNATURE_FIELD: stolen[SIGNATURE_FIELD]}
    raw_store(forger, key, victim_key.peer_id, stolen, get_dht_time() + 61)
    for reader in (honest, victim):
        seen = seen_by(reader, manifest, victim_key.peer_id)
        assert seen is not None and seen.state == PeerState.ONLINE and seen.throughput == 7.0
    assert rejected_records(honest) > rejected_before  # counted


def test_a_forger_signing_with_its_own_key_cannot_write_under_another_peer_id(swarm):
    manifest, victim, victim_key, honest, forger = swarm
    run(store_announcement(victim, manifest.swarm_id, announcement(victim_key.peer_id, throughput=8.0), 30))
    forger_key = IdentityKey.generate()
    # a validator that signs with the forger's key whatever subkey it is given
    signer = SignedRecordValidator([stage_key(manifest.swarm_id, 1)], forger_key)
    signer._own_subkey = MSGPackSerializer.dumps(victim_key.peer_id)
    key = stage_key(manifest.swarm_id, 1)
    expiration = get_dht_time() + 60
    record = DHTRecord(
        signer.protected.copy().pop(),
        MSGPackSerializer.dumps(victim_key.peer_id),
        MSGPackSerializer.dumps(announcement(victim_key.peer_id, throughput=999.0).to_record()),
        expiration,
    )
    signed = MSGPackSerializer.loads(signer.sign_value(record))
    assert signed[SIGNATURE_FIELD]  # a well-formed signature, by the wrong key
    raw_store(forger, key, victim_key.peer_id, signed, expiration)
    assert seen_by(honest, manifest, victim_key.peer_id).throughput == 8.0
    assert not SignedRecordValidator([key], None).validate(
        DHTRecord(record.key, record.subkey, MSGPackSerializer.dumps(signed), expiration)
    )


def test_a_forger_cannot_impersonate_a_peer_under_its_own_id(swarm):
    """A forger's own, validly signed record that names the victim in its body is dropped by the reader."""
    manifest, victim, victim_key, honest, forger = swarm
    impostor_key = IdentityKey.generate()
    impostor = node.start_dht([str(a) for a in victim.get_visible_maddrs()], LOOPBACK, identity=impostor_key)
    try:
        node.sign_records(impostor, manifest, impostor_key)
        fake = {**announcement(victim_key.peer_id, throughput=555.0).to_record()}
        assert impostor.store(stage_key(manifest.swarm_id, 1), fake, get_dht_time() + 30, subkey=impostor_key.peer_id)
        anns = run(fetch_announcements(honest, manifest.swarm_id, 1))
        assert all(a.throughput != 555.0 for a in anns)
        assert impostor_key.peer_id not in {a.peer_id for a in anns}
    finally:
        impostor.shutdown()


def test_a_replayed_old_record_does_not_replace_a_newer_one(swarm):
    manifest, victim, victim_key, honest, forger = swarm
    key = stage_key(manifest.swarm_id, 1)
    run(store_announcement(victim, manifest.swarm_id, announcement(victim_key.peer_id, state=PeerState.JOINING), 30))
    old, old_expiration = raw_record(honest, key, victim_key.peer_id)
    assert old["state"] == "joining"
    run(store_announcement(victim, manifest.swarm_id, announcement(victim_key.peer_id, throughput=9.0), 40))
    raw_store(forger, key, victim_key.peer_id, old, old_expiration)  # the old record as it was: older, refused
    raw_store(forger, key, victim_key.peer_id, old, get_dht_time() + 300)  # given a later expiration: not signed
    for reader in (honest, victim):
        seen = seen_by(reader, manifest, victim_key.peer_id)
        assert seen.state == PeerState.ONLINE and seen.throughput == 9.0


def test_trainer_reports_are_signed_too(swarm):
    manifest, victim, victim_key, honest, forger = swarm
    report = TrainerReport(peer_id=victim_key.peer_id, loss=2.5, samples_per_second=3.0, samples=100)
    run(store_trainer_report(victim, manifest.swarm_id, report, 30))
    forged = TrainerReport(
        peer_id=victim_key.peer_id,
        loss=0.1,
        samples_per_second=3.0,
        samples=10**9,
        served=((str(forger.peer_id), 10**9),),  # vouching for a friend
    ).to_record()
    raw_store(forger, trainers_key(manifest.swarm_id), victim_key.peer_id, forged, get_dht_time() + 60)
    reports = {r.peer_id: r for r in run(fetch_trainer_reports(honest, manifest.swarm_id))}
    assert reports[victim_key.peer_id].samples == 100 and reports[victim_key.peer_id].served == ()
