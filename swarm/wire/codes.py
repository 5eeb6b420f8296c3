"""Error codes: the one enumeration of why a stage peer answered a request with an error, and the one map between
the project's exceptions and those codes.

An error reply (swarm/wire/messages.py) carries a message and one of these codes; the caller acts on the code,
never on the message. On the serving side, `code_of` turns the exception that stopped a request into its code
(swarm/server/request_path.py writes every error reply through it); on the calling side, `decode_reply` raises
RemoteStageError with the reply's code (`ErrorCode.of_reply`: one it does not know counts as INTERNAL).
BANNED has no exception, nor BUSY mostly: admission answers them at once, before any work
(swarm/server/admission.py); a stage that stops while a request waits for its worker answers BUSY too.
Which codes blame the peer that sent them is a rule of the hop (swarm/wire/hops.py, BLAMELESS).

The codes' strings are part of the protocol: a new code, or a changed string, is a new PROTOCOL_VERSION.
"""

from __future__ import annotations

from enum import StrEnum

from swarm.errors import (
    BadRequestError,
    DownstreamFailedError,
    DuplicateMicrobatchError,
    GradientOverflowError,
    StageStoppedError,
    TooLateError,
    UnknownMicrobatchError,
    WrongStageError,
)


class ErrorCode(StrEnum):
    """The `code` of an error reply (a str: it compares equal to its string)."""

    BAD_REQUEST = "bad_request"  # the request failed validation (counted against its sender: bans)
    BUSY = "busy"  # not taken: the peer is not online, or has too much in flight
    BANNED = "banned"  # not read: the sender sent too many bad requests lately
    UNKNOWN_MICROBATCH = "unknown_microbatch"  # a backward whose forward is not cached here, without its inputs
    WRONG_STAGE = "wrong_stage"  # for a stage this peer does not serve (any more)
    INTERNAL = "internal"  # a bug or a device error at the peer, or a reply the caller cannot read
    DOWNSTREAM_FAILED = "downstream_failed"  # a later stage of a forwarded microbatch failed (not this peer's fault)
    DUPLICATE = "duplicate"  # this peer has this microbatch already (a gradient is never applied twice)
    TOO_LATE = "too_late"  # the hop's deadline passed before its gradient could be applied (nothing was applied)
    OVERFLOW = "overflow"  # a float16 stage's gradients overflowed its loss scale (nothing was applied; it drops)

    @classmethod
    def of_reply(cls, value: object) -> ErrorCode:
        """The code an error reply names; INTERNAL for anything else (a newer peer's code, or garbage)."""
        return cls(value) if isinstance(value, str) and value in cls._value2member_map_ else cls.INTERNAL


# The one map from exceptions to codes: an exception is answered with the code of the first of its classes found
# here (most derived first); anything else is a bug or a device error, answered INTERNAL.
EXCEPTION_CODES: dict[type[Exception], ErrorCode] = {
    BadRequestError: ErrorCode.BAD_REQUEST,
    WrongStageError: ErrorCode.WRONG_STAGE,
    UnknownMicrobatchError: ErrorCode.UNKNOWN_MICROBATCH,
    DuplicateMicrobatchError: ErrorCode.DUPLICATE,
    TooLateError: ErrorCode.TOO_LATE,
    GradientOverflowError: ErrorCode.OVERFLOW,
    DownstreamFailedError: ErrorCode.DOWNSTREAM_FAILED,
    StageStoppedError: ErrorCode.BUSY,  # as a peer that is not online answers: try another, no blame
}


def code_of(error: BaseException) -> ErrorCode:
    """The code of the error reply to a request that `error` stopped."""
    for cls in type(error).__mro__:
        if cls in EXCEPTION_CODES:
            return EXCEPTION_CODES[cls]
    return ErrorCode.INTERNAL
