"""Every check of what a request says, before it reaches a model: BadRequestError, with a message that names what is
wrong, for anything a valid peer would not send.

In order of arrival: the metadata (a msgpack dictionary with this swarm's id, this protocol version and, in a
private swarm, a proof that the sender holds the swarm's secret), its fields (stage, microbatch id, train flag;
a train request's route and budget), each tensor's header and size (swarm/wire/tensors.py), and then, against
the stage the request is for, the tensors' dtypes, shapes and values (finite, token ids in the vocabulary).
"""

from __future__ import annotations

import torch
from hivemind.proto import runtime_pb2

from swarm import PROTOCOL_VERSION
from swarm.errors import BadRequestError
from swarm.manifests.manifest import Manifest
from swarm.wire.boundary import boundary_width
from swarm.wire.messages import Onward, StageRequest, unpack
from swarm.wire.tensors import all_finite, decode_tensor

MAX_MICROBATCH_ID = 64  # characters
MAX_PEER_ID = 128  # characters of a peer id in a route (base58 ids are about 52)


# ------------------------------------------------------------------------------------------- metadata


def decode_metadata(request: runtime_pb2.ExpertRequest, manifest: Manifest, sender: str) -> dict:
    """The metadata dictionary of a request, after checking its swarm id, protocol version and, in a private
    swarm, that `sender` (the peer id libp2p authenticated) proved that it holds the swarm's secret."""
    try:
        metadata = unpack(request.metadata)
    except Exception:
        raise BadRequestError("metadata is not a msgpack dictionary") from None
    if not isinstance(metadata, dict):
        raise BadRequestError("metadata is not a msgpack dictionary")
    if metadata.get("swarm_id") != manifest.swarm_id:
        raise BadRequestError(
            f"wrong swarm id {str(metadata.get('swarm_id'))[:40]!r}: this peer serves swarm {manifest.swarm_id}"
        )
    if metadata.get("protocol_version") != PROTOCOL_VERSION:
        raise BadRequestError(
            f"protocol version {str(metadata.get('protocol_version'))[:20]!r} is not supported: this peer speaks "
            f"{PROTOCOL_VERSION}"
        )
    if manifest.private and not (manifest.secret is not None and manifest.secret.check(sender, metadata.get("proof"))):
        raise BadRequestError(
            "this swarm is private: your request carries no valid proof that you hold its secret (the file the "
            "manifest's network.secret_file names)"
        )
    return metadata


def decode_fields(metadata: dict, manifest: Manifest) -> StageRequest:
    """Stage, microbatch id and train flag of a request's metadata (its tensors not yet read)."""
    stage = metadata.get("stage")
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < manifest.num_stages:
        raise BadRequestError(f"stage must be an integer from 0 to {manifest.num_stages - 1}")
    microbatch_id = metadata.get("microbatch_id")
    if not isinstance(microbatch_id, str) or not 0 < len(microbatch_id) <= MAX_MICROBATCH_ID:
        raise BadRequestError(f"microbatch_id must be a string of 1 to {MAX_MICROBATCH_ID} characters")
    train = metadata.get("train", True)
    if not isinstance(train, bool):
        raise BadRequestError("train must be true or false")
    return StageRequest(stage=stage, microbatch_id=microbatch_id, train=train, tensors=[])


def decode_onward(metadata: dict, manifest: Manifest, stage: int) -> Onward:
    """The route and budget of a train request for `stage`."""
    route = metadata.get("route", [])
    later = manifest.num_stages - 1 - stage
    if not isinstance(route, list) or len(route) > later:
        raise BadRequestError(f"route must be a list of at most {later} peer ids (one per later stage)")
    if not all(isinstance(p, str) and 0 < len(p) <= MAX_PEER_ID for p in route):
        raise BadRequestError(f"route must hold peer ids of 1 to {MAX_PEER_ID} characters")
    budget = metadata.get("budget")
    limit = manifest.training.timeouts.microbatch
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 < budget <= limit:
        raise BadRequestError(f"budget must be a number of seconds in (0, {limit:g}] (training.timeouts.microbatch)")
    return Onward(route=list(route), budget=float(budget))


# -------------------------------------------------------------------------------------------- tensors


def decode_request(
    request: runtime_pb2.ExpertRequest, manifest: Manifest, max_elements: int, sender: str
) -> StageRequest:
    """Validate the metadata and tensor headers of a request (not yet its shapes against the stage)."""
    return decode_tensors(request, decode_fields(decode_metadata(request, manifest, sender), manifest), max_elements)


def decode_tensors(request: runtime_pb2.ExpertRequest, fields: StageRequest, max_elements: int) -> StageRequest:
    """The request's tensors (headers and sizes checked), into `fields` (from decode_fields)."""
    if len(request.tensors) > 3:
        raise BadRequestError(f"{len(request.tensors)} tensors sent, at most 3 are accepted")
    fields.tensors = [decode_tensor(t, max_elements, f"tensor {i}") for i, t in enumerate(request.tensors)]
    return fields


def max_request_elements(manifest: Manifest) -> int:
    """The largest tensor any valid request or reply holds: a microbatch of hidden states."""
    config, training = manifest.model, manifest.training
    return training.microbatch_size * config.context_length * config.width


def max_message_bytes(manifest: Manifest) -> int:
    """The most tensor bytes a valid request carries: hidden states and tokens or a gradient, float32."""
    return (
        2 * max_request_elements(manifest) * 4 + manifest.training.microbatch_size * manifest.model.context_length * 8
    )


# ---------------------------------------------------------------------------------- checks for one stage


def check_inputs(inputs: torch.Tensor, manifest: Manifest, stage: int) -> None:
    """Stage 0 takes token ids [batch, length]; other stages take hidden states [batch, length, width] (their
    subspace coordinates [batch, length, rank] in a subspace swarm: swarm/wire/boundary.py)."""
    config, training = manifest.model, manifest.training
    width = boundary_width(manifest)
    if stage == 0:
        if inputs.dtype != torch.int64 or inputs.dim() != 2:
            raise BadRequestError(f"stage 0 inputs must be int64 token ids [batch, length], got {_describe(inputs)}")
        check_tokens(inputs, config.vocab_size, "inputs")
    else:
        if inputs.dtype != torch.float32 or inputs.dim() != 3 or inputs.shape[2] != width:
            raise BadRequestError(
                f"stage {stage} inputs must be float32 hidden states [batch, length, {width}], got {_describe(inputs)}"
            )
        check_finite(inputs, "inputs")
    batch, length = inputs.shape[:2]
    if not 1 <= batch <= training.microbatch_size:
        raise BadRequestError(f"batch size {batch} is outside 1..{training.microbatch_size} (microbatch_size)")
    if not 1 <= length <= config.context_length:
        raise BadRequestError(f"sequence length {length} is outside 1..{config.context_length} (context_length)")


def check_grad(grad: torch.Tensor, expected_shape: tuple[int, ...]) -> None:
    """A backward's gradient of the stage's outputs: finite float32 of the outputs' shape."""
    if grad.dtype != torch.float32 or tuple(grad.shape) != tuple(expected_shape):
        raise BadRequestError(f"grad_outputs must be float32 of shape {list(expected_shape)}, got {_describe(grad)}")
    check_finite(grad, "grad_outputs")


def check_tokens(tokens: torch.Tensor, vocab_size: int, name: str) -> None:
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise BadRequestError(f"{name} has token ids outside 0..{vocab_size - 1}")


def check_finite(tensor: torch.Tensor, name: str) -> None:
    if not all_finite(tensor):
        raise BadRequestError(f"{name} contains NaN or Inf values (or values so large that they sum to Inf)")


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
