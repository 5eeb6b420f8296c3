"""Fuzz tests of the checkpoint loader: truncated, flipped, mis-sized and random files, lying safetensors headers,
and well-formed files whose tensors do not fit the stage. Each must load and fit, or raise CheckpointError (the
file) or BadRequestError (it does not fit the model), never another exception."""

from __future__ import annotations

import collections
import copy
import json
import random
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

from fuzzing import CASES, FIRST, MANIFEST, print_case_counts  # noqa: F401
from swarm.architectures.model import build_stage
from swarm.errors import BadRequestError, CheckpointError
from swarm.server.checkpoint import load_checkpoint, save_checkpoint
from swarm.server.compute import StageCompute


def checkpoint_parts(path: Path) -> tuple[dict, bytes]:
    """The JSON header and the tensor bytes of a safetensors file."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def with_header(header: dict, body: bytes, pad: int = 0) -> bytes:
    raw = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(raw)) + raw + body


def mutate_header(header: dict, rng: random.Random) -> dict:
    """One lie in a safetensors header: a tensor's dtype, shape or offsets, or Swarm's metadata."""
    header = copy.deepcopy(header)
    names = [name for name in header if name != "__metadata__"]
    meta = header["__metadata__"]
    pick = rng.randrange(8)
    if pick == 0:
        header[rng.choice(names)]["dtype"] = rng.choice(["F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "X", ""])
    elif pick == 1:
        header[rng.choice(names)]["shape"] = rng.choice([[], [0], [10**12], [-1], ["a"], [1.5], [2**64], [1] * 100])
    elif pick == 2:
        begin, end = header[rng.choice(names)]["data_offsets"]
        header[rng.choice(names)]["data_offsets"] = rng.choice([[0, 0], [end, begin], [0, 10**12], [-1, end], [begin]])
    elif pick == 3:
        del header[rng.choice(names)]
    elif pick == 4:
        key = rng.choice(sorted(meta))
        meta[key] = rng.choice(["", "x", "nan", "-1", "1e999", "[]", "{}", "null", '{"optimizer_steps": -1}'])
    elif pick == 5:
        meta[rng.choice(sorted(meta))] = rng.choice([None, 1, [], {"a": 1}, True])  # not strings
    elif pick == 6:
        del meta[rng.choice(sorted(meta))]
    else:
        meta["counters"] = json.dumps(
            rng.choice(
                [{"optimizer_steps": 2**60}, {"optimizer_steps": 1.5}, {"x": True}, [1], {"averaging_round": -1}]
            )
        )
    return header


def check_checkpoint_or_error(path: Path, case: str, server: StageCompute) -> str:
    """A checkpoint file must load and fit the stage, or raise CheckpointError (file checks) or BadRequestError
    (StageCompute.load_state: it does not fit the model); nothing else."""
    try:
        checkpoint = load_checkpoint(path, MANIFEST, FIRST)
        server.load_state(checkpoint.items, checkpoint.counters)
    except (CheckpointError, BadRequestError) as e:
        assert str(e), case
        return "refused"
    except Exception as e:
        raise AssertionError(f"{case}: {type(e).__name__}: {str(e)[:200]}") from e
    return "loaded"


def test_corrupted_checkpoints_raise_the_projects_errors(tmp_path: Path):
    rng = random.Random(13)
    server = StageCompute(MANIFEST, FIRST, build_stage(MANIFEST, FIRST), torch.device("cpu"))  # the test's own
    for p in server.params:  # a step, so that the state holds optimizer statistics too
        p.grad = torch.ones_like(p)
    server.optimizer_step()
    items, counters = server.snapshot()
    good = save_checkpoint(tmp_path / "good", MANIFEST, FIRST, items, counters)
    whole = good.read_bytes()
    header, body = checkpoint_parts(good)
    (length,) = struct.unpack("<Q", whole[:8])
    path = tmp_path / "stage-0.safetensors"
    outcomes: collections.Counter[str] = collections.Counter()
    for i in range(300):
        pick = i % 6
        if pick == 0:
            data = whole[: rng.randrange(len(whole))]
        elif pick == 1:  # flipped bytes, mostly in the header, where they matter most
            data = bytearray(whole)
            end = 8 + length if rng.random() < 0.7 else len(whole)
            for _ in range(rng.choice([1, 2, 10])):
                data[rng.randrange(end)] = rng.randrange(256)
            data = bytes(data)
        elif pick == 2:
            size = rng.choice([0, 1, 7, 8, len(whole) - 1, len(whole), len(whole) + 1, 2**32, 2**63, 2**64 - 1])
            data = struct.pack("<Q", size) + whole[8:]
        elif pick == 3:
            data = with_header(mutate_header(header, rng), body, pad=rng.choice([0, 0, 3]))
        elif pick == 4:
            data = rng.randbytes(rng.choice([0, 1, 8, 100, 10_000]))
        else:  # a well-formed file whose tensors do not fit: wrong shapes, dtypes, names, values
            broken = list(items)
            j = rng.randrange(len(broken))
            name, tensor = broken[j]
            broken[j] = rng.choice(
                [
                    (name, tensor.flatten()[:-1]),
                    (name, tensor.half()),
                    (name, tensor.double()),
                    (name, torch.full_like(tensor, float("nan"))),
                    (name, torch.full_like(tensor, -1.0)),
                    (name + "x", tensor),
                    ("outer/" + name, tensor),
                ]
            )
            if rng.random() < 0.3:
                del broken[rng.randrange(len(broken))]
            data = safetensors.torch.save({n: t.contiguous() for n, t in broken}, metadata=header["__metadata__"])
        path.write_bytes(data)
        outcomes[check_checkpoint_or_error(path, f"case {i} (kind {pick})", server)] += 1
    CASES["checkpoint: corruptions"] += sum(outcomes.values())
    assert outcomes["refused"] > 250, outcomes
    # not a file at all
    for label, make in (("a folder", lambda p: p.mkdir()), ("a dangling link", lambda p: p.symlink_to(p))):
        other = tmp_path / label.replace(" ", "-")
        make(other)
        assert check_checkpoint_or_error(other, label, server) == "refused"
        CASES["checkpoint: corruptions"] += 1


def test_a_checkpoint_with_deeply_nested_counters_raises_checkpoint_error(tmp_path: Path):
    path = save_checkpoint(tmp_path, MANIFEST, FIRST, [("param/x", torch.zeros(3))], {"optimizer_steps": 1})
    header, body = checkpoint_parts(path)
    header["__metadata__"]["counters"] = "[" * 100_000
    path.write_bytes(with_header(header, body))
    CASES["checkpoint: crafted"] += 1
    with pytest.raises(CheckpointError):
        load_checkpoint(path, MANIFEST, FIRST)
