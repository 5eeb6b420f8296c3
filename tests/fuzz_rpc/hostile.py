"""Hostile inputs, by kind: metadata that is not msgpack or lies in one field, tensors whose headers lie,
wrong tensors for each stage, backward requests that must not be applied, random requests, and request streams
broken in every way a client could break them."""

from __future__ import annotations

import math
import random
from typing import Any

import msgpack
import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from fuzzing import FIRST, LAST, MANIFEST, RAW_MANIFEST
from swarm import PROTOCOL_VERSION
from swarm.manifests.validation import manifest_from_dict
from swarm.wire import validation
from swarm.wire.tensors import encode_tensor

from .messages import (
    BATCH,
    COMPRESSION_VALUES,
    DELETE,
    DTYPES,
    FLOAT16,
    LENGTH,
    NONE,
    UNIFORM_8BIT,
    VOCAB,
    WIDTH,
    chunk_part,
    frame,
    hidden,
    make_request,
    metadata,
    packb,
    parts,
    raw_tensor,
    tokens,
    valid_forward,
)


def nested_tuples(depth: int) -> bytes:
    """A msgpack tuple (hivemind's extension type 0x40) nested `depth` deep: each level is a few bytes."""
    payload = packb([])
    for _ in range(depth):
        payload = packb([msgpack.ExtType(0x40, payload)])
    return packb({"swarm_id": msgpack.ExtType(0x40, payload)})


def metadata_garbage() -> list[tuple[str, bytes]]:
    """Metadata that is not msgpack, not a dictionary, or msgpack meant to hurt a decoder."""
    return [
        ("empty", b""),
        ("a byte msgpack never uses", b"\xc1"),
        ("a truncated map", b"\x85\xa8swarm_id"),
        ("two objects", packb(metadata()) + b"\x01"),
        ("a list", packb([1, 2, 3])),
        ("an integer", packb(7)),
        ("the swarm id alone", packb(MANIFEST.swarm_id)),
        ("nil", packb(None)),
        ("bytes", packb(b"\x00" * 16)),
        ("NaN", packb(float("nan"))),
        ("arrays nested 100000 deep", b"\x91" * 100_000 + b"\xc0"),
        ("maps nested 100000 deep", b"\x81\xc0" * 100_000 + b"\xc0"),
        ("an unknown extension type", packb({"swarm_id": msgpack.ExtType(5, b"xyz")})),
        (
            "a DHT dictionary extension",
            packb({"stage": msgpack.ExtType(80, packb([2**62, 0.0, [[b"k", b"v", 1e300]]]))}),
        ),
        ("a garbage DHT dictionary extension", packb({"stage": msgpack.ExtType(80, b"\xc1")})),
        ("a tensor descriptor extension", packb({"stage": msgpack.ExtType(81, packb({"dtype": "evil"}))})),
        ("an array declaring 4 billion items", b"\xdd\xff\xff\xff\xff"),
        ("a string declaring 4 GB", b"\xdb\xff\xff\xff\xffx"),
        ("a map declaring 4 billion pairs", b"\xdf\xff\xff\xff\xff"),
        ("an extension declaring 4 GB", b"\xc9\xff\xff\xff\xff\x05"),
        ("a map with a list key", b"\x81\x91\x01\x01"),
        ("a string that is not UTF-8", b"\x81\xa8swarm_id\xa3\xff\xfe\xfd"),
    ]


def metadata_fields(stage: int, rng: random.Random) -> list[tuple[str, dict, bool | None]]:
    """(label, metadata, valid) with one field of a wrong type or value, or odd but valid (valid is None: an
    optional field the peer may check or ignore). Never a missing `train`: its default is True."""
    other = manifest_from_dict({**RAW_MANIFEST, "name": "another-swarm"}).swarm_id
    values: dict[str, list[Any]] = {
        "swarm_id": [DELETE, None, 0, b"bytes", other, MANIFEST.swarm_id.upper(), MANIFEST.swarm_id + " ", "é" * 16]
        + ["x" * 100_000, [MANIFEST.swarm_id], {"id": MANIFEST.swarm_id}],
        "protocol_version": [DELETE, None, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 0, -1, 2**64 - 1, -(2**63)]
        + [str(PROTOCOL_VERSION), float("nan"), [PROTOCOL_VERSION], True],
        "stage": [DELETE, None, -1, 2, 2**63 - 1, -(2**63), 2**64 - 1, True, False, str(stage), float(stage)]
        + [float("inf"), [stage], {"stage": stage}],
        "microbatch_id": [DELETE, None, "", "x" * 65, "x" * 100_000, 5, b"bytes", ["a"], "\x00" * 10, "\u202e" * 64]
        + ["🙂" * 65],
        "train": [None, 0, 1, "false", "", [], {}, float("nan")],
        "proof": [None, b"\x00" * 64, rng.randbytes(1000), "x" * 1000, {"nested": [1, 2, {"deep": None}]}],
    }
    odd_but_valid = ["\x00" * 10, "\u202e" * 64]
    cases = []
    for key, options in values.items():
        for value in options:
            label = "deleted" if value is DELETE else repr(value)[:40]
            meta = metadata(stage=stage)
            if value is DELETE:
                del meta[key]
            else:
                meta[key] = value
            valid = None if key == "proof" else key == "microbatch_id" and value in odd_but_valid
            cases.append((f"{key} {label}", meta, valid))
    return cases


