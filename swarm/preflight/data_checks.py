"""The preflight's verdicts on the swarm's training data (docs/DATA.md): its index reachable from a published
location and matching the manifest's pin (`data_index`), its first train chunk fetched and verified, with the rate
it came at (`data_chunk`), and room on disk for the data cache under --data-cache (`data_disk`). Pure functions of
what swarm/preflight/data_probes.py found; the result type is swarm/preflight/checks.py's.

A failure blocks joining (exit 2): a peer that trains gets its data's index and first chunk before it takes over a
stage, and stops if it cannot (swarm/peer/peer.py); every remedy says that --no-trainer serves without the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.capacity.budget import format_memory
from swarm.dataset.index import Chunk, DataIndex
from swarm.preflight.checks import Check, Status, skipped
from swarm.preflight.swarm_checks import MIN_DOWNLOAD_MBITS

NAMES = ("data_index", "data_chunk", "data_disk")
PEERS_TOO = "a trainer also asks the swarm's peers that hold the data, so it may start while one of them is online"
NO_TRAINER = "or run with --no-trainer to serve a stage without training"


@dataclass
class DataFindings:
    """What swarm/preflight/data_probes.py found out about the data a trainer of this machine would read."""

    source: str  # the manifest's data.source, or --data
    pinned: bool  # the manifest pins a prepared folder by its index's SHA-256 (else: data on this machine)
    raw: bool = False  # raw text on this machine: tokenized at the trainer's start, nothing to fetch
    error: str = ""  # why there is nothing to check (no such source, the index does not fit the swarm)
    answers: list[tuple[str, str]] = field(default_factory=list)  # (where the index was read, error; "": served)
    index: DataIndex | None = None
    chunk_from: str = ""  # the location that gave the chunk; "" if none did
    chunk_errors: list[str] = field(default_factory=list)  # the locations that failed, in the order tried
    chunk_bytes: int = 0  # bytes downloaded
    in_place: bool = False  # the chunk was read in place from a folder on this machine (nothing downloaded)
    chunk_seconds: float = 0.0  # from the request to the verified chunk (or to the deadline)
    timed_out: bool = False  # the deadline passed during the download
    cache_folder: str = ""  # where the data cache lives ($SWARM_CACHE_DIR/chunks)
    cache_free: int = 0  # free bytes of its file system
    cache_held: int = 0  # bytes of verified files it holds already (room: they are evicted to make it)
    cap: int = 0  # --data-cache, bytes

    @property
    def chunk(self) -> Chunk | None:
        return self.index.chunks[0] if self.index is not None and self.index.chunks else None


def size_said(size: int) -> str:
    return format_memory(size) if size >= 1 << 20 else f"{size / 1024:.1f} KiB"


def data_rows(found: DataFindings) -> dict[str, Check]:
    return {
        "data_index": data_index_check(found),
        "data_chunk": data_chunk_check(found),
        "data_disk": data_disk_check(found),
    }


def data_index_check(found: DataFindings) -> Check:
    figures = {"source": found.source, "pinned": found.pinned}
    if found.pinned:
        figures["locations"] = [{"location": where, "error": error or None} for where, error in found.answers]
    if found.raw and not found.error:
        return Check(
            "data_index",
            Status.PASS,
            f"the data source {found.source!r} is raw text on this machine: the trainer tokenizes it at its start",
            figures=figures,
        )
    served = [where for where, error in found.answers if not error]
    failed = [f"{error}" for _, error in found.answers if error]
    if found.error or found.index is None or not served:
        where = ", ".join(where for where, _ in found.answers) or found.source
        detail = found.error or "; ".join(failed) or f"no location of the data ({where}) answered"
        remedy = f"check that {where} is up and that this machine can reach it (curl it); {PEERS_TOO}; {NO_TRAINER}"
        if found.error or any("hash" in error or "invalid" in error for error in failed):
            remedy = f"see the message; {NO_TRAINER}"
        return Check("data_index", Status.FAIL, detail[:1200], remedy, figures=figures)
    index = found.index
    figures.update(index_sha256=index.sha256, chunks=len(index.chunks), tokens=index.train_tokens)
    what = (
        f"{len(index.chunks)} train chunks of up to {size_said(max(c.size for c in index.chunks))}, "
        f"{index.train_tokens:,} tokens"
        if index.chunks
        else "no train chunk"
    )
    pin = f"matches data.index_sha256 ({index.sha256[:12]}…)" if found.pinned else "prepared on this machine"
    detail = f"the data's index from {served[0]} {pin}: {what}"
    if failed:
        return Check(
            "data_index",
            Status.WARN,
            f"{detail}; but {'; '.join(failed)}"[:1200],
            "nothing to do while one location answers; tell the swarm's creator which location fails",
            figures=figures,
        )
    return Check("data_index", Status.PASS, detail, figures=figures)


def data_chunk_check(found: DataFindings) -> Check:
    if found.raw and not found.error:
        return Check(
            "data_chunk", Status.PASS, "nothing to download: the trainer tokenizes the raw text on this machine"
        )
    if found.error:
        return skipped("data_chunk", "the data cannot be used (see data_index)")
    chunk = found.chunk
    if chunk is None:
        reason = "the data's index names no train chunk" if found.index is not None else "no data index"
        return skipped("data_chunk", reason)
    said = f"{chunk.file} ({size_said(chunk.size)})"
    mbits = found.chunk_bytes * 8e-6 / found.chunk_seconds if found.chunk_seconds > 0 and not found.in_place else None
    figures = {
        "file": chunk.file,
        "bytes": found.chunk_bytes,
        "seconds": round(found.chunk_seconds, 3),
        "download_mbits": None if mbits is None else round(mbits, 1),
        "location": found.chunk_from or None,
        "errors": found.chunk_errors,
    }
    slow_remedy = (
        "a trainer reads chunks ahead, so a slow link only delays its first microbatch (by about "
        f"{chunk.size * 8e-6 / max(mbits or 0.01, 0.01):.0f} s here, a chunk's time); a faster link, or a mirror "
        "nearer this machine, helps"
    )
    if not found.chunk_from:
        if found.timed_out and found.chunk_bytes:
            return Check(
                "data_chunk",
                Status.WARN,
                f"{said}: only {found.chunk_bytes:,} of {chunk.size:,} bytes came in {found.chunk_seconds:.0f} s "
                f"({mbits:.1f} Mbit/s, under {MIN_DOWNLOAD_MBITS:g})",
                slow_remedy,
                figures=figures,
            )
        errors = "; ".join(found.chunk_errors) or "no location gave it"
        if "SHA-256" in errors:
            remedy = (
                "the published copy is not the data the manifest pins (changed or damaged since it was prepared): "
                f"tell the swarm's creator to publish the prepared folder again; {PEERS_TOO}; {NO_TRAINER}"
            )
        else:
            remedy = (
                f"check that the data's location is up and that this machine can reach it; {PEERS_TOO}; {NO_TRAINER}"
            )
        return Check(
            "data_chunk", Status.FAIL, f"{said} could not be fetched: {errors}"[:1200], remedy, figures=figures
        )
    failed = f"; but {'; '.join(found.chunk_errors)}" if found.chunk_errors else ""
    if found.in_place:
        detail = f"{said} read in place from {found.chunk_from}: SHA-256 verified{failed}"
        status = Status.WARN if failed else Status.PASS
        return Check("data_chunk", status, detail[:1200], "see the message" if failed else "", figures=figures)
    detail = f"{said} from {found.chunk_from}: SHA-256 verified, {mbits:.1f} Mbit/s ({found.chunk_seconds:.2f} s)"
    if mbits < MIN_DOWNLOAD_MBITS:
        return Check(
            "data_chunk",
            Status.WARN,
            f"{detail}: under {MIN_DOWNLOAD_MBITS:g} Mbit/s{failed}"[:1200],
            slow_remedy,
            figures=figures,
        )
    if failed:
        remedy = "nothing to do while one location serves; tell the swarm's creator which location fails"
        return Check("data_chunk", Status.WARN, (detail + failed)[:1200], remedy, figures=figures)
    return Check("data_chunk", Status.PASS, detail, figures=figures)


def data_disk_check(found: DataFindings) -> Check:
    """Fail if --data-cache or the disk cannot hold two chunks (the one read and the next: the peer refuses such a
    cap at its start), warn if the disk cannot hold the cap (the cache fills it before the cap is reached). The
    chunks the cache holds already count as room: they are evicted to make it."""
    if found.raw and not found.error:
        return Check("data_disk", Status.PASS, "no chunk cache for raw text: its token cache is in the disk row")
    if found.index is None or not found.index.chunks:
        return skipped("data_disk", "no data index, so the chunks' size is not known")
    largest = max(chunk.size for chunk in found.index.chunks)
    room, cap = found.cache_free + found.cache_held, found.cap
    figures = {
        "folder": found.cache_folder,
        "free": found.cache_free,
        "held": found.cache_held,
        "cap": cap,
        "chunk_bytes": largest,
    }
    where = f"{size_said(found.cache_free)} free at {found.cache_folder}"
    held = f" (and {size_said(found.cache_held)} of chunks cached there)" if found.cache_held else ""
    two = f"two chunks ({size_said(2 * largest)})"
    if cap < 2 * largest:
        return Check(
            "data_disk",
            Status.FAIL,
            f"--data-cache {size_said(cap)} cannot hold {two}: the peer refuses it at its start",
            f"give --data-cache {-(-2 * largest // 2**20)}MiB or more; {NO_TRAINER}",
            figures=figures,
        )
    if found.in_place:
        return Check(
            "data_disk",
            Status.PASS,
            f"the chunks are read in place from {found.chunk_from}: the cache (--data-cache {size_said(cap)}) holds "
            "none of them",
            figures=figures,
        )
    if room < 2 * largest:
        return Check(
            "data_disk",
            Status.FAIL,
            f"{where}{held}: not room for {two}",
            f"free space there, or put the cache on another disk (SWARM_CACHE_DIR=FOLDER); {NO_TRAINER}",
            figures=figures,
        )
    if room < cap:
        return Check(
            "data_disk",
            Status.WARN,
            f"{where}{held}: less than --data-cache {size_said(cap)}, so the disk fills before the cache's cap",
            f"free space there, give a smaller --data-cache (at least {-(-2 * largest // 2**20)}MiB), or put the "
            "cache on a larger disk (SWARM_CACHE_DIR=FOLDER)",
            figures=figures,
        )
    return Check(
        "data_disk",
        Status.PASS,
        f"{where}{held}: room for --data-cache {size_said(cap)} ({cap // largest:,} chunks)",
        figures=figures,
    )
