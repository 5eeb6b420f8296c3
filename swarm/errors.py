"""One exception hierarchy for the whole project: what a user or another peer can cause.

Every message says what went wrong and, where it can, what to do about it. A program catches `SwarmError` and
prints its message as one line; anything else escaping the library is a bug. Control flow between the library's
parts uses return values or these classes, never bare `Exception` subclasses, and bad input is never a plain
`ValueError`. The hierarchy (class -> base: what it means), every class defined here, kept in step with the
classes by tests/test_errors.py:

    SwarmError -> Exception: the base; raised itself only for an error that fits none of the others
    ManifestError -> SwarmError: a manifest (or its secret file) is missing, unreadable or invalid
    DataError -> SwarmError: training data cannot be found, read or used
    ChunkError -> DataError: one place (a URL, a folder, a peer) could not give a data chunk, or gave wrong bytes
    TokenizerError -> SwarmError: a tokenizer cannot be loaded, trained, fetched or used
    PeerStartError -> SwarmError: a peer (or a reader) cannot start: its flags, identity, DHT or ports
    BadRequestError -> SwarmError: a stage request from the network failed validation; it was not applied
    RemoteStageError -> SwarmError: a stage peer answered a call with an error reply (its code attached)
    RequestRefusedError -> SwarmError: a stage peer cannot serve a request it was sent; its reply carries the code
    WrongStageError -> RequestRefusedError: the request is for a stage the peer does not serve (any more)
    UnknownMicrobatchError -> RequestRefusedError: a backward for a forward the peer does not hold, sent without inputs
    DuplicateMicrobatchError -> RequestRefusedError: a forwarded microbatch the peer has in progress or applied already
    TooLateError -> RequestRefusedError: a hop's deadline passed before its gradient was applied (nothing was)
    GradientOverflowError -> RequestRefusedError: a float16 stage's gradients overflowed its loss scale
    DownstreamFailedError -> RequestRefusedError: a later stage of a forwarded microbatch failed (not this peer's fault)
    StageStoppedError -> RequestRefusedError: the stage stopped at the peer (a move, a leave) while the request waited
    MicrobatchFailedError -> SwarmError: a microbatch did not complete within its deadline, after retries
    PeerVanishedError -> SwarmError: a peer a call waited for stopped answering pings (its link is down, or it stopped)
    AveragingError -> SwarmError: an averaging round did not happen, or its result was unusable
    IncompleteRoundError -> AveragingError: part of a round's result never arrived
    CheckpointError -> SwarmError: a checkpoint file is unreadable, corrupt, or of another swarm or stage
    ExportError -> SwarmError: the model cannot be exported (downloads, the output file or folder)
    HistoryError -> SwarmError: swarm-monitor's history file cannot be used
    BalancingError -> SwarmError: balancing was given impossible figures (a throughput, a stage count)
    CapacityError -> SwarmError: a peer's memory cannot hold a stage, or a memory size or machine list is unreadable
    TooSlowToServeError -> CapacityError: a CPU peer would compute a block far slower than the serving peers
    EmulatedLinkError -> SwarmError: an emulated link's spec or name is invalid (tests and benchmarks)
    MalformedDataError -> SwarmError, ValueError: data another peer sent cannot be decoded
"""


class SwarmError(Exception):
    """Base class of every error Swarm raises on purpose."""


class ManifestError(SwarmError):
    """The manifest is missing, unreadable or invalid (the message names the field), or so is the secret file
    it names, or a stage it does not have was asked for."""


class DataError(SwarmError):
    """The training data cannot be found, read or used (its index, its shards, its tokenizer's pin)."""


class ChunkError(DataError):
    """One place (a URL, a folder, a peer) could not give a chunk of the training data, or gave bytes that fail
    its hash: the fetcher tries the next place."""


class TokenizerError(SwarmError):
    """The tokenizer cannot be loaded, trained, fetched or used. The message names the file."""


