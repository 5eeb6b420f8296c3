"""Sample text from a model exported with swarm-export.

The file's metadata holds the model config: the model is rebuilt with swarm.architectures.model.build_full_model, its
weights loaded strictly (every parameter present, no extra one, same shapes), and text sampled byte by byte
(the vocabulary is bytes: the prompt is encoded as UTF-8, the output decoded with invalid sequences replaced).
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import sys
from pathlib import Path

import torch

from swarm.architectures.model import StageModel, build_full_model
from swarm.errors import ManifestError, SwarmError
from swarm.manifests.manifest import ModelConfig
from swarm.manifests.validation import manifest_from_dict

EXAMPLES = """\
examples:
  swarm-export --join my-swarm.json --out model.safetensors
      first export the swarm's current model
  python examples/generate.py --model model.safetensors --prompt "def main(" --tokens 300
      continue a prompt with 300 bytes
  python examples/generate.py --model model.safetensors --temperature 0
      greedy decoding (always the most likely next byte)
  python examples/generate.py --model model.safetensors --seed 1 --top-k 20
      reproducible sampling among the 20 most likely bytes
"""


class GenerateError(SwarmError):
    """The model file cannot be used, or the options do not fit the model."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="generate.py",
        description="Sample text from a model exported with swarm-export (a .safetensors file).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, metavar="FILE", help="a file written by swarm-export")
    parser.add_argument("--prompt", default="def ", help="the text to continue (default: %(default)r)")
    parser.add_argument("--tokens", type=int, default=200, metavar="N", help="bytes to generate (default: 200)")
    parser.add_argument(
        "--temperature", type=float, default=0.8, metavar="T", help="sampling temperature; 0 is greedy (default: 0.8)"
    )
    parser.add_argument(
        "--top-k", type=int, default=40, metavar="K", help="sample among the K most likely bytes; 0: all (default: 40)"
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: random)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"], help="default: cpu")
    args = parser.parse_args(argv)
    if args.tokens < 0:
        parser.error("--tokens must be at least 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error("--temperature must be a finite number, at least 0")
    if args.top_k < 0:
        parser.error("--top-k must be at least 0 (0 means no limit)")
    return args


def load_model(path: Path, device: torch.device) -> tuple[StageModel, dict[str, str]]:
    """Rebuild the model a swarm-export file describes and load its weights strictly."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        raise GenerateError(f"--model {path}: no such file; make one with swarm-export --join MANIFEST --out FILE")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a file that is not safetensors
        raise GenerateError(
            f"--model {path} is not a safetensors file ({type(e).__name__}: {e}); give a file written by swarm-export"
        ) from None
    if "swarm_export" not in metadata or "model_config" not in metadata:
        raise GenerateError(
            f"--model {path} is a safetensors file, but not a Swarm export: its metadata has no model config. "
            "Make one with swarm-export --join MANIFEST --out FILE."
        )
    try:
        raw_config = json.loads(metadata["model_config"])
        # validated like a manifest's model section, so a damaged config gets an error naming the field
        config = manifest_from_dict({"name": "export", "model": raw_config, "stages": {"count": 1}}).model
    except (json.JSONDecodeError, ManifestError) as e:
        raise GenerateError(f"--model {path}: the model config in its metadata is invalid: {e}") from None
    model = build_full_model(config)
    try:
        weights = load_file(str(path))
    except Exception as e:
        raise GenerateError(f"--model {path}: cannot read its tensors ({type(e).__name__}: {e})") from None
    problem = _mismatch(model, weights)
    if problem:
        raise GenerateError(f"--model {path}: its weights do not fit the model its metadata describes: {problem}")
    model.load_state_dict(weights, strict=True)
    return model.to(device).eval(), metadata


def _mismatch(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> str:
    """What keeps `weights` from loading strictly into `model`, in words; "" if nothing."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing = [name for name in expected if name not in weights]
    unexpected = sorted(name for name in weights if name not in expected)
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors missing (e.g. {missing[0]!r})")
    if unexpected:
        problems.append(f"{len(unexpected)} unknown tensors (e.g. {unexpected[0][:100]!r})")
    for name, shape in expected.items():
        if name in weights and tuple(weights[name].shape) != shape:
            problems.append(f"{name!r} is {list(weights[name].shape)}, the model's is {list(shape)}")
            break
    for name, tensor in weights.items():
        if name in expected and not tensor.is_floating_point():
            problems.append(f"{name!r} is {tensor.dtype}, not floating point")
            break
    return "; ".join(problems)


@torch.no_grad()
def generate(
    model: StageModel,
    config: ModelConfig,
    prompt: list[int],
    tokens: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
):
    """Yield `tokens` new token ids after `prompt`, feeding at most context_length tokens to the model."""
    device = next(model.parameters()).device
    sequence = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(tokens):
        window = sequence[:, -config.context_length :]
        logits = model(window)[0, -1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probabilities = torch.softmax(logits, dim=-1).cpu()
            token = int(torch.multinomial(probabilities, 1, generator=generator))
        sequence = torch.cat([sequence, torch.tensor([[token]], device=device)], dim=1)
        yield token


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise GenerateError("--device cuda: torch sees no CUDA GPU here; use --device cpu")
        if args.device == "mps" and not torch.backends.mps.is_available():
            raise GenerateError("--device mps: this torch has no MPS support; use --device cpu")
        model, metadata = load_model(Path(args.model), torch.device(args.device))
        config = model.config
        prompt = list(args.prompt.encode("utf-8")) or [ord("\n")]
        if max(prompt) >= config.vocab_size:
            raise GenerateError(
                f"the model's vocabulary has {config.vocab_size} tokens, fewer than the 256 byte values, so it cannot "
                "read a UTF-8 prompt; use a prompt of ASCII characters below that value"
            )
    except SwarmError as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 1
    generator = torch.Generator()
    if args.seed is not None:
        generator.manual_seed(args.seed)
    else:
        generator.seed()  # a random seed, without touching torch's global generator
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    name = metadata.get("swarm_name", "?")
    print(f"# model of swarm {name!r} ({sum(p.numel() for p in model.parameters()):,} parameters)", file=sys.stderr)
    sys.stdout.write(args.prompt)
    for token in generate(model, config, prompt, args.tokens, args.temperature, args.top_k, generator):
        if token < 256:  # a byte; larger vocabularies' extra tokens have no text
            sys.stdout.write(decoder.decode(bytes([token])))
            sys.stdout.flush()
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
