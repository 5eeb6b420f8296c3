"""swarm-export: download every stage's trained parameters from a running swarm into one safetensors file, or into
a Hugging Face folder that transformers loads (--format hf).

The program: arguments, a DHT client node, progress and the summary. The export itself (finding each stage's
peers, downloading, renaming to the whole model's names, checking, writing atomically) is swarm/client/export.py's; the
Hugging Face folder is swarm/hf/folder.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from hivemind import DHT
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from peers import runtime
from swarm import __version__
from swarm.client import joining
from swarm.client.export import (
    DEFAULT_TIMEOUT,
    DISCOVERY_WAIT,
    StageSource,
    check_output_path,
    export_metadata,
    export_swarm,
    one_line,
    remaining,
    short_error,
    write_safetensors,
)
from swarm.dataset.tokenizer import Tokenizer
from swarm.dht import node
from swarm.errors import ExportError, SwarmError
from swarm.hf.folder import DTYPES, check_output_folder, write_hf_folder
from swarm.manifests.manifest import Manifest

logger = logging.getLogger("swarm-export")

EXAMPLES = """\
examples:
  swarm-export --join my-swarm.json --out model.safetensors
      download every stage's current parameters from the swarm into one file
  swarm-export --join my-swarm.json --out model.safetensors --timeout 600 --json
      allow 10 minutes (a large model on a slow link) and print the summary as one JSON document
  swarm-export --join /ip4/203.0.113.7/tcp/31337/p2p/QmXhR... --out model.safetensors
      the same through any running peer, which hands out the manifest
  python examples/generate.py --model model.safetensors --prompt "def main("
      sample text from the exported model
  swarm-export --join my-swarm.json --format hf my-model/
      a Hugging Face folder (config.json, model.safetensors, tokenizer): then in Python
      AutoModelForCausalLM.from_pretrained("my-model") and AutoTokenizer.from_pretrained("my-model")
  swarm-export --join my-swarm.json --format hf my-model/ --dtype bfloat16
      the same at half the size
