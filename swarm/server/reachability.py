"""Can other peers dial this one? The dial-back check on start, the service that answers others' checks, and
reverse connections for a peer that nobody can dial.

A helper dials from a separate "probe" daemon, never from its own: its own daemon would reuse the connection the
asker opened and always succeed. A peer nobody can dial opens connections to the peers that may call it, and
their calls ride on those. hivemind's circuit relays are not used: they cut every relayed connection after 128 KiB
per direction, about one microbatch of the demo's activations. Details: docs/NETWORK.md, "Peers behind NAT".
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from dataclasses import dataclass

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from multiaddr import Multiaddr

from swarm.dht.announcement_cache import AnnouncementCache
from swarm.dht.node import daemon_sockets, remove_stale_sockets
from swarm.dht.records import PeerState, fetch_trainer_reports
from swarm.manifests.manifest import Manifest
from swarm.wire.messages import pack, unpack
from swarm.wire.rpc import ReachabilityRPC

logger = logging.getLogger(__name__)

MAX_CLAIMED_ADDRS = 8  # a check dials at most this many of the addresses the asker claims
MAX_ADDR_LENGTH = 256
DIAL_TIMEOUT = 5.0
CHECK_TIMEOUT = 15.0  # the asker's limit for one helper's answer
MAX_HELPERS = 3
BUSY = "busy with another check"
BUSY_RETRIES = 3  # an asker whose helpers were all busy (peers that start together) asks again, after a pause
BUSY_PAUSE = (0.5, 2.0)  # seconds, at random
RECHECK_AFTER = 60.0  # seconds before a helper checks the same asker again (a real asker asks once, at its start)
MAX_REMEMBERED_ASKERS = 4096
MAX_DIALS_PER_ROUND = 64  # of a reverse connector: records are public, so their number is not ours to choose
CONCURRENT_DIALS = 16
# the probe dials out only: no listening, no relays, no NAT tricks, so its dials test exactly one thing
PROBE_OPTIONS = dict(
    no_listen=True, use_relay=False, use_auto_relay=False, auto_nat=False, nat_port_map=False, dht_mode="client"
)


@dataclass(frozen=True)
class Verdict:
    reachable: bool | None  # None: nobody could be asked, or nobody answered
    detail: str


def direct_addresses(claimed: object, peer_id: str) -> list[Multiaddr]:
    """The dialable addresses among those an asker claims: parsed, without relay circuits, at most 8."""
    if not isinstance(claimed, list):
        return []
    result = []
    for text in claimed[:MAX_CLAIMED_ADDRS]:
        if not isinstance(text, str) or len(text) > MAX_ADDR_LENGTH or "p2p-circuit" in text:
            continue
        try:
            addr = Multiaddr(text)
            if "/p2p/" in text:
                addr = addr.decapsulate(Multiaddr(f"/p2p/{peer_id}"))
        except Exception:  # the multiaddr library raises several unrelated types
            continue
        result.append(addr)
    return result


def verdict_of(replies: list[dict]) -> Verdict:
    """Reachable if most helpers that answered could dial it; unknown if none answered."""
    answered = [r for r in replies if isinstance(r.get("reachable"), bool)]
    if not answered:
        reasons = "; ".join(str(r.get("error", ""))[:120] for r in replies) or "no other peer to ask"
        return Verdict(None, f"nobody could check ({reasons})")
    yes = sum(r["reachable"] for r in answered)
    if 2 * yes > len(answered):
        return Verdict(True, f"{yes} of {len(answered)} peers dialed it back")
    errors = "; ".join(str(r.get("error", ""))[:120] for r in answered if not r["reachable"])
    return Verdict(False, f"{len(answered) - yes} of {len(answered)} peers could not dial it back ({errors})")


def busy_helpers(replies: dict[str, dict]) -> list[str]:
    """The helpers to ask again: those that were busy, when no helper could answer yet."""
    if any(isinstance(reply.get("reachable"), bool) for reply in replies.values()):
        return []
    return [helper for helper, reply in replies.items() if reply.get("error") == BUSY]


def ip_of(addr: Multiaddr) -> str | None:
    for protocol in ("ip4", "ip6"):
        try:
            return addr.value_for_protocol(protocol)
        except Exception:  # the multiaddr library raises several unrelated types
            continue
    return None


class ReachabilityService(ReachabilityRPC):
    """Every peer answers "can you dial me?" by dialing the asker from a probe daemon.

    It dials only the asker's own peer id, and only at addresses on the IP the asker is connected from, so a
    check cannot make it dial (or probe the ports of) anyone else. One check at a time; others get "busy". An
    asker is checked at most once a minute (a peer asks once, as it starts, from a node of its own): a flood of
    checks from one identity gets a refusal each, without a dial, and does not keep others' checks waiting.
    In a private swarm (`manifest` names a secret) it checks only askers that prove they hold the secret.
    """

    def __init__(self, manifest: Manifest | None = None) -> None:
        self.manifest = manifest
        self._p2p: P2P | None = None
        self._probe: P2P | None = None
        self._lock = asyncio.Lock()
        self._checked: dict[str, float] = {}  # asker's peer id -> when this helper last dialed it (monotonic)
        self.refused = 0  # checks refused for asking again too soon

    async def add_p2p_handlers(self, p2p: P2P, *args, **kwargs) -> None:
        self._p2p = p2p  # to see which IP an asker is connected from
        await super().add_p2p_handlers(p2p, *args, **kwargs)

    async def rpc_check(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        started = time.monotonic()
        reachable, error = await self._check(request, context)
        reply = {"reachable": reachable, "error": error, "seconds": round(time.monotonic() - started, 3)}
        return runtime_pb2.ExpertResponse(metadata=pack(reply))

    async def _check(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> tuple[bool | None, str]:
        """(verdict, why); None: this helper cannot tell (busy, asked again too soon, or its probe does not work)."""
        asker_id, now = context.remote_id.to_base58(), time.monotonic()
        last = self._checked.get(asker_id)
        if last is not None and now - last < RECHECK_AFTER:
            self.refused += 1
            return None, f"this helper checked this peer {now - last:.0f} s ago: ask again in a minute"
        if self._lock.locked():
            return None, BUSY
        try:
            metadata = unpack(request.metadata) if request.metadata else {}
        except Exception:
            metadata = {}
        metadata = metadata if isinstance(metadata, dict) else {}
        claimed = metadata.get("maddrs")
        asker = context.remote_id
        if self.manifest is not None and self.manifest.private:
            secret = self.manifest.secret
            if secret is None or not secret.check(asker.to_base58(), metadata.get("proof")):
                return None, "this swarm is private: the check needs a proof that the asker holds its secret"
        async with self._lock:
            connected_from = await self._connected_ips(asker)
            addrs = [a for a in direct_addresses(claimed, asker.to_base58()) if ip_of(a) in connected_from]
            if not addrs:
                return False, "none of its addresses is on the IP it connects from"
            self._remember(asker_id, now)  # (only dials count: answering without one costs nothing)
            try:
                probe = await self._get_probe()
            except Exception as e:
                logger.warning(f"the reachability probe daemon did not start: {e!r}")
                return None, "this helper's probe does not work"
            try:
                # connect() authenticates the remote: it fails unless the asker itself answers there
                await asyncio.wait_for(probe._client.connect(asker, addrs), DIAL_TIMEOUT)
                return True, ""
            except TimeoutError:
                return False, f"dialing it timed out after {DIAL_TIMEOUT:g} s"
            except (ConnectionError, FileNotFoundError) as e:  # the probe's control socket: the probe died
                self._probe = None
                return None, f"this helper's probe failed ({type(e).__name__})"
            except Exception as e:
                return False, f"dialing it failed ({type(e).__name__}: {str(e)[:120]})"
            finally:
                try:  # the next check must dial afresh
                    await probe._client.disconnect(asker)
                except Exception:
                    pass

    def _remember(self, asker_id: str, now: float) -> None:
        if len(self._checked) >= MAX_REMEMBERED_ASKERS:  # forget those whose minute is over (a flood of identities)
            self._checked = {p: t for p, t in self._checked.items() if now - t < RECHECK_AFTER}
            if len(self._checked) >= MAX_REMEMBERED_ASKERS:
                self._checked.pop(next(iter(self._checked)))
        self._checked[asker_id] = now

    async def _connected_ips(self, peer: PeerID) -> set[str]:
        if self._p2p is None:
            return set()
        ips = set()
        for info in await self._p2p.list_peers():
            if info.peer_id == peer:
                ips.update(ip for addr in info.addrs if (ip := ip_of(addr)) is not None)
        return ips

    async def _get_probe(self) -> P2P:
        # hivemind's is_alive stays True when p2pd exits by itself: look at the process too
        if self._probe is None or not self._probe.is_alive or self._probe._child.returncode is not None:
            self._probe = await P2P.create(**PROBE_OPTIONS)
        return self._probe

    async def shutdown(self) -> None:
        if self._probe is not None:
            await self._probe.shutdown()
            self._probe = None


async def _ask(p2p: P2P, helper: str, maddrs: list[str], proof: str | None) -> dict:
    try:
        stub = ReachabilityRPC.stub(p2p, helper)
        fields = {"maddrs": maddrs} if proof is None else {"maddrs": maddrs, "proof": proof}
        request = runtime_pb2.ExpertRequest(metadata=pack(fields))
        reply = await asyncio.wait_for(stub.rpc_check(request, timeout=CHECK_TIMEOUT), CHECK_TIMEOUT)
        answer = unpack(reply.metadata)
        if not isinstance(answer, dict) or not (
            type(answer.get("reachable")) is bool or answer.get("reachable") is None
        ):
            return {"reachable": None, "error": "a malformed answer"}
        return answer
    except Exception as e:  # the helper is gone, too slow, or does not know the check
        if "protocols not supported" in str(e):
            return {"reachable": None, "error": "it does not answer reachability checks (not a swarm-peer, or older)"}
        return {"reachable": None, "error": f"{type(e).__name__}: {str(e)[:120]}"}


async def check_reachability(
    bootstrap: list[str], host_maddrs: list[str], announce_maddrs: list[str] | None, manifest: Manifest | None = None
) -> Verdict:
    """Ask up to 3 of the bootstrap peers to dial a short-lived node with this peer's network settings (with a
    private swarm's `manifest`, the questions carry a proof of membership)."""
    helpers = list(dict.fromkeys(a.rsplit("/p2p/", 1)[1] for a in bootstrap if "/p2p/" in a))[:MAX_HELPERS]
    if not helpers:
        return Verdict(None, "no other peer to ask yet")
    sockets_before = daemon_sockets()
    try:
        node = await P2P.create(
            initial_peers=bootstrap,
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs or None,
            use_relay=False,
            auto_nat=False,
            startup_timeout=10,
        )
    except Exception as e:  # the bootstrap peers do not answer: starting the DHT will say so, clearly
        remove_stale_sockets(daemon_sockets() - sockets_before)  # hivemind leaves a failed daemon's socket file
        return Verdict(None, f"could not reach the peers to ask ({type(e).__name__})")
    try:
        maddrs = [str(a) for a in await node.get_visible_maddrs()]
        proof = manifest.proof(str(node.peer_id)) if manifest is not None else None
        replies = dict(zip(helpers, await asyncio.gather(*[_ask(node, h, maddrs, proof) for h in helpers])))
        for _ in range(BUSY_RETRIES):
            if not (busy := busy_helpers(replies)):
                break
            await asyncio.sleep(random.uniform(*BUSY_PAUSE))
            replies.update(zip(busy, await asyncio.gather(*[_ask(node, h, maddrs, proof) for h in busy])))
        return verdict_of(list(replies.values()))
    except Exception as e:
        return Verdict(None, f"the check failed ({type(e).__name__}: {str(e)[:120]})")
    finally:
        await node.shutdown()
        # hivemind's P2P.__del__ needs a running event loop: collect the node now, not after asyncio.run ends
        del node
        gc.collect()


