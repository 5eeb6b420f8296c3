"""Signed DHT records: only the peer that owns a libp2p identity can write the records stored under its peer id.

A swarm's records (stage announcements, trainer reports) are dictionaries whose subkeys are peer ids. Without
signatures anyone could store a record under any peer id, or overwrite a live peer's record with one that says it
left. Here every such record carries the owner's RSA public key and a signature by it over the DHT key, the subkey,
the value and the expiration time, and a DHT node accepts or returns it only if

- the public key hashes to the peer id in the subkey: the key that libp2p itself authenticates on every
  connection (a libp2p RSA peer id is the sha256 multihash of the public key's protobuf encoding), so the binding
  to the peer's identity is the one libp2p already proves, not a second key of its own as in hivemind's
  RSASignatureValidator;
- the signature verifies: a record cannot be altered, nor given a later expiration time (a replayed record
  keeps its old expiration, and the DHT never replaces a record with one that expires earlier).

The validator runs inside every node's DHT process (hivemind calls it on each store it is asked to do and on each
reply to its own reads), so honest nodes neither keep nor hand on forged records, and readers ignore the ones a
hostile node returns. It counts what it refuses (`rejected_records`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer

from swarm.errors import PeerStartError
from swarm.files import atomic_write

logger = logging.getLogger(__name__)

OWNER_KEY_FIELD = "owner_key"  # the record's fields that carry its signature
SIGNATURE_FIELD = "signature"
SIGNED_LABEL = b"swarm record v1"  # signed first, so that a signature over a record means nothing elsewhere
MAX_PUBLIC_KEY_BYTES = 1024  # DER of an RSA key up to 4096 bits; larger trailers are refused unread
MAX_SIGNATURE_BYTES = 512
CACHED_PUBLIC_KEYS = 4096
IDENTITY_FILE_MODE = 0o400  # an identity key: readable by its user only


# ------------------------------------------------------------------------------------------------ keys


@dataclass(frozen=True)
class IdentityKey:
    """A peer's libp2p private key (RSA), as swarm-peer's --identity file holds it."""

    der: bytes  # the private key, DER (TraditionalOpenSSL), as libp2p's protobuf carries it

    @classmethod
    def generate(cls) -> IdentityKey:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        return cls(
            key.private_bytes(
                serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
            )
        )

    @classmethod
    def from_file(cls, path: Path) -> IdentityKey:
        """The key in an identity file (a libp2p PrivateKey protobuf); PeerStartError if it is not one."""
        try:
            message = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        except OSError as e:
            raise PeerStartError(f"--identity {path}: cannot read it ({e.strerror})") from None
        except Exception:
            message = None
        if message is None or message.key_type != crypto_pb2.KeyType.RSA:
            raise PeerStartError(
                f"--identity {path} is not an RSA identity file (a libp2p private key, as swarm-peer writes one); "
                "point --identity at a new path to create one"
            )
        return cls(message.data)

    def write(self, path: Path) -> None:
        """Write the key as an identity file that p2pd reads, atomically and readable by this user only (0o400, as
        hivemind writes one; never readable by others, not even for a moment)."""
        message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=self.der)
        atomic_write(path, message.SerializeToString(), mode=IDENTITY_FILE_MODE)

    def private_key(self) -> rsa.RSAPrivateKey:
        key = serialization.load_der_private_key(self.der, password=None)
        assert isinstance(key, rsa.RSAPrivateKey)
        return key

    def public_der(self) -> bytes:
        return (
            self.private_key()
            .public_key()
            .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        )

    @property
    def peer_id(self) -> str:
        return PeerID(peer_id_bytes(self.public_der())).to_base58()


def peer_id_bytes(public_der: bytes) -> bytes:
    """The libp2p peer id of an RSA public key (SubjectPublicKeyInfo DER): the sha256 multihash of its protobuf."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.RSA, data=public_der).SerializeToString()
    return multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))


# ------------------------------------------------------------------------------------------------ records


def signed_payload(key: bytes, subkey: bytes, body: dict[str, Any], expiration_time: float) -> bytes:
    """What a signature covers: the DHT key, the subkey, the record without its signature fields, the expiration."""
    return SIGNED_LABEL + MSGPackSerializer.dumps((key, subkey, MSGPackSerializer.dumps(body), expiration_time))


def record_key_bytes(key: str) -> bytes:
    """A DHT key as validators see it (hivemind hashes keys into DHT ids)."""
    return DHTID.generate(source=key).to_bytes()


