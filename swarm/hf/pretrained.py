"""Starting a swarm from a pretrained Hugging Face Llama: reading its folder, pinning its weights, and loading one
stage's layers from it.

`swarm-init --from-pretrained DIR` reads DIR/config.json into the manifest's model config and pins the weights by
the SHA-256 of DIR's safetensors files (in name order), so that the swarm id covers them. The first peer of a stage
(nobody to take the state from, no checkpoint) loads that stage's layers from the folder, after checking the hash;
every later peer takes the state from peers as usual. A tied LM head (tie_word_embeddings) is untied when the
model is split into stages: the last stage starts from a copy of the embeddings.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from swarm.errors import ManifestError
from swarm.hf.format import hf_name, model_config_from_hf
from swarm.manifests.loading import confined
from swarm.manifests.manifest import Manifest, ModelConfig
from swarm.wire.state import stage_parameter_shapes

logger = logging.getLogger(__name__)


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ManifestError(f"{folder} has no .safetensors file; --from-pretrained reads Hugging Face safetensors")
    return files


def weights_sha256(folder: Path) -> str:
    """SHA-256 over the folder's safetensors files: each file's name and bytes, in name order."""
    digest = hashlib.sha256()
    for path in weight_files(folder):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as file:
            while block := file.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()


def read_config(folder: Path, seed: int = 0) -> ModelConfig:
    """The model config of a Hugging Face Llama folder (ManifestError if it is none)."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{folder} has no config.json: give a Hugging Face model folder") from None
    except (OSError, ValueError) as e:
        raise ManifestError(f"cannot read {path}: {str(e)[:200]}") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{path} is not a JSON object")
    return model_config_from_hf(raw, seed=seed)


def pretrained_folder(manifest: Manifest) -> Path:
    """The folder `pretrained.path` names (relative: to the manifest's folder)."""
    name, origin = manifest.pretrained.path, manifest.origin
    if not origin or origin.startswith(("http://", "https://")):
        # a manifest from a URL or a peer names a folder under the current one only (as for a secret file)
        if not confined(name):
            raise ManifestError(
                f"pretrained.path {name[:200]!r}: a manifest from a URL or a peer may name only a folder under the "
                "current one; download the manifest and keep it next to the model's folder instead"
            )
        return Path.cwd() / name
    return Path(origin) / Path(name).expanduser()


def stage_parameters(manifest: Manifest, stage: int) -> dict[str, torch.Tensor]:
    """Stage `stage`'s parameters (stage-local names, float32) from the pretrained folder, after checking that
    the folder's weights are the ones the manifest pins. Raises ManifestError."""
    from safetensors import safe_open

    folder = pretrained_folder(manifest)
    if not folder.is_dir():
        raise ManifestError(
            f"the swarm starts from the pretrained model in {folder}, which this machine does not have; copy the "
            "folder there (or start this peer once another peer serves the stage)"
        )
    actual = weights_sha256(folder)
    if actual != manifest.pretrained.sha256:
        raise ManifestError(
            f"the weights in {folder} have SHA-256 {actual[:16]}..., the manifest pins "
            f"{manifest.pretrained.sha256[:16]}...: they are another model (or a changed copy)"
        )
    shapes = stage_parameter_shapes(manifest, stage)
    layers = manifest.stage_layers(stage)
    wanted = {}
    for name in shapes:
        full = name
        if name.startswith("blocks."):
            index, rest = name[len("blocks.") :].split(".", 1)
            full = f"blocks.{layers[int(index)]}.{rest}"
        wanted[name] = hf_name(manifest.model, full)
    located = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (safe_open is no dict)
                located[key] = path
    result = {}
    for name, key in wanted.items():
        if key not in located and key == "lm_head.weight":  # tied: the head starts as a copy of the embeddings
            key = hf_name(manifest.model, "embeddings.tokens.weight")
        if key not in located:
            raise ManifestError(f"the pretrained model in {folder} has no tensor {key!r}")
        with safe_open(str(located[key]), framework="pt") as file:
            tensor = file.get_tensor(key).to(torch.float32)
        if tuple(tensor.shape) != shapes[name]:
            raise ManifestError(
                f"{key} in {folder} is {list(tensor.shape)}, the manifest's model has {list(shapes[name])}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise ManifestError(f"{key} in {folder} holds NaN or Inf")
        result[name] = tensor
    logger.info(f"read stage {stage}'s {len(result)} tensors from the pretrained model in {folder}")
    return result
