"""What a churn run's figures say (__main__.py): where each restarted peer took its stage's state from and
whether it lost progress, the warnings in the peers' logs, the faults that fired, and the summary with its goals.
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.churn.peers import CHECKPOINT_EVERY, Settings, down_at, log_text
from benchmarks.churn.swarm import Event, Swarm
from swarm.local.processes import PeerProcess
from swarm.manifests.manifest import Manifest

STALL_MARGIN = 5.0  # the stall goal: the larger timeout plus this
LOSS_TOLERANCE = 0.05  # the loss goal: within 5% of the clean run

SOURCES = {"peer": "peer", "checkpoint": "checkpoint", "fresh": "afresh"}  # a state_taken event's, as reported


def restart_source(run: PeerProcess) -> tuple[str | None, int | None, float | None, float]:
    """How a start took its stage's state, from its first state_taken event (swarm/events.py): (peer, checkpoint
    or afresh; the optimizer steps loaded; the Unix time it had the state; seconds the download from a peer took
    before then). All None (and 0) if it printed no such event."""
    taken = run.events("state_taken")
    if not taken:
        return None, None, None, 0.0
    event = taken[0]
    source = SOURCES.get(event["source"], event["source"])
    download = float(event.get("seconds", 0.0)) if source == "peer" else 0.0
    return source, int(event["optimizer_steps"]), float(event["at"]), download


def allowance(swarm: Swarm, stage: int) -> int:
    """The optimizer steps that one peer of the stage made at most within a checkpoint interval plus two announce
    periods: how far its checkpoint may trail its last announcement before a kill."""
    window = CHECKPOINT_EVERY + 2 * swarm.manifest.network.announce_period
    steps = 0
    for peer in (p for p in swarm.peers if p.stage == stage):
        series = [(t, a) for t, a in swarm.history if a.peer_id == peer.peer_id]
        cuts = [x for x, _ in peer.downtimes]  # a restart sets the counters to another state's: no window across
        for i, (t0, a0) in enumerate(series):
            for t1, a1 in series[i + 1 :]:
                if t1 - t0 > window:
                    break
                if not any(t0 <= c <= t1 for c in cuts):
                    steps = max(steps, a1.optimizer_steps - a0.optimizer_steps)
    return steps


def progress_lost(swarm: Swarm, events: list[Event]) -> dict:
    """Per stage: every restart's source and loaded state against the best it could have had (see the docstring):
    the most advanced replica serving when it chose (as last read before then), else its own last announcement."""
    result = {}
    trained = {p.stage: 0 for p in swarm.peers}
    for _, ann in swarm.history:
        trained[ann.stage] = max(trained[ann.stage], ann.optimizer_steps)
    for stage in range(swarm.settings.stages):
        steps_allowed = allowance(swarm, stage)
        drops_steps, drops_rounds, sources, afresh = [0], [0], [], 0
        for event in events:
            for record in event.records:
                if record["stage"] != stage or "killed_at_s" not in record:
                    continue
                if not record.get("start"):  # not restarted (training over), or it did not serve again
                    sources.append("did not serve" if "restarted_at_s" in record else "not restarted")
                    continue
                peer = next(p for p in swarm.peers if p.name == record["peer"])
                source, steps, taken_at, download = restart_source(peer.runs[record["start"] - 1])
                sources.append(source)
                record["source"], record["loaded_steps"] = source, steps
                if source == "afresh" and trained[stage] > 0:
                    afresh += 1
                if steps is None or taken_at is None:
                    continue
                served_at = swarm.began + record["serving_again_at_s"]
                # when it chose where to take the state from: a replica's announcements read before then are older
                # than the state it could have taken
                chose_at = taken_at - swarm.wall_offset - download
                replicas = [
                    swarm.latest(q, chose_at)
                    for q in swarm.peers
                    if q.stage == stage and q is not peer and q.starts and not down_at(q, chose_at)
                ]
                best_live = max(
                    ((a.averaging_round, a.optimizer_steps) for a in replicas if a is not None), default=None
                )
                record["best_live_replica"] = best_live
                # the averaging round it loaded: its first announcement after it served again
                after = [(t, a) for t, a in swarm.history if a.peer_id == peer.peer_id and t >= served_at]
                loaded = (after[0][1].averaging_round if after else 0, steps)
                # trainers route to it again: the first time it announces more samples served than at first
                worked = [t for t, a in after if a.samples_served > after[0][1].samples_served]
                record["first_work_after_s"] = round(worked[0] - served_at, 1) if worked else None
                best = best_live or record["before"]
                if best is None or loaded >= tuple(best):
                    continue
                drops_rounds.append(max(0, best[0] - loaded[0]))
                drops_steps.append(max(0, best[1] - loaded[1]))
                record["behind"] = {"rounds": drops_rounds[-1], "steps": drops_steps[-1]}
        lost = afresh > 0 or max(drops_steps) > steps_allowed
        result[str(stage)] = {
            "lost": lost,
            "restarts": len(sources),
            "sources": {s or "unknown": sources.count(s) for s in sorted(set(sources), key=str)},
            "afresh_after_training": afresh,
            "largest_drop_steps": max(drops_steps),
            "allowance_steps": steps_allowed,
            "largest_drop_rounds": max(drops_rounds),  # for information: a catch-up renumbers rounds
        }
    return result


def peer_warnings(swarm: Swarm) -> dict[str, int]:
    """Warnings, errors and tracebacks in the peers' logs, by message (numbers and ids blanked), most frequent first."""
    counts: dict[str, int] = {}
    for peer in swarm.peers:
        for start in range(1, peer.starts + 1):
            for line in log_text(peer, start).splitlines():
                if not re.search(r" (WARNING|ERROR|CRITICAL) |^Traceback|\[(WARN|ERROR)\]", line):
                    continue
                key = re.sub(r"\b(Qm|12D3)\w+|\b[0-9a-f]{8,}\b", "<id>", line)
                key = re.sub(r"\d+(\.\d+)?", "N", key.split(" ", 1)[-1])[:160]
                counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def fault_counts(events: list[dict]) -> dict:
    fired = [e for e in events if e["fired_at_s"] is not None]
    return {
        "planned": len(events),
        "fired": len(fired),
        "kill": sum(e["kind"] == "kill" for e in fired),
        "stop": sum(e["kind"] == "stop" for e in fired),
        "double_kill": sum(e["kind"] == "double_kill" for e in fired),
        "bootstrap_kills": sum(e.get("bootstrap", False) for e in fired),
    }