class PeerStartError(SwarmError):
    """A peer, or a program that reads a swarm, could not start (bad flags, identity in use, DHT bootstrap
    failed, a port taken, ...)."""


class BadRequestError(SwarmError):
    """A stage request (from the network) failed validation; it was not applied."""


class RemoteStageError(SwarmError):
    """A stage peer answered a request with an error reply."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code


class RequestRefusedError(SwarmError):
    """A stage peer cannot serve a request it was sent, through no fault of the request's form: it answers with an
    error reply whose code (swarm/wire/codes.py) tells the caller what to do; nothing was applied."""


class WrongStageError(RequestRefusedError):
    """A request for another stage than the one this peer serves (it has moved, or the caller's view is old):
    send it to a peer of that stage."""


class UnknownMicrobatchError(RequestRefusedError):
    """Backward for a microbatch whose forward is not cached here, sent without the inputs to recompute it: send
    it again with its inputs."""


class DuplicateMicrobatchError(RequestRefusedError):
    """A train request for a microbatch this peer has in progress or applied already (a gradient is never applied
    twice)."""


class TooLateError(RequestRefusedError):
    """The hop's deadline passed before its gradient was applied: nothing was applied (the caller has moved on)."""


class GradientOverflowError(RequestRefusedError):
    """A float16 backward pass overflowed: nothing was applied, and the stage's loss scale was halved (send the
    microbatch again)."""


class DownstreamFailedError(RequestRefusedError):
    """A later stage of a forwarded microbatch failed or had no time left: not this peer's fault; nothing was
    applied here."""


class StageStoppedError(RequestRefusedError):
    """The stage stopped here (the peer leaves it, moves or shuts down) while the request waited for its worker:
    nothing was applied; another peer of the stage takes it (answered `busy`: the caller does not ban for it)."""


class MicrobatchFailedError(SwarmError):
    """A microbatch could not be completed within its deadline, after retries."""


class PeerVanishedError(SwarmError):
    """A peer that a call waited for stopped answering pings: its link is down or it stopped (the call was given up)."""


class AveragingError(SwarmError):
    """A round did not happen (no group formed, a peer left, a timeout) or its result was unusable."""


class IncompleteRoundError(AveragingError):
    """Part of a round's result never arrived (a peer of the group was too slow or left): it is not applied."""


class CheckpointError(SwarmError):
    """A checkpoint file that cannot be used: unreadable, corrupt, or of another swarm or stage."""


class ExportError(SwarmError):
    """The swarm's model could not be exported: no online peer for a stage, failed downloads, or an output file
    or Hugging Face folder that cannot be written."""


class HistoryError(SwarmError):
    """swarm-monitor's history file cannot be used (corrupt, not a monitor's, another swarm's, not writable), or
    it was asked for a window it does not have."""


class BalancingError(SwarmError):
    """Balancing was given figures no swarm can have: a throughput that is negative or not finite, fewer than
    one stage."""


class CapacityError(SwarmError):
    """A peer cannot hold what it was asked to serve (the message has the numbers and what to do), or a memory
    size or a machine description (--max-memory, --expect) cannot be read."""


class TooSlowToServeError(CapacityError):
    """A CPU peer computes a block too slowly beside the swarm's serving peers to be of use as one of them (the
    message has the numbers); it trains instead (swarm/capacity/role.py)."""


class EmulatedLinkError(SwarmError):
    """An emulated link (swarm/local/emulated_links.py) was given a spec it cannot parse, or a name or port
    that is taken or invalid."""


class MalformedDataError(SwarmError, ValueError):
    """Data another peer sent cannot be decoded: a message nested too deep, a stream frame too long, an averaging
    part that is not one of Swarm's, a record's field out of range. It is also a ValueError because hivemind's
    readers (and the DHT records' parser) treat a ValueError as any malformed input: the data is refused, the
    reader carries on."""
