"""Integration tests with real peer processes, a real DHT and real RPC on loopback."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import torch
from hivemind import DHT

from conftest import client_dht, tiny_manifest_dict, wait_until
from swarm.client.rpc import call_stage
from swarm.client.trainer import Trainer
from swarm.dataset.shards import TextData, heldout_batches
from swarm.dht.records import fetch_announcements, fetch_trainer_reports
from swarm.errors import RemoteStageError
from swarm.local import processes
from swarm.manifests.validation import manifest_from_dict
from swarm.wire import messages

pytestmark = pytest.mark.integration


def wait_online(dht: DHT, manifest, counts: list[int], timeout: float = 60.0) -> None:
    async def online() -> list[int]:
        return [
            sum(a.state == "online" for a in await fetch_announcements(dht, manifest.swarm_id, s))
            for s in range(manifest.num_stages)
        ]

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(n >= c for n, c in zip(asyncio.run(online()), counts)):
            return
        time.sleep(0.5)
    raise AssertionError(f"stages did not come online: {asyncio.run(online())} < {counts}")


async def check_malformed_requests(p2p, manifest, raw: dict, first, second) -> None:
    """Malformed requests to both stages get error replies and leave the weights unchanged; a good request then
    trains. (Through the caller's P2P: unary calls from a second replica of the test's DHT, in another event loop,
    to a peer the first one called, time out.)"""
    config = manifest.model
    width, length, batch = config.width, config.context_length, manifest.training.microbatch_size
    stage0, stage1 = first.peer_id(), second.peer_id()
    hidden = torch.randn(batch, length, width)
    targets = torch.randint(0, 256, (batch, length))
    tokens = torch.randint(0, 256, (batch, length))
    other = manifest_from_dict({**raw, "name": "another-swarm"})

    def request(tensors, m=manifest, microbatch_id="mb", train=True, stage=1):
        return messages.make_request(m, stage, microbatch_id, tensors, train=train)

    nan_hidden = hidden.clone()
    nan_hidden[0, 0, 0] = float("nan")
    garbage = request([hidden, targets])
    garbage.metadata = b"\xff\x00 not msgpack"
    bad_version = request([hidden, targets])
    bad_version.metadata = messages.pack(
        {"swarm_id": manifest.swarm_id, "protocol_version": 999, "microbatch_id": "x", "train": True}
    )
    truncated = request([hidden, targets])
    truncated.tensors[0].buffer = truncated.tensors[0].buffer[:100]
    cases = {
        "wrong shape": (stage1, "forward", request([torch.randn(batch, length, width + 1), targets])),
        "wrong dtype": (stage1, "forward", request([hidden.double().float().half().float().long(), targets])),
        "NaN": (stage1, "forward", request([nan_hidden, targets])),
        "tokens out of range": (stage0, "forward", request([tokens + 300], stage=0)),
        "negative tokens": (stage0, "forward", request([tokens - 300], stage=0)),
        "targets out of range": (stage1, "forward", request([hidden, targets + 256])),
        "oversized batch": (
            stage1,
            "forward",
            request([torch.randn(batch * 4, length, width), targets.repeat(4, 1)]),
        ),
        "too long": (stage0, "forward", request([torch.randint(0, 256, (batch, length * 2))], stage=0)),
        "wrong swarm id": (stage1, "forward", request([hidden, targets], m=other)),
        "wrong protocol version": (stage1, "forward", bad_version),
        "garbage metadata": (stage1, "forward", garbage),
        "truncated buffer": (stage1, "forward", truncated),
        "missing targets": (stage1, "forward", request([hidden])),
        "backward of unknown microbatch": (
            stage0,
            "backward",
            request([hidden], microbatch_id="never-seen", stage=0),
        ),
        "backward to the last stage": (stage1, "backward", request([hidden, hidden])),
        "NaN gradient": (stage0, "backward", request([nan_hidden, tokens], stage=0)),
        "wrong stage": (stage0, "backward", request([hidden, hidden], stage=1)),
        "stage out of range": (stage0, "forward", request([tokens], stage=7)),
    }

    async def run():
        probe = request([hidden, targets], train=False)

        async def probe_loss() -> float:
            reply = await call_stage(p2p, stage1, "forward", probe, 10, batch * length * width)
            return float(messages.decode_reply(reply, 10**8)[0])

        async def first_stage_output() -> torch.Tensor:
            reply = await call_stage(
                p2p, stage0, "forward", request([tokens], train=False, stage=0), 10, batch * length * width
            )
            return messages.decode_reply(reply, 10**8)[0]

        before, before0 = await probe_loss(), await first_stage_output()
        errors = {}
        for name, (peer, kind, req) in cases.items():
            reply = await call_stage(p2p, peer, kind, req, 10, batch * length * width)
            with pytest.raises(RemoteStageError) as info:
                messages.decode_reply(reply, 10**8)
            errors[name] = info.value
        after, after0 = await probe_loss(), await first_stage_output()
        # the server still trains on a good request afterwards
        good = await call_stage(p2p, stage1, "forward", request([hidden, targets]), 10, batch * length * width)
        loss, grad = messages.decode_reply(good, 10**8)
        trained = await probe_loss()
        return before, after, before0, after0, errors, grad, trained

    before, after, before0, after0, errors, grad, trained = await run()
    assert before == after
    assert torch.equal(before0, after0)
    assert set(errors) == set(cases)
    for name, error in errors.items():
        expected = {"backward of unknown microbatch": "unknown_microbatch", "wrong stage": "wrong_stage"}.get(
            name, "bad_request"
        )
        assert error.code == expected, (name, error)
        assert len(str(error)) > 10
    assert "swarm" in str(errors["wrong swarm id"]) and "protocol" in str(errors["wrong protocol version"])
    assert grad.shape == hidden.shape
    assert trained != before  # a good request does change the weights
    assert first.process.poll() is None and second.process.poll() is None


@pytest.mark.slow(70)
def test_two_stage_swarm_refuses_malformed_requests_then_trains_and_heldout_loss_falls(start_peer, write_manifest):
    """One swarm for what were two tests: malformed requests get errors and leave the weights unchanged,
    then a trainer trains it and the held-out loss falls; a clean shutdown leaves an offline record."""
    # records live 3 announce periods: 1 s would let the "offline" record checked below expire during the
    # peer's own shutdown (checkpoint, daemons) on a busy machine
    raw = tiny_manifest_dict(network={"announce_period": 3.0})
    path = write_manifest(raw)
    first = start_peer(path, "--stage", "0", "--no-trainer")
    raw["initial_peers"] = [first.maddr()]
    manifest = manifest_from_dict(raw)
    path = write_manifest(raw, "joined.json")
    dht = client_dht(first.maddr())
    try:
        wait_online(dht, manifest, [1, 0])
        second = start_peer(path, "--no-trainer")  # no --stage: it must pick the stage nobody serves
        second.wait_for("serving stage 1")
        wait_online(dht, manifest, [1, 1])
        tokens = TextData.load("stdlib", shard=0, shards=4)
        batches = heldout_batches(tokens.heldout, 4, 8, manifest.model.context_length)

        async def run() -> tuple[float, float, Trainer]:
            p2p = await dht.replicate_p2p()
            await check_malformed_requests(p2p, manifest, raw, first, second)
            trainer = Trainer(manifest, dht, p2p, str(dht.peer_id), seed=0)
            before = await trainer.evaluate(batches)
            await trainer.train(tokens.train, asyncio.Event(), max_samples=8 * 120)
            after = await trainer.evaluate(batches)
            await p2p.shutdown()
            return before, after, trainer

        before, after, trainer = asyncio.run(run())
        assert trainer.samples >= 8 * 120
        assert trainer.failed_microbatches == 0
        assert after < 0.8 * before, (before, after)

        # a clean shutdown leaves an "offline" announcement behind (until it expires)
        second_id = second.peer_id()
        # (looked for while the peer shuts down: on a loaded machine its exit can outlast the record)
        second.process.send_signal(signal.SIGTERM)
        deadline, states = time.monotonic() + 30, {}
        while states.get(second_id) != "offline" and time.monotonic() < deadline:
            states = {a.peer_id: a.state for a in asyncio.run(fetch_announcements(dht, manifest.swarm_id, 1))}
            time.sleep(0.2)
        assert states.get(second_id) == "offline", states
        assert second.process.wait(timeout=30) == 0
    finally:
        dht.shutdown()


@pytest.mark.slow(35)
def test_the_relay_pipeline_trains_with_the_trainer_carrying_the_activations(start_peer, write_manifest):
    """training.pipeline: relay (swarm/client/relay.py): the trainer calls each stage in turn."""
    raw = tiny_manifest_dict(training={"pipeline": "relay"})
    first = start_peer(write_manifest(raw), "--stage", "0", "--no-trainer")
    raw["initial_peers"] = [first.maddr()]
    manifest = manifest_from_dict(raw)
    start_peer(write_manifest(raw, "joined.json"), "--stage", "1", "--no-trainer")
    dht = client_dht(first.maddr())
    try:
        wait_online(dht, manifest, [1, 1])
        tokens = TextData.load("stdlib", shard=2, shards=4)
        batches = heldout_batches(tokens.heldout, 2, 8, manifest.model.context_length)

        async def run() -> tuple[Trainer, float]:
            p2p = await dht.replicate_p2p()
            trainer = Trainer(manifest, dht, p2p, str(dht.peer_id), seed=0)
            await trainer.train(tokens.train, asyncio.Event(), max_samples=8 * 20)
            loss = await trainer.evaluate(batches)
            await p2p.shutdown()
            return trainer, loss

        trainer, loss = asyncio.run(run())
        assert trainer.samples >= 8 * 20 and trainer.failed_microbatches == 0
        assert 0 < loss < 10
        # stage 0's outputs and stage 1's input gradients came back to the trainer: at least one 8-bit activation
        # each (a byte per element) per sample, far more than the tokens the forward pipeline would send
        activation = manifest.model.context_length * manifest.model.width
        assert trainer.bytes_received > 2 * activation * trainer.samples, trainer.bytes_received
    finally:
        dht.shutdown()


@pytest.mark.slow(35)
def test_trainer_survives_sigkill_of_a_replica(start_peer, write_manifest):
    raw = tiny_manifest_dict()
    text = Path(write_manifest({}, "unused.json")).parent / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 2000)
    # serves stage 0 and trains, on a text file of its own
    first = start_peer(write_manifest(raw), "--stage", "0", "--status-every", "1", "--data", str(text))
    raw["initial_peers"] = [first.maddr()]
    manifest = manifest_from_dict(raw)
    path = write_manifest(raw, "joined.json")
    survivor = start_peer(path, "--stage", "1", "--no-trainer")
    victim = start_peer(path, "--stage", "1", "--no-trainer")
    dht = client_dht(first.maddr())
    try:
        wait_online(dht, manifest, [1, 2])
        survivor_id, victim_id = survivor.peer_id(), victim.peer_id()

        def served() -> dict[str, int]:
            anns = asyncio.run(fetch_announcements(dht, manifest.swarm_id, 1))
            return {a.peer_id: a.samples_served for a in anns}

        deadline = time.monotonic() + 60
        while served().get(victim_id, 0) == 0 or served().get(survivor_id, 0) == 0:
            assert time.monotonic() < deadline, f"both replicas should serve before the kill: {served()}"
            time.sleep(0.5)

        assert "training on 0.1M tokens in 4 chunks" in first.output(), first.tail()  # its own file, tokenized
        victim.kill()  # SIGKILL to the peer, its DHT process and its p2pd daemon
        killed_at = time.monotonic()
        samples_at_kill = first.status_lines()[-1]["trainer_samples"]
        survivor_at_kill = served()[survivor_id]
        # within 8 s: more than 40 samples trained, through the survivor (checked once both show, at most 8 s on)
        while True:
            latest, survivor_now = first.status_lines()[-1], served()[survivor_id]
            if latest["trainer_samples"] > samples_at_kill + 40 and survivor_now > survivor_at_kill:
                break
            if time.monotonic() > killed_at + 8:
                break
            time.sleep(0.5)
        assert latest["trainer_samples"] > samples_at_kill + 40, (samples_at_kill, latest)
        assert survivor_now > survivor_at_kill
        reports = asyncio.run(fetch_trainer_reports(dht, manifest.swarm_id))
        assert any(r.peer_id == first.peer_id() and r.samples > 0 for r in reports)
        # its signed report vouches for the stage-1 peers that trained its microbatches, never for itself
        attested = dict(next(r for r in reports if r.peer_id == first.peer_id()).served)
        assert attested.get(survivor_id, 0) > 0 and first.peer_id() not in attested, attested
        assert first.process.poll() is None and survivor.process.poll() is None
    finally:
        dht.shutdown()


@pytest.mark.slow(40)
def test_peers_stopped_while_training_log_no_traceback(start_peer, write_manifest):
    """A volunteer reads a traceback as a crash: a peer whose partner stops while it trains (incoming streams
    whose peer vanished before they began: hivemind's daemon bindings leave asyncio to log them with a traceback)
    and the peers' own clean stops print none, and each exits 0 by itself; nor does a peer stopped while its own
    trainer's microbatches wait at its stage for a next stage that is gone. The stage-1 peer is stopped as a
    terminal's Ctrl-C stops it (SIGINT to its whole process group): it still announces that it left, and its DHT
    process and p2pd daemon stop in order, not 'the hard way'."""
    raw = tiny_manifest_dict()
    first = start_peer(write_manifest(raw), "--stage", "0", "--status-every", "1")
    raw["initial_peers"] = [first.maddr()]
    second = start_peer(write_manifest(raw, "joined.json"), "--stage", "1", "--status-every", "1")
    second.wait_for_json(lambda line: (line.get("trainer_samples") or 0) >= 64, 90, "training")
    second.signal_group(signal.SIGINT)  # what a terminal's Ctrl-C does
    assert second.process.wait(timeout=30) == 0, second.tail()
    time.sleep(2)  # the other notices: its routes to the stopped peer fail, and their streams end
    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=30) == 0, first.tail()
    noise = ("Traceback", "Unhandled exception", "Task exception", "hard way", "failed during shutdown", "ERROR")
    for peer in (first, second):
        output = peer.output()
        assert "stopped cleanly" in output
        assert not [word for word in noise if word in output], output[-3000:]


@pytest.mark.parametrize("how", ["sigterm-to-peer", "ctrl-c-to-group"])
def test_clean_shutdown_leaves_nothing_behind(start_peer, write_manifest, how):
    before = set(Path("/tmp").glob("hivemind-*.sock"))
    peer = start_peer(write_manifest(tiny_manifest_dict()), "--stage", "0", "--no-trainer")
    peer.maddr()
    peer.wait_for("serving stage 0")
    # the socket files its processes (python, DHT process, p2pd) have open: new since the test began. (Not all
    # new files in /tmp: other tests, or other users' peers, may run meanwhile.)
    ours = {p for p in peer.socket_files() if p.name.startswith("hivemind-")}
    assert any("p2pd" in p.name for p in ours), ours
    assert ours <= set(Path("/tmp").glob("hivemind-*.sock")) - before, (ours, before)
    # shared memory is file descriptors: no torch_shm_manager, whose exit printed a C++ error into the terminal
    names = {key.split()[0] for key in processes.memory_mb(peer.pid)}
    assert "p2pd" in names and not [name for name in names if name.startswith("torch_shm")], names  # 15 chars
    begin = time.monotonic()
    if how == "sigterm-to-peer":
        peer.process.send_signal(signal.SIGTERM)
    else:
        peer.signal_group(signal.SIGINT)
    assert peer.process.wait(timeout=30) == 0, peer.output()
    took = time.monotonic() - begin
    assert "stopped cleanly" in peer.output()
    # its p2p daemon did not stop under it (a Ctrl-C to the group reaches the peer only: its DHT process and p2pd
    # live in a group of their own): no daemon error, no DHT process terminated 'the hard way', and quick
    noise = ("go-libp2p-daemon", "hard way", "failed during shutdown", "Traceback", "terminate called")
    assert took < 10, took
    wait_until(lambda: not peer.group_alive(), 10, "the DHT process and p2pd daemon to end with the peer")
    assert not [word for word in noise if word in peer.output()], peer.output()[-3000:]
    leftover = {p for p in ours if p.exists()}
    assert not leftover, leftover


@pytest.mark.slow(70)
def test_large_activations_go_by_stream(start_peer, write_manifest):
    # 32 x 64 x 512 float32 activations are 4 MiB: more than one unary message may carry
    raw = tiny_manifest_dict(
        model={"width": 512, "heads": 8, "context_length": 64},
        training={"microbatch_size": 32, "max_in_flight": 1, "activation_compression": "float32"},
    )
    manifest = manifest_from_dict(raw)
    activation_bytes = 32 * 64 * 512 * 4
    assert messages.needs_stream(activation_bytes, 32 * 64 * 512)
    # no measurements of this model; status lines every second (stage 0's bytes are read from them)
    flags = ("--no-trainer", "--throughput", "100", "--bandwidth", "1000", "--status-every", "1")
    first = start_peer(write_manifest(raw), "--stage", "0", *flags)
    raw["initial_peers"] = [first.maddr()]
    last = start_peer(write_manifest(raw, "joined.json"), "--stage", "1", *flags)
    dht = client_dht(first.maddr())
    try:
        wait_online(dht, manifest, [1, 1])
        tokens = TextData.load("stdlib", shard=1, shards=4)

        async def run():
            p2p = await dht.replicate_p2p()
            trainer = Trainer(manifest, dht, p2p, str(dht.peer_id), seed=0)
            await trainer.train(tokens.train, asyncio.Event(), max_samples=32 * 3)
            # an oversized message by stream is refused while it arrives, and the peer stays up
            huge = messages.make_request(manifest, 1, "big", [torch.randn(64, 64, 512), torch.zeros(64, 64).long()])
            reply = await call_stage(p2p, last.peer_id(), "forward", huge, 30, 64 * 64 * 512)
            with pytest.raises(RemoteStageError) as info:
                messages.decode_reply(reply, 10**9)
            await p2p.shutdown()
            return trainer, info.value

        trainer, error = asyncio.run(run())
        assert trainer.samples == 32 * 3 and trainer.failed_microbatches == 0
        # stage 0 sent its activations on to stage 1 and got their gradient back, by stream: two activation-sized
        # messages per microbatch; the trainer's own link carried only tokens and losses
        line = first.wait_for_json(lambda s: s.get("forwarded", 0) >= 3, timeout=20)
        assert line["forwarded"] == 3
        assert line["activation_bytes_sent"] > 3 * activation_bytes
        assert line["activation_bytes_received"] > 3 * activation_bytes
        assert trainer.bytes_sent + trainer.bytes_received < 3 * 32 * 64 * 8 * 3
        assert error.code == "bad_request"
        assert last.process.poll() is None
    finally:
        dht.shutdown()
