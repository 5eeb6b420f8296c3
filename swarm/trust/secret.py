"""Private swarms: a shared secret that every member holds and outsiders do not.

The manifest names a file (`network.secret_file`) that holds the secret; the secret itself never goes into the
manifest, so the manifest can still be published. Members prove that they hold it in three places:

- the DHT: every DHT request and reply carries an HMAC of its content (SecretAuthorizer, hivemind's
  authorizer hook), so a member's DHT node answers no outsider and believes no outsider's answer: outsiders
  can neither read announcements nor write them;
- stage calls: every request carries `proof`, an HMAC of the sender's peer id (libp2p authenticates that id,
  and the connection is encrypted, so a proof is useless to any other peer);
- averaging: rounds meet under a DHT prefix derived from the secret, and a member accepts a peer into its
  group only with a proof for that peer's id.

Keys are derived from the secret with HMAC-SHA256 under distinct labels, so no two uses share a key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from swarm.errors import ManifestError
from swarm.files import atomic_write

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
MAX_CLOCK_SKEW = 300.0  # seconds a DHT request's timestamp may differ from this peer's clock (volunteers' clocks)


class SwarmSecret:
    """The secret of a private swarm and the keys derived from it."""

    def __init__(self, secret: bytes):
        if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
            raise ManifestError(
                f"a swarm secret must hold {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, not {len(secret)}; "
                "swarm-init --private writes a good one"
            )
        self._proof_key = _derive(secret, b"stage-call proof")
        self._dht_key = _derive(secret, b"dht authorization")
        self.tag = _derive(secret, b"averaging prefix").hex()[:16]  # public where it is used, but unguessable

    def proof(self, peer_id: str) -> str:
        """What a peer with this id sends to prove that it holds the secret."""
        return hmac.new(self._proof_key, f"peer:{peer_id}".encode(), hashlib.sha256).hexdigest()[:32]

    def check(self, peer_id: str, proof: object) -> bool:
        return isinstance(proof, str) and hmac.compare_digest(self.proof(peer_id), proof)

    def authorizer(self) -> SecretAuthorizer:
        return SecretAuthorizer(self._dht_key)

    def __repr__(self) -> str:  # never print the keys
        return f"SwarmSecret(tag={self.tag})"


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, b"swarm/v1 " + label, hashlib.sha256).digest()


def write_secret(path: Path) -> None:
    """Write a fresh secret (64 hex digits) into `path`, readable by this user only; ManifestError on failure."""
    try:
        atomic_write(path, secrets.token_hex(32) + "\n", mode=0o600)  # never readable by others, even for a moment
    except OSError as e:
        raise ManifestError(f"cannot write the secret file {path}: {e.strerror or e}") from None


def read_secret(path: Path) -> SwarmSecret:
    """The secret in `path` (surrounding whitespace ignored); ManifestError if it is missing or too short."""
    try:
        data = path.read_bytes()[: MAX_SECRET_BYTES + 1].strip()
    except OSError as e:
        raise ManifestError(
            f"this swarm is private: its manifest names the secret file {path}, which cannot be read "
            f"({e.strerror or e}); get the file from the swarm's creator and put it there"
        ) from None
    if not MIN_SECRET_BYTES <= len(data) <= MAX_SECRET_BYTES:
        raise ManifestError(
            f"the secret file {path} holds {len(data)} bytes; a swarm secret has {MIN_SECRET_BYTES} to "
            f"{MAX_SECRET_BYTES} (swarm-init --private writes a good one)"
        )
    return SwarmSecret(data)


class SecretAuthorizer(AuthorizerBase):
    """hivemind's DHT authorizer for a private swarm: requests and replies carry an HMAC of their content.

    A request is accepted only with a valid HMAC, a timestamp within MAX_CLOCK_SKEW and a nonce not seen
    before (no replays); a reply only with a valid HMAC bound to the request's nonce."""

    def __init__(self, key: bytes):
        self._key = key
        self._recent_nonces = TimedStorage()

    def _mac(self, message) -> bytes:
        return hmac.new(self._key, message.SerializeToString(deterministic=True), hashlib.sha256).digest()

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key=None) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = self._mac(request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        valid = hmac.compare_digest(self._mac(request), signature)
        auth.signature = signature
        now = get_dht_time()
        if not valid or abs(auth.time - now) > MAX_CLOCK_SKEW or len(auth.nonce) != 16:
            return False
        if auth.nonce in self._recent_nonces:
            return False
        self._recent_nonces.store(auth.nonce, None, now + 2 * MAX_CLOCK_SKEW)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._mac(response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        if response is None:  # the other node refused the request, or failed
            return False
        auth = response.auth
        signature, auth.signature = auth.signature, b""
        valid = hmac.compare_digest(self._mac(response), signature)
        auth.signature = signature
        return valid and auth.nonce == request.auth.nonce