"""


# ------------------------------------------------------------------------------------------------ the CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swarm-export",
        description="Download the current parameters of every stage of a running swarm and write the whole model "
        "to one safetensors file (with the model config in its metadata).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    runtime.add_join_argument(parser)
    parser.add_argument(
        "target", nargs="?", default=None, metavar="OUT", help="where to write (the same as --out, which it replaces)"
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="PATH",
        help="the safetensors file to write (replaced whole), or with --format hf the folder (created if need be)",
    )
    parser.add_argument(
        "--format",
        default="swarm",
        choices=["swarm", "hf"],
        help="swarm: one safetensors file with Swarm's names and the model config in its metadata (for "
        "examples/generate.py); hf: a Hugging Face folder (default: swarm)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=list(DTYPES),
        help="--format hf: the dtype of the weights written (training keeps float32 weights; default: float32)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"give up after this many seconds in all (default: {DEFAULT_TIMEOUT:.0f})",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=DISCOVERY_WAIT,
        metavar="SECONDS",
        help="wait up to this long for every stage to have an online peer, then give up "
        f"(default: {DISCOVERY_WAIT:.0f})",
    )
    parser.add_argument(
        "--host-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="multiaddrs to listen on (default: loopback only, /ip4/127.0.0.1/tcp/0: the export only dials out)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON document, no progress")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    args = parser.parse_args(argv)
    if (args.target is None) == (args.out is None):
        parser.error("give where to write once: as OUT or as --out PATH")
    args.out = args.out or args.target
    if args.dtype != "float32" and args.format != "hf":
        parser.error("--dtype is for --format hf (Swarm's own format keeps float32)")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        parser.error("--timeout must be a positive number of seconds")
    if not (math.isfinite(args.wait) and args.wait >= 0):
        parser.error("--wait must be a number of seconds, at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.setup_logging(args.log_level)
    # hivemind's own warnings (with tracebacks) would bury the one paragraph that says what went wrong
    logging.getLogger("hivemind").setLevel(logging.getLogger().level if args.log_level in ("DEBUG", "INFO") else 100)
    started = time.monotonic()
    deadline = started + args.timeout
    out = Path(args.out)
    dht: DHT | None = None
    try:
        manifest = joining.read_join(args.join)  # None: --join names a peer, which hands out the manifest
        check_output_folder(out) if args.format == "hf" else check_output_path(out)
        if not joining.bootstrap_peers(args.join, manifest):
            raise ExportError(
                f"manifest {args.join} lists no initial peers, so there is no running swarm to export from; put the "
                "address a running peer printed (/ip4/.../tcp/.../p2p/...) into its initial_peers"
            )
        # The DHT forks its own process: start it before any thread exists (rich's progress runs one).
        dht = node.start_dht(
            joining.bootstrap_peers(args.join, manifest),
            args.host_maddrs or node.LOOPBACK,
            client_mode=True,
            startup_timeout=max(1.0, min(60.0, remaining(deadline))),
            secret=manifest.secret if manifest is not None else None,
        )
        manifest, tensors, sources, tokenizer = _run_with_progress(dht, manifest, deadline, args, quiet=args.json)
        metadata = export_metadata(manifest, sources)
        if args.format == "hf":
            size = write_hf_folder(out, manifest, tensors, metadata, *_tokenizer_files(tokenizer), dtype=args.dtype)
        else:
            size = write_safetensors(out, tensors, metadata)
    except KeyboardInterrupt:
        print("swarm-export: interrupted; nothing was written", file=sys.stderr)
        return 130
    except SwarmError as e:
        print(f"swarm-export: error: {one_line(str(e))}", file=sys.stderr)
        return 1
    except Exception as e:  # never a traceback for the user; --log-level DEBUG shows it
        logger.debug("unexpected failure", exc_info=True)
        print(
            f"swarm-export: error: unexpected failure ({short_error(e)}); nothing was written. Run again with "
            "--log-level DEBUG to see where it happened.",
            file=sys.stderr,
        )
        return 1
    finally:
        if dht is not None:
            dht.shutdown()
    print_summary(manifest, sources, tensors, out, size, time.monotonic() - started, args.json)
    return 0


def _tokenizer_files(tokenizer: Tokenizer | None) -> tuple[str | None, dict[str, str | None]]:
    """(tokenizer.json's text, or None for the byte vocabulary; its special tokens) for the Hugging Face folder."""
    if tokenizer is None or tokenizer.is_bytes:
        return None, {}
    hf = tokenizer.hf
    names = {"eos_token": tokenizer.eos_id, "bos_token": tokenizer.bos_id}
    return tokenizer.json_text, {key: hf.id_to_token(i) if i is not None else None for key, i in names.items()}


def _run_with_progress(
    dht: DHT, manifest: Manifest | None, deadline: float, args: argparse.Namespace, quiet: bool
) -> tuple[Manifest, dict[str, torch.Tensor], list[StageSource], Tokenizer | None]:
    progress = Progress(
        SpinnerColumn(finished_text="[green]✓[/green]"),
        TextColumn("{task.description}"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=quiet,
        transient=True,  # the summary (or the error) replaces it
    )
    rows = {}

    def add_rows(manifest: Manifest) -> None:
        for stage in range(manifest.num_stages):
            start, end = manifest.stages[stage]
            rows[stage] = progress.add_task(f"stage {stage} (layers {start}..{end - 1})", total=1, status="")

    def on_status(stage: int, status: str, done: bool) -> None:
        progress.update(rows[stage], status=status, completed=1 if done else 0)

    async def run() -> tuple[Manifest, dict[str, torch.Tensor], list[StageSource], Tokenizer | None]:
        # every step of export_swarm is bounded by the deadline; this is a safety net
        return await asyncio.wait_for(
            export_swarm(
                dht,
                manifest,
                deadline,
                on_status,
                args.wait,
                join=args.join,
                on_manifest=add_rows,
                with_tokenizer=args.format == "hf",
            ),
            remaining(deadline) + 10,
        )

    with progress:
        try:
            return asyncio.run(run())
        except TimeoutError:
            raise ExportError(
                f"the export did not finish within --timeout {args.timeout:g} s; allow more time with --timeout"
            ) from None


def print_summary(
    manifest: Manifest,
    sources: list[StageSource],
    tensors: dict[str, torch.Tensor],
    out: Path,
    size: int,
    seconds: float,
    as_json: bool,
) -> None:
    parameters = sum(t.numel() for t in tensors.values())
    if as_json:
        document = {
            "file": str(out),
            "bytes": size,
            "parameters": parameters,
            "tensors": len(tensors),
            "swarm_id": manifest.swarm_id,
            "swarm_name": manifest.name,
            "seconds": round(seconds, 2),
            "stages": [dataclasses.asdict(s) | {"seconds": round(s.seconds, 2)} for s in sources],
        }
        print(json.dumps(document), flush=True)
        return
    console = Console()
    table = Table(title=f"swarm {manifest.name!r} (id {manifest.swarm_id})")
    table.add_column("stage", justify="right")
    table.add_column("layers")
    table.add_column("peer", overflow="fold")  # peer ids differ at the end: never cut them short
    table.add_column("optimizer steps", justify="right")
    table.add_column("parameters", justify="right")
    for s in sources:
        table.add_row(
            str(s.stage), f"{s.layers[0]}..{s.layers[1] - 1}", s.peer_id, str(s.optimizer_steps), f"{s.parameters:,}"
        )
    console.print(table)
    console.print(
        f"wrote {out}: {parameters:,} parameters in {len(tensors)} tensors from {len(sources)} stages, "
        f"{size / 1e6:.1f} MB, in {seconds:.1f} s",
        soft_wrap=True,  # a path cut in two cannot be copied
    )


if __name__ == "__main__":
    sys.exit(main())
