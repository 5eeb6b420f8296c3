"""swarm-data: prepare a corpus into token chunks (optionally training a tokenizer on it first), or inspect a
prepared folder. The preparation itself is swarm/dataset/corpus.py's; the reading, swarm/dataset/shards.py's."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from peers import runtime
from swarm import __version__
from swarm.dataset.corpus import DEFAULT_CHUNK_TOKENS, INDEX_FILE, prepare_corpus
from swarm.dataset.documents import training_texts
from swarm.dataset.shards import TokenShards
from swarm.dataset.tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    byte_tokenizer,
    file_sha256,
    load_tokenizer,
    train_tokenizer,
)
from swarm.errors import DataError, SwarmError

logger = logging.getLogger("swarm-data")

TOKENIZER_SAMPLE_BYTES = 100_000_000  # a tokenizer is trained on at most about this much of the train text

EXAMPLES = """\
examples:
  swarm-data prepare stdlib --out data/stdlib
      Python's standard library as byte tokens (vocabulary 256, no tokenizer file)
  swarm-data prepare /data/books --out data/books --train-tokenizer 32000
      train a 32,000-id byte-level BPE on the folder's train documents (saved as data/books/tokenizer.json),
      then tokenize the folder's text, .jsonl and .parquet files with it
  swarm-data prepare corpus.jsonl --out data/web --tokenizer tokenizer.json --text-key content
      JSON lines with their text under "content", tokenized with an existing Hugging Face tokenizer.json
  swarm-data prepare /data/books --out data/books --chunk-tokens 1000000 --heldout-fraction 0.01 --json
      smaller chunks, 1% held out, and the summary as one JSON object
  swarm-data prepare https://example.org/web/part-0.jsonl,https://example.org/web/part-1.jsonl --out web
      --tokenizer tokenizer.json: JSON lines streamed from the web (hf://datasets/USER/REPO/FOLDER lists a Hub folder's files)
  swarm-data inspect data/books
      the prepared folder: chunks, tokens, the tokenizer's hash and the index's hash (the data's name)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swarm-data",
        description="Prepare training data: tokenize a corpus once into token chunks that trainers read "
        "memory-mapped, or inspect a prepared folder.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prepare = commands.add_parser(
        "prepare",
        help="tokenize a corpus into token chunks",
        description="Tokenize SOURCE into DIR: chunk-*.bin (train), heldout-*.bin and index.json; publish DIR anywhere static files are served (a web server, a bucket, a Hugging Face dataset) and give its URL to swarm-init --data.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prepare.add_argument(
        "source",
        metavar="SOURCE",
        help="'stdlib', a text file, a .jsonl or .parquet file, a folder of them, or URLs of .jsonl/.parquet files "
        "(http(s), hf://datasets/..., s3://...; comma-separated; streamed, never whole in memory)",
    )
    prepare.add_argument("--out", required=True, metavar="DIR", help="the folder to write (its files are replaced)")
    which = prepare.add_mutually_exclusive_group()
    which.add_argument("--tokenizer", metavar="FILE", help="a Hugging Face tokenizer.json (default: byte tokens)")
    which.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="SIZE",
        help="train a byte-level BPE of SIZE ids on SOURCE's train documents first, saved as DIR/tokenizer.json",
    )
    prepare.add_argument(
        "--chunk-tokens",
        type=int,
        default=DEFAULT_CHUNK_TOKENS,
        metavar="N",
        help=f"tokens per chunk, the unit volunteers download and verify (default: {DEFAULT_CHUNK_TOKENS:,}: 8 MiB "
        "of 16-bit tokens, under 2 s at 50 Mbit/s); many more chunks than trainers is best",
    )
    prepare.add_argument(
        "--heldout-fraction", type=float, default=0.05, metavar="F", help="the held-out part (default: 0.05)"
    )
    prepare.add_argument(
        "--text-key", default="text", metavar="KEY", help="the text's key or column in .jsonl/.parquet (default: text)"
    )
    prepare.add_argument("--json", action="store_true", help="print the summary as one JSON object, no progress")

    inspect = commands.add_parser("inspect", help="show a prepared folder", description="Show a prepared folder.")
    inspect.add_argument("dir", metavar="DIR", help="a folder written by swarm-data prepare (or its index.json)")
    inspect.add_argument("--verify", action="store_true", help="also check every file's SHA-256 (reads them all)")
    inspect.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        if args.chunk_tokens < 1:
            parser.error("--chunk-tokens must be at least 1")
        if not 0 < args.heldout_fraction < 1:
            parser.error("--heldout-fraction must be between 0 and 1 (e.g. 0.05)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.setup_logging(args.log_level)
    started = time.monotonic()
    try:
        if args.command == "prepare":
            summary = prepare(args)
        else:
            summary = summarize(TokenShards.open(args.dir, verify=args.verify))
    except KeyboardInterrupt:
        print("swarm-data: interrupted", file=sys.stderr)
        return 130
    except SwarmError as e:
        print(f"swarm-data: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder that cannot be written, a full disk: no traceback for those either
        logger.debug("failed", exc_info=True)
        where = f" {e.filename}" if e.filename else ""
        print(f"swarm-data: error: cannot read or write{where}: {e.strerror or e}", file=sys.stderr)
        return 2
    if args.command == "prepare":
        summary["seconds"] = round(time.monotonic() - started, 2)
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print_summary(summary)
    return 0


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a folder: give a folder to write the chunks into")
    console = Console(stderr=True)
    progress = Progress(
        SpinnerColumn(finished_text="[green]✓[/green]"),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=args.json or not console.is_terminal,  # no bar in a log file
        transient=True,  # the summary (or the error) replaces it
    )
    with progress:
        tokenizer = _tokenizer(args, out, progress)
        task = progress.add_task(f"tokenizing {args.source}", total=None)
        index = prepare_corpus(
            args.source,
            out,
            tokenizer,
            chunk_tokens=args.chunk_tokens,
            heldout_fraction=args.heldout_fraction,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total),
            text_key=args.text_key,
        )
    return summarize(TokenShards.open(index))


def _tokenizer(args: argparse.Namespace, out: Path, progress: Progress) -> Tokenizer:
    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if args.train_tokenizer is None:
        return byte_tokenizer()
    task = progress.add_task(f"training a tokenizer of {args.train_tokenizer:,} ids", total=None)
    texts = training_texts(args.source, args.heldout_fraction, args.text_key, TOKENIZER_SAMPLE_BYTES, exclude=out)
    tokenizer = train_tokenizer(texts, args.train_tokenizer)
    tokenizer.save(out)
    progress.update(task, total=1, completed=1)
    return tokenizer


def summarize(data: TokenShards) -> dict[str, Any]:
    index = data.index
    raw = json.loads(index.raw)
    tokenizer_file = data.folder / TOKENIZER_FILE
    return {
        "index": str(data.folder / INDEX_FILE),
        "index_sha256": data.sha256,
        "source": index.source,
        "chunks": len(index.chunks),
        "chunk_tokens": index.chunk_tokens,
        "train_tokens": data.total_train_tokens,
        "train_bytes": index.train_bytes,
        "heldout_tokens": len(data.heldout),
        "heldout_bytes": data.heldout_bytes,
        "documents": index.documents,
        "skipped": index.skipped,
        "vocab_size": data.vocab_size,
        "dtype": raw["dtype"],
        "tokenizer_sha256": data.tokenizer_sha256,
        "tokenizer_file": str(tokenizer_file) if tokenizer_file.is_file() else "",
        "chunk_files": [{"file": c.file, "tokens": c.tokens, "sha256": c.sha256} for c in index.chunks],
    }


def print_summary(summary: dict[str, Any]) -> None:
    console = Console()
    table = Table(title=f"prepared data {escape(summary['index'])}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("", overflow="fold")  # hashes: never cut short
    tokenizer = summary["tokenizer_sha256"] or "bytes (ids 0..255, no file)"
    if summary["tokenizer_file"]:
        matches = file_sha256(summary["tokenizer_file"]) == summary["tokenizer_sha256"]
        tokenizer += f"\n{escape(summary['tokenizer_file'])}" + ("" if matches else " [red](a different file!)[/red]")
    rows = [
        ("source", escape(str(summary["source"]))),
        ("documents", f"{summary['documents']:,} ({summary['skipped']:,} skipped)"),
        (
            "train",
            f"{summary['train_tokens']:,} tokens in {summary['chunks']:,} chunks of up to {summary['chunk_tokens']:,}",
        ),
        ("held out", f"{summary['heldout_tokens']:,} tokens ({summary['heldout_bytes']:,} bytes of text)"),
        ("vocabulary", f"{summary['vocab_size']:,} ids, stored as {summary['dtype']}"),
        ("tokenizer sha256", tokenizer),
        ("index sha256", summary["index_sha256"]),
    ]
    if "seconds" in summary:
        rows.append(("time", f"{summary['seconds']:.1f} s"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
