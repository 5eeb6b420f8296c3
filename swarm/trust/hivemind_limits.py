"""Limits that hivemind 1.1.12 lacks, on what it reads from the network; importing `swarm` installs them.

Every message a peer receives goes through hivemind's code before ours sees it, and two of its readers trust
the sender:

- **msgpack nesting.** MSGPackSerializer decodes a tuple (and its other extension types) by calling the
  decoder again from inside the C decoder's extension hook, so a message of a few hundred nested tuples
  (about 1.5 kB) overflows the C stack and kills the process with a segfault. Any peer could send one: as the
  metadata of a stage call, the gathered data of an averaging round, or a DHT store, which every DHT node
  decodes. Past MAX_NESTING levels of extension types, decoding now raises MalformedDataError (a ValueError),
  which every caller already treats as a malformed message.
- **stream frame size.** A stream message starts with its length, and hivemind reads that many bytes before
  anyone looks at them: a frame that declares 2**40 bytes makes the peer buffer whatever follows, up to the
  call's timeout. Frames longer than MAX_STREAM_FRAME_BYTES (16 times the largest that Swarm or hivemind
  send) now end the stream with an error instead.

Both are installed by replacing one function of hivemind's each, in this process; the DHT's and the
averager's processes are forked from it, so they have them too.
"""

from __future__ import annotations

import asyncio
import threading

from hivemind.p2p import P2P
from hivemind.utils.serializer import MSGPackSerializer

from swarm.errors import MalformedDataError

MAX_NESTING = 16  # extension types within each other; hivemind's own messages nest 2 or 3 deep
MAX_STREAM_FRAME_BYTES = 16 * 2**20  # Swarm's stream parts carry 1 MiB chunks; hivemind's averaging 0.5 MiB

_depth = threading.local()


def install() -> None:
    """Install both limits (idempotent)."""
    _limit_msgpack_nesting()
    _limit_stream_frames()


def _limit_msgpack_nesting() -> None:
    original = MSGPackSerializer.__dict__["_decode_ext_types"].__func__
    if getattr(original, "swarm_limit", False):
        return

    def decode_ext_types(cls, type_code: int, data: bytes):
        depth = getattr(_depth, "value", 0)
        if depth >= MAX_NESTING:
            raise MalformedDataError(f"msgpack extension types nested deeper than {MAX_NESTING}")
        _depth.value = depth + 1
        try:
            return original(cls, type_code, data)
        finally:
            _depth.value = depth

    decode_ext_types.swarm_limit = True
    MSGPackSerializer._decode_ext_types = classmethod(decode_ext_types)


def _limit_stream_frames() -> None:
    if getattr(P2P.receive_raw_data, "swarm_limit", False):
        return

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > MAX_STREAM_FRAME_BYTES:
            raise MalformedDataError(f"a stream frame of {length} bytes; at most {MAX_STREAM_FRAME_BYTES} are accepted")
        return await reader.readexactly(length)

    receive_raw_data.swarm_limit = True
    P2P.receive_raw_data = staticmethod(receive_raw_data)


install()
