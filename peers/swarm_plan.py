"""swarm-plan: what a swarm would do on the machines its creator expects, before anyone starts (swarm/capacity/)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from swarm import __version__
from swarm.capacity.budget import format_memory
from swarm.capacity.costs import KEPT_MICROBATCHES, MemorySettings
from swarm.capacity.plan import MFU, SwarmPlan, parse_expect, plan_swarm
from swarm.errors import SwarmError
from swarm.manifests.loading import load_manifest
from swarm.manifests.manifest import Manifest
from swarm.manifests.presets import PRESETS, new_manifest

EXAMPLES = """\
examples:
  swarm-plan --preset llama-1b --stages 22 --spans --expect 10x24GB@165TF/200mbit,20x8GB@40TF/50mbit
      the 1.1B Llama with one block a stage, served in spans, on ten 24 GB cards and twenty 8 GB ones: the spans
      each would serve, the memory each peer uses, the swarm's tokens/s and what limits it, beside fixed stages
  swarm-plan --join my-swarm.json --expect 30x12GB@50TF/40mbit --kept-microbatches 4
      a manifest you wrote (a path or a URL), on 12 GB cards whose peers keep 4 microbatches' activations
  swarm-plan --join my-swarm.json --expect 4x16GB@1TF/100mbit --cpu
      the same on CPU machines with 16 GB of RAM free (float32, as CPU peers compute)
  swarm-plan --preset llama-1b --stages 22 --spans --expect 20x8GB@40TF/50mbit --offload-optimizer
      the same 8 GB cards with AdamW's statistics in RAM: more blocks each
  swarm-plan --preset llama-1b --expect 8GB@40TF/50mbit --json
      the plan as JSON: per kind of machine its blocks and memory_bytes; tokens_per_second and bottleneck