class ReverseConnector:
    """Keeps a connection open from this (undialable) peer to every peer that may call it."""

    def __init__(self, p2p: P2P, view: AnnouncementCache, own_peer_id: str, period: float):
        self.p2p, self.view, self.own_peer_id, self.period = p2p, view, own_peer_id, period
        self.connected: set[str] = set()  # peers connected after the last round of dials
        self.dialed: set[str] = set()  # those this peer dialed in that round

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.connect_all()
            except Exception as e:
                logger.warning(f"opening connections to the swarm's peers failed: {e!r}")
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.period)
            except TimeoutError:
                pass

    async def connect_all(self) -> None:
        """Dial every peer that announces addresses and is not connected now."""
        wanted: dict[str, tuple[str, ...]] = {}
        for announcements in await self.view.all_stages():
            for ann in announcements:
                if ann.state != PeerState.OFFLINE and ann.maddrs:
                    wanted[ann.peer_id] = ann.maddrs
        for report in await fetch_trainer_reports(self.view.dht, self.view.swarm_id):
            if report.maddrs:
                wanted.setdefault(report.peer_id, report.maddrs)
        wanted.pop(self.own_peer_id, None)
        await self.dial_missing(wanted)

    async def dial_missing(self, wanted: dict[str, tuple[str, ...]]) -> None:
        """Dial the peers of `wanted` (peer id: addresses) that are not connected; at most MAX_DIALS_PER_ROUND."""
        now_connected = {info.peer_id.to_base58() for info in await self.p2p.list_peers()}
        missing = [peer for peer in wanted if peer not in now_connected][:MAX_DIALS_PER_ROUND]  # records are public
        limit = asyncio.Semaphore(CONCURRENT_DIALS)
        results = await asyncio.gather(*[self._dial(peer, wanted[peer], limit) for peer in missing])
        self.dialed = {peer for peer, ok in zip(missing, results) if ok}
        self.connected = (now_connected & set(wanted)) | self.dialed

    async def _dial(self, peer_id: str, maddrs: tuple[str, ...], limit: asyncio.Semaphore) -> bool:
        addrs = direct_addresses(list(maddrs), peer_id)
        if not addrs:
            return False
        async with limit:
            try:
                await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer_id), addrs), DIAL_TIMEOUT)
                logger.info(f"opened a connection to {peer_id} (others cannot dial this peer)")
                return True
            except Exception as e:
                logger.debug(f"could not dial {peer_id}: {e!r}")
                return False
