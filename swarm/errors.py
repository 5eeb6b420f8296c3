"""One exception hierarchy for the whole project.

Every message says what went wrong and, where it can, what to do about it.
"""


class SwarmError(Exception):
    """Base class of every error Swarm raises on purpose."""


class ManifestError(SwarmError):
    """The manifest is missing, unreadable or invalid. The message names the field."""


class DataError(SwarmError):
    """The training data cannot be found or read."""


class TokenizerError(SwarmError):
    """The tokenizer cannot be loaded, trained or used. The message names the file."""


class BadRequestError(SwarmError):
    """A stage request (from the network) failed validation; it was not applied."""


class RemoteStageError(SwarmError):
    """A stage peer answered a request with an error reply."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code


class MicrobatchFailedError(SwarmError):
    """A microbatch could not be completed within its deadline, after retries."""


class PeerStartError(SwarmError):
    """A peer could not start (DHT bootstrap failed, bad flags, ...)."""