class SignedRecordValidator(RecordValidatorBase):
    """Signs this peer's records under the protected keys, and refuses unsigned or wrongly signed ones there.

    A signed record is the record's dictionary with two more fields, OWNER_KEY_FIELD (the public key) and
    SIGNATURE_FIELD; readers that do not check them still read the record. Records under other keys (hivemind's
    averaging, other swarms) pass untouched."""

    def __init__(self, protected_keys: Iterable[str], identity: IdentityKey | None):
        self.protected = {record_key_bytes(key) for key in protected_keys}
        self.identity = identity
        self.rejected = 0
        self._own_subkey = MSGPackSerializer.dumps(identity.peer_id) if identity is not None else None
        self._private: rsa.RSAPrivateKey | None = None
        self._public_der = identity.public_der() if identity is not None else b""
        self._public_keys: dict[bytes, rsa.RSAPublicKey | None] = {}

    def __getstate__(self) -> dict[str, Any]:  # crosses into the DHT process: key objects do not pickle
        return {**self.__dict__, "_private": None, "_public_keys": {}}

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self.protected:
            return True
        if self._verified(record):
            return True
        self.rejected += 1
        logger.debug("refused a record whose signature does not match its peer id")
        return False

    def _verified(self, record: DHTRecord) -> bool:
        try:
            body = MSGPackSerializer.loads(record.value)
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:
            return False
        if not isinstance(body, dict) or not isinstance(subkey, str):
            return False
        public_der, signature = body.pop(OWNER_KEY_FIELD, None), body.pop(SIGNATURE_FIELD, None)
        if not isinstance(public_der, bytes) or not isinstance(signature, bytes):
            return False
        if len(public_der) > MAX_PUBLIC_KEY_BYTES or len(signature) > MAX_SIGNATURE_BYTES:
            return False
        try:
            if PeerID.from_base58(subkey).to_bytes() != peer_id_bytes(public_der):
                return False
        except Exception:  # the subkey is not a peer id
            return False
        public_key = self._public_key(public_der)
        if public_key is None:
            return False
        try:
            payload = signed_payload(record.key, record.subkey, body, record.expiration_time)
            public_key.verify(signature, payload, padding.PKCS1v15(), hashes.SHA256())
        except (InvalidSignature, ValueError, TypeError):
            return False
        return True

    def _public_key(self, der: bytes) -> rsa.RSAPublicKey | None:
        if der not in self._public_keys:
            try:
                key = serialization.load_der_public_key(der)
            except Exception:
                key = None
            if len(self._public_keys) >= CACHED_PUBLIC_KEYS:
                self._public_keys.clear()
            self._public_keys[der] = key if isinstance(key, rsa.RSAPublicKey) else None
        return self._public_keys[der]

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self.protected or record.subkey != self._own_subkey or self.identity is None:
            return record.value
        body = MSGPackSerializer.loads(record.value)
        if not isinstance(body, dict):
            return record.value
        if self._private is None:
            self._private = self.identity.private_key()
        payload = signed_payload(record.key, record.subkey, body, record.expiration_time)
        signature = self._private.sign(payload, padding.PKCS1v15(), hashes.SHA256())
        return MSGPackSerializer.dumps({**body, OWNER_KEY_FIELD: self._public_der, SIGNATURE_FIELD: signature})

    @property
    def priority(self) -> int:
        return 10  # the outermost layer: checked before any validator that reads the value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """One per node: a second one (another swarm on the same DHT node) adds its keys to this one."""
        if not isinstance(other, SignedRecordValidator) or other.identity != self.identity:
            return False
        self.protected |= other.protected
        return True


def protect_records(dht: DHT, keys: Iterable[str], identity: IdentityKey | None) -> None:
    """From now on, `dht`'s node signs its own records under `keys` with `identity` (None: a reader that writes
    none) and refuses records there that are not signed by their subkey's peer."""
    dht.add_validators([SignedRecordValidator(keys, identity)])


async def _count_rejected(_dht: DHT, node: Any) -> int:
    validators = getattr(node.protocol.record_validator, "_validators", [])
    return sum(v.rejected for v in validators if isinstance(v, SignedRecordValidator))


def rejected_records(dht: DHT) -> int:
    """How many records this node's DHT refused for a bad or missing signature since it started."""
    return int(dht.run_coroutine(_count_rejected))


async def rejected_records_soon(dht: DHT) -> int:
    """rejected_records, awaited (an event loop must not block on the DHT's process)."""
    return int(await dht.run_coroutine(_count_rejected, return_future=True))
