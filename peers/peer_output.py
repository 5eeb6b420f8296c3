"""What swarm-peer prints while it runs: its status line (every --status-every seconds) and a line for each event
the peer reports (swarm/events.py); with --json, one JSON object per line that scripts, tests and benchmarks read."""

from __future__ import annotations

import json
import os

from swarm.dataset.stream import describe_reading
from swarm.events import Event, EventKind
from swarm.watch.stats import PeerSnapshot

SPAN_STAGE_FIELDS = ("stage", "samples_served", "optimizer_steps", "averaging_rounds", "averaging_rounds_failed")


def print_progress(snapshot: PeerSnapshot, as_json: bool, refused_records: int = 0) -> None:
    """The status line: one JSON object with --json, else a sentence."""
    stats, trainer_stats = snapshot.stage, snapshot.trainer  # no stage: a --trainer-only peer
    if as_json:
        status = {**stats.to_dict(), "moves": snapshot.moves} if stats is not None else {"stage": None}
        status["span"] = list(snapshot.span) if snapshot.span is not None else None
        if len(snapshot.stages) > 1:  # what each stage of a span did (the fields above are its first stage's)
            status["span_stages"] = [
                {key: each.to_dict()[key] for key in SPAN_STAGE_FIELDS} for each in snapshot.stages
            ]
        if trainer_stats is not None:
            status.update(trainer_stats.to_dict())
        status["refused_records"] = refused_records
        if snapshot.data is not None:
            status["data"] = snapshot.data
        print(json.dumps(status), flush=True)
        return
    if stats is None:
        line = "training only"
    else:
        start, end = snapshot.span or (stats.stage, stats.stage + 1)
        stages = f"stage {start}" if end - start == 1 else f"stages {start}-{end - 1}"
        line = f"{stages}: served {stats.samples_served} samples, {stats.optimizer_steps} optimizer steps"
    if snapshot.moves:
        line += f" ({snapshot.moves} moves)"
    if stats is not None and (stats.averaging_rounds or stats.averaging_rounds_failed):
        line += f", averaged {stats.averaging_rounds} rounds"
        if stats.averaging_rounds_failed:
            line += f" ({stats.averaging_rounds_failed} skipped)"
    if stats is not None and stats.averaging_exclusions:
        line += f", excluded {stats.averaging_exclusions} partners for far-off values"
    if refused_records:
        line += f", refused {refused_records} unsigned or forged records"
    if trainer_stats is not None:
        loss = trainer_stats.loss
        shown_loss = f"{loss:.3f}" if loss == loss else "-"  # NaN until the first microbatch completes
        line += (
            f" | trainer: loss {shown_loss}, {trainer_stats.samples_per_second:.1f} samples/s, "
            f"{trainer_stats.samples} samples"
        )
        if trainer_stats.failed_microbatches:
            line += f", {trainer_stats.failed_microbatches} microbatches dropped"
        if trainer_stats.unserved_stages:
            waiting = ", ".join(map(str, trainer_stats.unserved_stages))
            line += f" | waiting for a peer to serve stage {waiting}"
    if snapshot.data is not None:
        line += f" | data: {describe_reading(snapshot.data)}"
    print(line, flush=True)


def print_event(event: Event, as_json: bool) -> None:
    """An event the moment it happens: one JSON line with --json (benchmarks and tests read these), else a
    sentence."""
    if as_json:
        print(json.dumps(event.to_dict()), flush=True)
        return
    f = event.fields
    if event.kind == EventKind.MOVED:
        text = f"moved from stage {f['from_stage']} to stage {f['to_stage']}"
    elif event.kind == EventKind.STATE_TAKEN:
        origin = {
            "peer": f"from peer {f['peer_id'][-8:]}",
            "checkpoint": f"from peer {f['peer_id'][-8:]}'s checkpoint"
            if f["peer_id"]
            else "from this peer's checkpoint",
            "pretrained": "from the pretrained model",
            "own": "it kept while paused (the stage went no further)",
        }
        text = (
            f"took the state of stage {f['stage']} {origin.get(f['source'], 'afresh (nobody had it)')}: "
            f"{f['optimizer_steps']} optimizer steps, averaging round {f['averaging_round']}"
        )
        if f.get("steps_behind"):
            text += f" ({f['steps_behind']} steps behind the stage's last announced state)"
    elif event.kind == EventKind.PAUSING:
        text = (
            f"pausing ({f['reason']}): finishing {f['in_flight']} requests in flight at stages {f['stages']}"
            f" and {f['trainer_in_flight']} of this peer's own microbatches, then freeing the device"
        )
    elif event.kind == EventKind.PAUSED:
        text = (
            f"paused: stages {f['stages']} drained and parked in RAM; the pause took {f['seconds']} s in all, "
            f"{f['device_bytes_freed'] / 2**20:.0f} MiB of device memory freed; resume with: kill -USR2 {os.getpid()}"
        )
    elif event.kind == EventKind.RESUMED:
        text = f"resumed: serving again after {f['seconds']} s (state: {', '.join(f['sources']) or 'none'})"
    elif event.kind == EventKind.TRAINS_ONLY:
        why = "it computes too slowly beside the serving peers" if f["too_slow"] else "its memory holds no stage"
        text = (
            f"this CPU peer trains only: {why} ({f['reason']}). Its microbatches are computed by the serving "
            "peers. To serve anyway, pin a stage with --stage N"
        )
    elif event.kind == EventKind.LEAVING:
        text = (
            f"leaving: only this peer serves stages {f['stages']}; handing them over to the peers that take them "
            f"(waiting up to {f['start_within']:.0f} s for one to start; Ctrl-C again to stop now, leaving their "
            "training since the last checkpoint on this machine only)"
        )
    elif event.kind == EventKind.HANDED_OVER:
        text = f"handed stages {f['taken']} over in {f['seconds']} s" if f["taken"] else "handed no stage over"
        if f["left_behind"]:
            why = "you asked to stop now" if f["hurried"] else "no peer came to take them"
            text += (
                f"; stages {f['left_behind']} were not taken ({why}): their state is in this peer's checkpoints, "
                "which other peers fetch from here while it runs"
            )
    elif event.kind == EventKind.OUT_OF_MEMORY:
        shed = {"smaller_window": "kept fewer microbatches", "shorter_span": "dropping the span's last stage"}
        text = (
            f"stage {f['stage']} ran out of memory ({f['error']}); answered busy, "
            f"{shed.get(f['action'], 'nothing more to shed')}: keeps {f['kept_microbatches']} microbatches' "
            f"activations ({f['out_of_memory']} out-of-memory errors so far)"
        )
    else:
        text = f"averaging round {f['round']} of stage {f['stage']}: {f['outcome']}"
        if f["group_size"]:
            text += f" with {f['group_size']} peers, parameters moved by {f['change']:.2%}"
    print(text, flush=True)