def summarize(settings: Settings, manifest: Manifest, runs: dict[str, dict], logs: Path) -> dict:
    timeouts = manifest.training.timeouts
    stall_limit = max(timeouts.forward, timeouts.backward) + STALL_MARGIN
    summary: dict = {
        "settings": {
            "stages": settings.stages,
            "replicas": settings.replicas,
            "trainers": settings.trainers,
            "max_in_flight": manifest.training.max_in_flight,
            "samples": settings.samples,
            "after_faults_s": settings.after_faults,
            "seed": settings.seed,
            "checkpoint_every_s": CHECKPOINT_EVERY,
            "forward_timeout_s": timeouts.forward,
            "backward_timeout_s": timeouts.backward,
            "averaging_every_samples": manifest.averaging.every_samples,
            "stall_limit_s": stall_limit,
        },
    }
    faults = runs.get("faults")
    if faults is not None:
        summary["faults_injected"] = fault_counts(faults["events"])
    summary.update(runs)
    goals = {}
    if faults is not None:
        goals["stall"] = faults["longest_stall_outside_outages_s"] <= stall_limit
        goals["progress"] = not any(s["lost"] for s in faults["progress_lost"].values())
    if faults is not None and "clean" in runs:
        difference = (faults["heldout_loss"] - runs["clean"]["heldout_loss"]) / runs["clean"]["heldout_loss"]
        summary["heldout_loss_relative_difference"] = round(difference, 4)
        goals["loss"] = abs(difference) <= LOSS_TOLERANCE
    summary["goals_met"] = goals
    summary["logs"] = str(logs)
    return summary