machines are COUNTxMEMORY@FLOPS/UPLINK: MEMORY free on the GPU (24GB, 7.5GiB), FLOPS its dense 16-bit rate
(an RTX 4090 is ~165TF, a 3060 ~50TF, a 4060 laptop ~45TF), UPLINK the home link's upload (kbit, mbit, gbit).
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="swarm-plan",
        description="Plan a swarm on the machines you expect: spans, memory per peer, tokens/s and the bottleneck. "
        "Nothing is started.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--join", metavar="MANIFEST", help="a swarm's manifest: a path or an https URL")
    source.add_argument("--preset", choices=list(PRESETS), help="a new swarm from a preset (see swarm-init)")
    parser.add_argument("--stages", type=int, default=None, help="with --preset: stages (default: the preset's)")
    parser.add_argument(
        "--spans", action="store_true", help="with --preset: peers serve spans of stages (balancing.spans)"
    )
    parser.add_argument("--expect", required=True, metavar="MACHINES", help="the machines, e.g. 10x24GB@165TF/200mbit")
    parser.add_argument(
        "--kept-microbatches",
        type=int,
        default=KEPT_MICROBATCHES,
        metavar="K",
        help=f"microbatches whose activations a peer keeps for backward (default {KEPT_MICROBATCHES})",
    )
    parser.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="the peers run with --offload-optimizer: AdamW's statistics in RAM, more blocks on each GPU",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="the machines are CPUs: MEMORY is their RAM, weights and activations float32 (as a CPU peer computes)",
    )
    parser.add_argument("--mfu", type=float, default=MFU, help=f"share of the FLOP rate a stage reaches ({MFU})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--version", action="version", version=f"swarm {__version__}")
    args = parser.parse_args(argv)
    if (args.stages is not None or args.spans) and args.preset is None:
        parser.error("--stages and --spans go with --preset (a manifest has its own)")
    if not 1 <= args.kept_microbatches <= 4096:
        parser.error("--kept-microbatches must be between 1 and 4096")
    if not 0.01 <= args.mfu <= 1.0:
        parser.error("--mfu must be between 0.01 and 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.join:
            manifest = load_manifest(args.join)
        else:
            spans = {"spans": True} if args.spans else None
            manifest = new_manifest("plan", args.preset, stages=args.stages, balancing=spans)
        memory = MemorySettings(args.offload_optimizer and not args.cpu, args.kept_microbatches, cuda=not args.cpu)
        plans = make_plans(manifest, args.expect, memory, args.mfu)
    except SwarmError as e:
        print(f"swarm-plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plans_as_dict(*plans)))
    else:
        print_plans(*plans, cpu=args.cpu)
    return 0


def make_plans(
    manifest: Manifest, expect: str, settings: MemorySettings = MemorySettings(), mfu: float = MFU
) -> tuple[SwarmPlan, SwarmPlan]:
    """What the swarm's peers would do (spans if its manifest says so, else one stage each), and the other way to
    compare: (spans, fixed stages)."""
    kinds = parse_expect(expect)
    return (
        plan_swarm(manifest, kinds, settings, spans=True, mfu=mfu),
        plan_swarm(manifest, kinds, settings, spans=False, mfu=mfu),
    )


def plans_as_dict(spans: SwarmPlan, fixed: SwarmPlan) -> dict[str, Any]:
    """The plan of what the peers would do at the top; the other way under `compare`."""
    ours, other = (spans, fixed) if spans.manifest.balancing.spans else (fixed, spans)
    other_dict = other.to_dict()
    return {
        "swarm": ours.manifest.name,
        "swarm_id": ours.manifest.swarm_id,
        **ours.to_dict(),
        "compare": {
            key: other_dict[key] for key in ("mode", "tokens_per_second", "bottleneck", "participation", "kinds")
        },
    }


def print_plans(spans: SwarmPlan, fixed: SwarmPlan, cpu: bool = False) -> None:
    console = Console()
    manifest = spans.manifest
    console.print(
        f"[bold]{escape(manifest.name)}[/bold]: {manifest.model.architecture}, {manifest.model.depth} blocks in "
        f"{manifest.num_stages} stages, {manifest.training.precision}"
        + (", activation checkpointing" if manifest.training.activation_checkpointing else "")
    )
    table = Table(title="each kind of machine, with spans (and with fixed stages)")
    memory = ("RAM", "RAM besides") if cpu else ("GPU memory", "RAM")  # a CPU peer's everything is in RAM
    for column in ("machines", "blocks", *memory, "samples/s", "stages served", "fixed stages"):
        table.add_column(column)
    for span_kind, fixed_kind in zip(spans.kinds, fixed.kinds):
        served = ", ".join(f"{s}-{e - 1}" if e - s > 1 else str(s) for s, e in sorted(set(span_kind.spans)))
        serving = span_kind.serving > 0
        table.add_row(
            escape(span_kind.kind.name),
            str(span_kind.blocks) if serving else "[red]none fit[/red]",
            format_memory(span_kind.memory_bytes) if serving else "-",
            format_memory(span_kind.host_bytes) if serving else "-",
            f"{span_kind.samples_per_second:.2f} ({span_kind.bound})" if serving else "trainer only",
            served or "-",
            f"{fixed_kind.blocks} block{'s' if fixed_kind.blocks != 1 else ''}"
            if fixed_kind.serving
            else "[red]none fit[/red]",
        )
    console.print(table)
    for plan in (spans, fixed):
        ours = (plan.mode == "spans") == manifest.balancing.spans
        console.print(
            f"{plan.mode}{' (this swarm)' if ours else ''}: [bold]{plan.tokens_per_second:,.0f} tokens/s[/bold], "
            f"{plan.participation:.0%} of the machines serve; bottleneck: {escape(plan.bottleneck())}"
        )
    if not manifest.balancing.spans:
        console.print(
            "[dim]this swarm's peers serve one stage each; spans need balancing.spans (swarm-init --spans)[/dim]"
        )
    console.print(
        "[dim]estimates: compute at the given MFU, uplinks as the only links, no averaging traffic "
        "(docs/BALANCING.md, 'Spans and memory')[/dim]"
    )


if __name__ == "__main__":
    sys.exit(main())
