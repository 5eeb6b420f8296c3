"""Writing an exported model as a Hugging Face folder that transformers loads with `from_pretrained`.

The folder holds config.json and generation_config.json (swarm/hf/format.py), model.safetensors under
transformers' tensor names (the swarm's provenance in its metadata, as in Swarm's own export format), and the
tokenizer: the swarm's tokenizer.json, or for a byte-vocabulary swarm a byte-level tokenizer.json whose ids are
the byte values, so that `AutoTokenizer.from_pretrained(folder)` encodes text the way the swarm trained on it.
Every file is written atomically; files of an earlier export in the same folder are replaced.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from swarm.errors import ExportError
from swarm.files import atomic_write
from swarm.hf.format import hf_config, to_hf_state
from swarm.manifests.manifest import Manifest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_output_folder(folder: Path) -> None:
    """Fail before any download if `folder` cannot be written (created if its parent exists)."""
    if folder.exists() and not folder.is_dir():
        raise ExportError(f"{folder} is a file; a Hugging Face export is a folder: give a folder's path")
    if not folder.exists():
        if not folder.parent.is_dir():
            raise ExportError(f"cannot create {folder}: the folder {folder.parent} does not exist")
        if not os.access(folder.parent, os.W_OK | os.X_OK):
            raise ExportError(f"cannot create {folder}: this user may not write in {folder.parent}")
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise ExportError(f"this user may not write files in {folder}; choose another folder")


def byte_tokenizer_json() -> str:
    """A tokenizer.json (Hugging Face tokenizers) for the byte vocabulary: id i is byte i, nothing merged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the printable stand-ins ByteLevel uses for the 256 bytes
    vocab = {_byte_char(b): b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def _byte_char(b: int) -> str:
    """GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for code points from 256 on."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    if b in printable:
        return chr(b)
    return chr(256 + sum(1 for x in range(b) if x not in printable))


def write_hf_folder(
    folder: Path,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    tokenizer_json: str | None,
    special_tokens: dict[str, str | None],
    dtype: str = "float32",
) -> int:
    """Write the folder; returns the bytes of model.safetensors. `tokenizer_json`: the swarm's tokenizer file's
    text (None: the byte vocabulary); `special_tokens`: {"eos_token": "<|endoftext|>", "bos_token": None}."""
    from safetensors.torch import save_file

    config = manifest.model
    state = {name: tensor.to(DTYPES[dtype]) for name, tensor in to_hf_state(config, tensors).items()}
    ids = _special_ids(tokenizer_json, special_tokens)
    hf = hf_config(config, eos_id=ids.get("eos_token"), bos_id=ids.get("bos_token"))
    hf["torch_dtype"] = dtype
    # no max_length: generate(max_new_tokens=...) would warn that both are set; the model's context is in
    # config.json (max_position_embeddings / n_positions) and tokenizer_config.json (model_max_length)
    generation = {"do_sample": True, "temperature": 0.8, "top_k": 40}
    generation |= {"bos_token_id": ids.get("bos_token"), "eos_token_id": ids.get("eos_token")}
    tokens = {key: value for key, value in special_tokens.items() if value}
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.context_length,
        "clean_up_tokenization_spaces": False,
        **tokens,
    }
    try:
        folder.mkdir(exist_ok=True)
        atomic_write(folder / "model.safetensors", lambda path: save_file(state, path, metadata=metadata))
        atomic_write(folder / "config.json", json.dumps(hf, indent=2) + "\n")
        atomic_write(folder / "generation_config.json", json.dumps(generation, indent=2) + "\n")
        atomic_write(folder / "tokenizer.json", tokenizer_json if tokenizer_json is not None else byte_tokenizer_json())
        atomic_write(folder / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2) + "\n")
        atomic_write(folder / "special_tokens_map.json", json.dumps(tokens, indent=2) + "\n")
        return (folder / "model.safetensors").stat().st_size
    except OSError as e:
        raise ExportError(f"cannot write the export into {folder}: {e.strerror or e}") from None


def _special_ids(tokenizer_json: str | None, special_tokens: dict[str, str | None]) -> dict[str, int]:
    if tokenizer_json is None:
        return {}
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    result = {}
    for key, token in special_tokens.items():
        if token and tokenizer.token_to_id(token) is not None:
            result[key] = tokenizer.token_to_id(token)
    return result