def uniform_8bit(codes: torch.Tensor, numel: int) -> bytes:
    """The buffer of hivemind's 8-bit format: codebook length, 256 float32 codes, one byte per element."""
    return (256).to_bytes(8, "little") + codes.numpy().tobytes() + bytes(numel)


def with_value(tensor: torch.Tensor, value: float, everywhere: bool = False) -> torch.Tensor:
    tensor = tensor.clone()
    if everywhere:
        tensor.fill_(value)
    else:
        tensor.view(-1)[len(tensor.view(-1)) // 2] = value
    return tensor


def alternating(value: float, shape: tuple[int, ...]) -> torch.Tensor:
    """±value, alternately: every value finite and huge, their sum 0 (it passes the cheap finiteness check)."""
    signs = torch.ones(math.prod(shape))
    signs[1::2] = -1
    return (signs * value).reshape(shape)


def header_cases() -> list[tuple[str, runtime_pb2.Tensor]]:
    """Serialized tensors with headers that lie: dtypes, compressions, sizes, buffers (in place of stage 1's
    inputs; the size of a valid one is [BATCH, LENGTH, WIDTH])."""
    numel = BATCH * LENGTH * WIDTH
    shape = [BATCH, LENGTH, WIDTH]
    cases = []
    combinations = [(dtype, NONE) for dtype in DTYPES] + [("float32", value) for value in COMPRESSION_VALUES[1:]]
    combinations += [("int64", FLOAT16), ("int64", UNIFORM_8BIT), ("float16", FLOAT16), ("", UNIFORM_8BIT)]
    for dtype, compression in combinations:
        tensor = raw_tensor(dtype, shape, bytes(4 * numel), compression)
        cases.append((f"dtype {dtype!r} compression {compression}", tensor))
    sizes: list[tuple[str, list[int], bytes]] = [
        ("size [10**9] with 4 bytes", [10**9], bytes(4)),
        ("size [2**32-1, 2**32-1]", [2**32 - 1, 2**32 - 1], bytes(4)),
        ("size [2**32-1] with no bytes", [2**32 - 1], b""),
        ("size [0, 2**32-1, 2**32-1]", [0, 2**32 - 1, 2**32 - 1], b""),
        ("size [0, 10**9]", [0, 10**9], b""),
        ("5 dimensions", [1, 1, 1, 1, 1], bytes(4)),
        ("64 dimensions", [1] * 64, bytes(4)),
        ("a scalar", [], bytes(4)),
        ("no buffer", shape, b""),
        ("one byte too many", shape, bytes(4 * numel + 1)),
        ("one byte too few", shape, bytes(4 * numel - 1)),
        ("more elements than any request", [validation.max_request_elements(MANIFEST) + 1], bytes(4)),
    ]
    cases += [(label, raw_tensor("float32", size, buffer)) for label, size, buffer in sizes]
    half = torch.full((numel,), 1.0).half()
    cases += [
        ("a float16 NaN", raw_tensor("float32", shape, with_value(half, float("nan")).numpy().tobytes(), FLOAT16)),
        (
            "float16 infinities",
            raw_tensor("float32", shape, with_value(half, float("inf"), True).numpy().tobytes(), FLOAT16),
        ),
        ("an 8-bit tensor without its codebook", raw_tensor("float32", shape, bytes(numel), UNIFORM_8BIT)),
        (
            "an 8-bit codebook of 255 values",
            raw_tensor("float32", shape, (255).to_bytes(8, "little") + bytes(1024 + numel), UNIFORM_8BIT),
        ),
        (
            "an 8-bit codebook of NaNs",
            raw_tensor("float32", shape, uniform_8bit(torch.full((256,), float("nan")), numel), UNIFORM_8BIT),
        ),
        (
            "an 8-bit codebook of 3e38",
            raw_tensor("float32", shape, uniform_8bit(torch.full((256,), 3e38), numel), UNIFORM_8BIT),
        ),
        ("requires_grad set", raw_tensor("float32", shape, hidden().numpy().tobytes(), requires_grad=True)),
    ]
    # 4-bit tensors (swarm/wire/four_bit.py): a bfloat16 scale per row, then two codes a byte
    rows, codes = BATCH * LENGTH, bytes(numel // 2)
    cases += [
        ("4-bit scales of NaN", raw_tensor("nf4", shape, b"\xc0\x7f" * rows + codes)),
        ("4-bit scales of +Inf", raw_tensor("nf4", shape, b"\x80\x7f" * rows + codes)),
        (
            "4-bit scales of 3e38 (every value finite, their sum overflows)",
            raw_tensor("nf4", shape, b"\x62\x7f" * rows + b"\xff" * (numel // 2)),
        ),
        ("a 4-bit tensor one byte short", raw_tensor("nf4", shape, bytes(2 * rows + numel // 2 - 1))),
        ("a 4-bit tensor one byte long", raw_tensor("nf4", shape, bytes(2 * rows + numel // 2 + 1))),
        ("a 4-bit tensor without scales", raw_tensor("nf4", shape, codes)),
        ("a 4-bit scalar", raw_tensor("nf4", [], b"")),
        ("a 4-bit tensor of rows of 0 values", raw_tensor("nf4", [BATCH, LENGTH, 0], b"")),
        ("a 4-bit tensor of 2**32-1 rows", raw_tensor("nf4", [2**32 - 1, 1], bytes(64))),
        ("a 4-bit tensor with 8-bit compression", raw_tensor("nf4", shape, bytes(2 * rows) + codes, UNIFORM_8BIT)),
    ]
    return cases


def stage_one_tensor_cases() -> list[tuple[str, list]]:
    """[inputs, targets] of the last stage, wrong in one way each."""
    x, y = hidden(), tokens()
    return [
        ("a NaN", [with_value(x, float("nan")), y]),
        ("an Inf", [with_value(x, float("inf")), y]),
        ("a -Inf", [with_value(x, float("-inf")), y]),
        ("3e38 everywhere (the sum overflows)", [with_value(x, 3e38, True), y]),
        ("-3e38 everywhere", [with_value(x, -3e38, True), y]),
        ("targets of 256", [x, y.clone().fill_(VOCAB)]),
        ("targets of -1", [x, with_value(y, -1)]),
        ("targets of 2**63-1", [x, with_value(y, 2**63 - 1)]),
        ("targets of -2**63", [x, with_value(y, -(2**63))]),
        ("float targets", [x, y.float()]),
        # token ids may travel narrow (int32, int16: swarm/wire/boundary.py), but must fit their buffer and vocabulary
        ("int32 targets of 2**31-1", [x, raw_tensor("int32", [BATCH, LENGTH], b"\xff\xff\xff\x7f" * BATCH * LENGTH)]),
        ("int16 targets of -1", [x, raw_tensor("int16", [BATCH, LENGTH], b"\xff\xff" * BATCH * LENGTH)]),
        ("int16 targets one byte short", [x, raw_tensor("int16", [BATCH, LENGTH], bytes(2 * BATCH * LENGTH - 1))]),
        ("targets of another shape", [x, tokens(BATCH, LENGTH + 1)]),
        ("batch 0", [hidden(0), tokens(0)]),
        ("batch larger than microbatch_size", [hidden(9), tokens(9)]),
        ("length 0", [hidden(BATCH, 0), tokens(BATCH, 0)]),
        ("length larger than context_length", [hidden(BATCH, 33), tokens(BATCH, 33)]),
        ("width - 1", [hidden(width=WIDTH - 1), y]),
        ("width + 1", [hidden(width=WIDTH + 1), y]),
        ("2-dimensional inputs", [x[0], y]),
        ("4-dimensional inputs", [x[None], y]),
        ("int64 inputs", [y, y]),
        ("no tensor", []),
        ("inputs without targets", [x]),
        ("3 tensors", [x, y, y]),
        ("100 tensors", [raw_tensor("float32", [1], bytes(4))] * 100),
        ("2000 empty tensors", [runtime_pb2.Tensor()] * 2000),
    ]


def stage_zero_tensor_cases() -> list[tuple[str, list]]:
    """Stage 0's forward takes [tokens]: wrong in one way each."""
    y = tokens()
    return [
        ("tokens of 256", [y.clone().fill_(VOCAB)]),
        ("tokens of -1", [with_value(y, -1)]),
        ("tokens of 2**63-1", [with_value(y, 2**63 - 1)]),
        ("tokens of -2**63", [with_value(y, -(2**63))]),
        ("float tokens", [y.float()]),
        ("hidden states", [hidden()]),
        ("3-dimensional tokens", [y[None]]),
        ("1-dimensional tokens", [y[0]]),
        ("batch 0", [tokens(0)]),
        ("batch larger than microbatch_size", [tokens(9)]),
        ("length 0", [tokens(BATCH, 0)]),
        ("length larger than context_length", [tokens(BATCH, 33)]),
        ("no tensor", []),
        ("2 tensors", [y, y]),
        ("size [10**9] with 8 bytes", [raw_tensor("int64", [10**9], bytes(8))]),
        (
            "a float16 header on int64 tokens",
            [raw_tensor("int64", [BATCH, LENGTH], bytes(8 * BATCH * LENGTH), FLOAT16)],
        ),
    ]


def backward_cases() -> list[tuple[str, int, list, str]]:
    """(label, stage, tensors, expected outcome) of backward requests that must not be applied."""
    grad, y = hidden(), tokens()
    return [
        ("a microbatch never seen", FIRST, [grad], "unknown_microbatch"),
        ("tokens of 256", FIRST, [grad, y.clone().fill_(VOCAB)], "bad_request"),
        ("float tokens", FIRST, [grad, y.float()], "bad_request"),
        ("a NaN gradient", FIRST, [with_value(grad, float("nan")), y], "bad_request"),
        ("an Inf gradient", FIRST, [with_value(grad, float("inf")), y], "bad_request"),
        ("a gradient of 3e38 everywhere", FIRST, [with_value(grad, 3e38, True), y], "bad_request"),
        ("a gradient of another shape", FIRST, [hidden(BATCH, LENGTH + 1), y], "bad_request"),
        ("a gradient of another width", FIRST, [hidden(width=WIDTH + 1), y], "bad_request"),
        ("an int64 gradient", FIRST, [tokens(), y], "bad_request"),
        ("no tensor", FIRST, [], "bad_request"),
        ("3 tensors", FIRST, [grad, y, y], "bad_request"),
        ("batch larger than microbatch_size", FIRST, [hidden(9), tokens(9)], "bad_request"),
        ("backward to the last stage", LAST, [grad, hidden()], "bad_request"),
        ("backward to the last stage, no inputs", LAST, [grad], "bad_request"),
        ("backward to the last stage, NaN", LAST, [with_value(grad, float("nan")), hidden()], "bad_request"),
    ]


SHAPES = [
    (BATCH, LENGTH, WIDTH),
    (BATCH, LENGTH),
    (BATCH, LENGTH, WIDTH + 1),
    (0, LENGTH, WIDTH),
    (9, LENGTH, WIDTH),
    (BATCH, 33, WIDTH),
    (BATCH,),
    (),
    (1, 1, 1, 1, 1),
    (BATCH, 0),
]
DIMS = [0, 1, 2, 8, 32, 33, 64, 2**16, 2**31, 2**32 - 1]  # the size field is uint32


def random_tensor(rng: random.Random) -> runtime_pb2.Tensor:
    """A real tensor of a plausible or implausible shape and values (sometimes corrupted), or a random header."""
    if rng.random() < 0.6:
        shape = rng.choice(SHAPES)
        generator = torch.Generator().manual_seed(rng.randrange(2**31))
        if rng.random() < 0.5:
            tensor = torch.randn(shape, generator=generator)
            special = rng.choice([None, None, float("nan"), float("inf"), 3e38, 1e30, -1e-45])
            if special is not None and tensor.numel():
                tensor = with_value(tensor, special, everywhere=rng.random() < 0.5)
            proto = encode_tensor(tensor, rng.choice(["float32", "float16", "8bit", "4bit"]))
        else:
            high = rng.choice([VOCAB, VOCAB + 1, 2**62])
            proto = encode_tensor(torch.randint(-1 if rng.random() < 0.2 else 0, high, shape, generator=generator))
        corruption = rng.random()
        if corruption < 0.1:
            proto.buffer = proto.buffer[: rng.randrange(len(proto.buffer) + 1)]
        elif corruption < 0.2 and proto.size:
            proto.size[rng.randrange(len(proto.size))] = rng.choice(DIMS)
        elif corruption < 0.25:
            proto.dtype = rng.choice(DTYPES)
        elif corruption < 0.3:
            proto.compression = rng.choice(COMPRESSION_VALUES)
        return proto
    size = [rng.choice(DIMS) for _ in range(rng.randrange(7))]
    buffer = rng.randbytes(rng.choice([0, 1, 4, 8, 63, 64, 256, 4096]))
    return raw_tensor(
        rng.choice(DTYPES), size, buffer, rng.choice(COMPRESSION_VALUES), requires_grad=rng.random() < 0.1
    )


def random_request(rng: random.Random, stage: int, fields: list[tuple[str, dict, bool | None]]) -> bytes:
    """Mostly valid metadata (not training), sometimes a bad field or garbage; 0 to 5 random tensors."""
    pick = rng.random()
    if pick < 0.7:
        meta: dict | bytes = metadata(stage=stage, microbatch_id=rng.choice(["fuzz", "a", "x" * 64]))
    elif pick < 0.9:
        meta = rng.choice(fields)[1]
    else:
        meta = rng.choice(metadata_garbage()[:22])[1]  # not the large ones: hundreds of cases must stay fast
    count = rng.choice([0, 1, 1, 2, 2, 2, 3, 5])
    return make_request([random_tensor(rng) for _ in range(count)], meta).SerializeToString()


def stream_cases(stage: int) -> list[tuple[str, list[bytes], set[str]]]:
    """(label, frames, expected outcomes) of request streams that end (hivemind's end-of-stream follows)."""
    valid = valid_forward(stage)
    head = frame(runtime_pb2.ExpertRequest(metadata=valid.metadata).SerializeToString())
    too_big = validation.max_message_bytes(MANIFEST) + 2**17
    n = BATCH * LENGTH * WIDTH
    # refused before the stream's end: the reply may be lost (see test_a_stream_refused_midway_still_gets_its_reply)
    refused = {"bad_request", "closed"}
    return [
        ("a valid request", parts(valid), {"ok"}),
        ("no message at all", [], {"bad_request"}),
        ("metadata only", [head], {"bad_request"}),
        ("an empty chunk", [head, chunk_part(b"", "float32", [BATCH, LENGTH, WIDTH])], refused),
        ("an empty chunk after a full one", parts(valid) + [chunk_part(b"")], refused),
        ("3 tensors", [head] + [chunk_part(bytes(8), "int64", [1])] * 3, refused),
        (
            "more bytes than any request",
            [head] + [chunk_part(bytes(2**16), "float32", [2**14])] * (too_big // 2**16),
            refused,
        ),
        (
            "1000 one-byte chunks",
            [head, chunk_part(b"\x00", "float32", [BATCH, LENGTH, WIDTH])] + [chunk_part(b"\x00")] * 999,
            {"bad_request"},
        ),
        (
            "a chunk without a header first",
            [head, chunk_part(bytes(4 * n)), chunk_part(bytes(8), "int64", [1])],
            {"bad_request"},
        ),
        ("the metadata in the second part", [frame(b""), head] + parts(valid)[1:], {"bad_request"}),
        ("an error frame first", [frame(b"\x0a\x03abc", P2P.ERROR_MARKER)] + parts(valid), refused),
        ("a foreign swarm id", parts(make_request([hidden(), tokens()], metadata(swarm_id="0" * 16))), {"bad_request"}),
    ]


RAW_STREAMS: list[tuple[str, list[bytes]]] = [
    # framing hivemind cannot read: it drops the stream (no reply), the handler's work is cancelled
    ("an unknown marker byte", [b"\x07" + bytes(16)]),
    ("a frame that is not a protobuf", [frame(b"\xff" * 64)]),
    ("a frame declaring 2**63 bytes, cut short", [P2P.MESSAGE_MARKER + (2**63).to_bytes(8, "big") + bytes(100)]),
    ("half a header", [P2P.MESSAGE_MARKER + b"\x00\x00"]),
]
