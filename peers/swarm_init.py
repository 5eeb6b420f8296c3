"""swarm-init: write the manifest of a new swarm from a model size preset and explicit settings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from swarm import __version__
from swarm.architectures.model import count_stage_parameters
from swarm.dataset.new_swarm import swarm_sources
from swarm.errors import SwarmError
from swarm.manifests.loading import write_manifest
from swarm.manifests.manifest import (
    ACTIVATION_COMPRESSIONS,
    ARCHITECTURES,
    AVERAGING_COMPRESSIONS,
    AVERAGING_MODES,
    OPTIMIZERS,
    PRECISIONS,
    Manifest,
)
from swarm.manifests.presets import PRESETS, new_manifest
from swarm.trust.secret import write_secret

EXAMPLES = """\
examples:
  swarm-init my-swarm
      a tiny model (0.8M parameters, 2 stages) trained on Python's standard library: try it on CPUs
  swarm-init my-swarm --preset 1b --data /data/corpus --out my-swarm.json
      about 1B parameters in 4 stages for GPUs, trained on the text files under /data/corpus
  swarm-init my-swarm --preset llama-1b --spans --tokenizer prepared/tokenizer.json
      the 1.1B Llama with one block a stage: each peer serves as many as its GPU memory holds (8 GB and up)
  swarm-init my-swarm --preset small --stages 4 --learning-rate 5e-4 --averaging-mode diloco
      a preset with some settings changed
  swarm-init my-swarm --private
      a private swarm: also writes my-swarm.secret (give it only to members; the manifest names it, so the
      manifest can still be published); peers without it can neither read, call nor average with members
  swarm-init my-swarm --width 256 --depth 6 --heads 8 --context-length 256 --stages 3
      explicit model settings (the rest from the tiny preset)
  swarm-init my-llama --preset llama-150m --data prepared/ --tokenizer prepared/tokenizer.json
      OpenDiLoCo's 150M Llama in bfloat16 on data that `swarm-data prepare` tokenized; publish the manifest and
      prepared/ side by side on a web server and volunteers fetch the chunks they read
  swarm-init my-web --preset llama-150m --data https://example.org/web-corpus/ --tokenizer tokenizer.json
      data published elsewhere (also hf://datasets/USER/REPO/FOLDER or s3://BUCKET/PREFIX): its index is read and
      pinned by hash now
  swarm-init my-llama --preset llama-tiny --data notes/ --train-tokenizer 4096
      a tiny Llama with a BPE of 4096 ids trained here on the text files under notes/ (no download)
  swarm-init my-finetune --from-pretrained ./TinyLlama-1.1B --data prepared/
      continue training a Hugging Face Llama (its config, weights and tokenizer come from the folder)

then start the swarm's first peer, which writes its addresses into the manifest:
  swarm-peer --join my-swarm.json --new-swarm
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swarm-init",
        description="Create a new swarm: write its manifest (model, stages, training settings, data source).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("name", help="the swarm's name, shown to everyone who joins (at most 64 characters)")
    presets = ", ".join(f"{name} ({p.description.split(';')[0]})" for name, p in PRESETS.items())
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS), help=f"model size: {presets}")
    parser.add_argument("--stages", type=int, default=None, help="number of pipeline stages (default: the preset's)")
    parser.add_argument(
        "--spans",
        action="store_true",
        help="peers serve as many consecutive stages as their memory holds, so that GPUs of any size take part; "
        "one block a stage unless --stages says otherwise (swarm-plan shows what each GPU would serve)",
    )
    parser.add_argument("--out", "-o", default=None, metavar="PATH", help="where to write it (default: NAME.json)")
    parser.add_argument("--force", action="store_true", help="overwrite PATH (and the secret file) if it exists")
    parser.add_argument(
        "--private",
        action="store_true",
        help="make a private swarm: write a new secret next to the manifest (NAME.secret) and name it in the "
        "manifest; only peers that have the file can take part",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON summary instead of a table")
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")

    model = parser.add_argument_group("model (default: the preset's)")
    model.add_argument("--architecture", choices=ARCHITECTURES, default=None, help="gpt or llama blocks")
    for flag in ("width", "depth", "heads", "context-length", "vocab-size", "seed"):
        model.add_argument(f"--{flag}", type=int, default=None)
    model.add_argument("--kv-heads", type=int, default=None, help="llama: key/value heads (grouped-query attention)")
    model.add_argument("--intermediate-size", type=int, default=None, help="the MLP's width")
    model.add_argument(
        "--tie-embeddings",
        action="store_true",
        default=None,
        help="the LM head reuses the token embeddings (one-stage swarms only)",
    )
    model.add_argument(
        "--from-pretrained",
        default=None,
        metavar="DIR",
        help="start from a Hugging Face Llama folder (config.json, *.safetensors, tokenizer.json): the model's shape "
        "and tokenizer come from it, and the swarm id covers its weights",
    )

    training = parser.add_argument_group("training (default: the preset's)")
    training.add_argument("--microbatch-size", type=int, default=None, help="samples per microbatch")
    training.add_argument("--microbatches-per-step", type=int, default=None, help="microbatches per optimizer step")
    training.add_argument("--learning-rate", type=float, default=None)
    training.add_argument("--optimizer", choices=OPTIMIZERS, default=None)
    training.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="the most microbatches a trainer keeps in flight (default 0: two steps' worth, adapted to the route)",
    )
    training.add_argument(
        "--activation-compression", choices=ACTIVATION_COMPRESSIONS, default=None, help="between stages"
    )
    training.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="the dtype stages compute in (weights and optimizer state stay float32)",
    )
    training.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="recompute each stage's blocks in backward: far less activation memory, about 1/3 more compute",
    )
    training.add_argument(
        "--averaging-mode", choices=AVERAGING_MODES, default=None, help="how a stage's replicas average (diloco)"
    )
    training.add_argument(
        "--averaging-every",
        type=int,
        default=None,
        metavar="SAMPLES",
        help="samples per round (the preset's: 4096; 8192 for 1b)",
    )
    training.add_argument(
        "--averaging-compression",
        choices=AVERAGING_COMPRESSIONS,
        default=None,
        help="what a round sends (4bit in diloco mode, 8bit in parameters mode, which refuses 4bit)",
    )
    training.add_argument(
        "--outer-lr", type=float, default=None, help="diloco mode: the outer SGD's learning rate (1.0)"
    )
    training.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help="diloco mode: its Nesterov momentum (0: the replicas' mean step; DiLoCo's paper: lr 0.7, momentum 0.9)",
    )
    training.add_argument(
        "--data",
        default=None,
        metavar="SOURCE",
        help="a folder that `swarm-data prepare` wrote, published anywhere (a path next to the manifest, an "
        "https:// URL, hf://datasets/USER/REPO/FOLDER, s3://BUCKET/PREFIX): volunteers fetch its chunks as they "
        "read them, verified; or 'stdlib' (default), or raw text every peer has at this path",
    )
    training.add_argument(
        "--mirror",
        action="append",
        default=None,
        metavar="URL",
        help="another place with the same prepared folder (repeat for more): tried after --data's, in order",
    )
    training.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a Hugging Face tokenizer.json (copied next to the manifest; its SHA-256 becomes part of the swarm id)",
    )
    training.add_argument(
        "--train-tokenizer",
        type=int,
        default=None,
        metavar="SIZE",
        help="train a byte-level BPE of SIZE ids on the data source, here, and use it",
    )
    training.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR", help="bootstrap multiaddrs")
    args = parser.parse_args(argv)
    if not args.name.strip() or len(args.name) > 64 or not args.name.isprintable():
        parser.error("NAME must be 1 to 64 printable characters")
    if sum(x is not None for x in (args.tokenizer, args.train_tokenizer, args.from_pretrained)) > 1:
        parser.error("give at most one of --tokenizer, --train-tokenizer and --from-pretrained (which has one)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(f"{args.name.strip().replace(' ', '-').replace('/', '-')}.json")
    try:
        if out.exists() and not args.force:
            raise SwarmError(f"{out} already exists; pass --force to overwrite it, or --out another path")
        secret_path = out.with_suffix(".secret") if args.private else None
        if secret_path is not None and secret_path.exists() and not args.force:
            raise SwarmError(f"{secret_path} already exists; pass --force to replace it (members need the new one)")
        model = _given(
            args,
            "architecture",
            "width",
            "depth",
            "heads",
            "context_length",
            "vocab_size",
            "seed",
            "kv_heads",
            "intermediate_size",
            "tie_embeddings",
        )
        sources = swarm_sources(
            out,
            model,
            data_source=args.data,
            tokenizer=args.tokenizer,
            train_tokenizer_size=args.train_tokenizer,
            from_pretrained=args.from_pretrained,
            stages=args.stages,
            force=args.force,
        )
        stages = args.stages
        if args.spans and stages is None:  # one block a stage: spans of any length
            stages = sources.model.get("depth") or PRESETS[args.preset].model["depth"]
        manifest = new_manifest(
            args.name,
            args.preset,
            stages=stages,
            balancing={"spans": True} if args.spans else None,
            model=sources.model,
            training=_given(
                args,
                "microbatch_size",
                "microbatches_per_step",
                "learning_rate",
                "optimizer",
                "max_in_flight",
                "activation_compression",
                "precision",
                "activation_checkpointing",
            ),
            averaging={
                key: value
                for key, value in (
                    ("mode", args.averaging_mode),
                    ("every_samples", args.averaging_every),
                    ("compression", args.averaging_compression),
                    ("outer_learning_rate", args.outer_lr),
                    ("outer_momentum", args.outer_momentum),
                )
                if value is not None
            },
            data_source=args.data,
            initial_peers=args.initial_peers,
            secret_file=secret_path.name if secret_path is not None else None,
            data={**sources.data, **({"mirrors": args.mirror} if args.mirror else {})},
            pretrained=sources.pretrained,
        )
        if secret_path is not None:
            write_secret(secret_path)
        write_manifest(manifest, out)
    except SwarmError as e:
        print(f"swarm-init: error: {e}", file=sys.stderr)
        return 2
    summary = summarize(manifest, out)
    if args.json:
        print(json.dumps(summary))
    else:
        print_summary(summary)
    return 0


def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def summarize(manifest: Manifest, path: Path) -> dict[str, Any]:
    per_stage = count_stage_parameters(manifest)
    return {
        "path": str(path),
        "name": manifest.name,
        "swarm_id": manifest.swarm_id,
        "parameters": sum(per_stage),
        "stages": [
            {"stage": i, "layers": list(layers), "parameters": count}
            for i, (layers, count) in enumerate(zip(manifest.stages, per_stage))
        ],
        "initial_peers": list(manifest.initial_peers),
        "secret_file": str(path.parent / manifest.network.secret_file) if manifest.private else None,
    }


def print_summary(summary: dict[str, Any]) -> None:
    console = Console()
    console.print(
        f"wrote [bold]{escape(summary['path'])}[/]: swarm [bold]{escape(summary['name'])}[/] "
        f"(id {summary['swarm_id']}), {summary['parameters'] / 1e6:.1f}M parameters"
    )
    table = Table("stage", "layers", "parameters")
    for stage in summary["stages"]:
        start, end = stage["layers"]
        table.add_row(str(stage["stage"]), f"{start}..{end - 1}", f"{stage['parameters'] / 1e6:.1f}M")
    console.print(table)
    if summary["secret_file"]:
        console.print(
            f"wrote the swarm's secret to [bold]{escape(summary['secret_file'])}[/]: give it only to members, who "
            "keep it next to the manifest",
        )
    console.print("next: start the swarm's first peer; it writes its addresses into the manifest:")
    console.print(f"  swarm-peer --join {escape(summary['path'])} --new-swarm", highlight=False)
    console.print("then publish it (a web server, a repository, a gist); others join with:")
    console.print(f"  swarm-peer --join <its URL>#{summary['swarm_id']}", highlight=False)


if __name__ == "__main__":
    sys.exit(main())
