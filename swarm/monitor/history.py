"""The monitor's history of a swarm, in SQLite: one row per sample of the swarm, of each stage and of each peer.

Old samples are thinned, not dropped: the last hour keeps every sample, the last day one a minute, the last month
one every ten minutes, and beyond that one an hour, so a month of history stays a few megabytes however long the
monitor runs. Each sample is one transaction (a crash loses at most the sample being written), and a file that
is not a monitor's history, or another swarm's, is refused with a message that says what to do.

The volunteers' counters (samples served as the trainers attest them and as peers claim them, averaging rounds,
hours online) live here too: see swarm/monitor/leaderboard.py for how they are counted across restarts.
"""

from __future__ import annotations

import math
import sqlite3
import threading
from pathlib import Path
from typing import Any

from swarm.errors import HistoryError
from swarm.files import cache_root

APPLICATION = "swarm-monitor"
SCHEMA_VERSION = 1

# (age in seconds up to which the tier applies, one sample kept per this many seconds): thinning keeps the latest
# sample of each bucket. Younger than the first tier: every sample.
THINNING = ((3600.0, 0.0), (86400.0, 60.0), (30 * 86400.0, 600.0), (math.inf, 3600.0))
THIN_EVERY = 60  # samples between two thinning passes
MAX_PEERS_PER_SAMPLE = 2000  # a hostile swarm cannot make one sample's write unbounded
MAX_POINTS = 1500  # a history query returns at most this many points: older ones are bucketed
WINDOWS = {"hour": 3600.0, "day": 86400.0, "week": 7 * 86400.0, "all": math.inf}

SWARM_COLUMNS = (
    "reachable", "healthy", "peers_online", "trainers", "samples_per_second", "tokens_per_second", "tokens_trained",
    "loss", "balance_efficiency", "bottleneck_stage", "averaging_rounds", "activation_bytes", "averaging_bytes",
)  # fmt: skip
STAGE_COLUMNS = ("online_peers", "joining_peers", "throughput", "delivered_throughput", "samples_served", "rounds")
PEER_COLUMNS = ("stage", "status", "throughput", "delivered_throughput", "samples_served", "outstanding")

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samples (id INTEGER PRIMARY KEY, time REAL NOT NULL, {", ".join(SWARM_COLUMNS)});
CREATE INDEX IF NOT EXISTS samples_by_time ON samples (time);
CREATE TABLE IF NOT EXISTS stage_samples (sample_id INTEGER NOT NULL, stage INTEGER NOT NULL, {", ".join(STAGE_COLUMNS)});
CREATE INDEX IF NOT EXISTS stage_samples_by_sample ON stage_samples (sample_id);
CREATE TABLE IF NOT EXISTS peer_samples (sample_id INTEGER NOT NULL, peer_id TEXT NOT NULL, {", ".join(PEER_COLUMNS)});
CREATE INDEX IF NOT EXISTS peer_samples_by_sample ON peer_samples (sample_id);
CREATE TABLE IF NOT EXISTS volunteers (
    peer_id TEXT PRIMARY KEY, public_name TEXT NOT NULL, stage INTEGER, first_seen REAL NOT NULL,
    last_seen REAL NOT NULL, online_seconds REAL NOT NULL DEFAULT 0, rounds_banked INTEGER NOT NULL DEFAULT 0,
    rounds_last INTEGER NOT NULL DEFAULT 0, claimed_banked INTEGER NOT NULL DEFAULT 0,
    claimed_last INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS attestations (
    trainer_id TEXT NOT NULL, peer_id TEXT NOT NULL, banked INTEGER NOT NULL DEFAULT 0,
    last INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (trainer_id, peer_id));
"""


def default_history_path(swarm_id: str) -> Path:
    """$SWARM_CACHE_DIR (or ~/.cache/swarm)/monitor/<swarm id>.sqlite"""
    return cache_root() / "monitor" / f"{swarm_id}.sqlite"


class History:
    """One SQLite file of one swarm's samples. Thread-safe: the sampler writes, the web server's threads read."""

    def __init__(self, path: Path | str, swarm_id: str):
        self.path, self.swarm_id = Path(path), swarm_id
        self.lock = threading.Lock()
        self.samples_since_thinning = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise HistoryError(f"cannot open the history file {self.path} ({e}); pass another --history PATH") from None
        try:
            self._check_and_create()
        except sqlite3.DatabaseError as e:
            self.db.close()
            raise HistoryError(
                f"{self.path} is not a readable SQLite database ({e}): it is corrupt or not a history file; "
                "move it away or pass another --history PATH"
            ) from None
        except HistoryError:
            self.db.close()
            raise

    def _check_and_create(self) -> None:
        tables = {row[0] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if tables and "meta" not in tables:
            names = ", ".join(sorted(tables)[:5])
            raise HistoryError(
                f"{self.path} is an SQLite database of something else (tables {names}), not a swarm-monitor history; "
                "pass another --history PATH"
            )
        meta = dict(self.db.execute("SELECT key, value FROM meta")) if tables else {}
        if tables and meta.get("application") != APPLICATION:
            raise HistoryError(f"{self.path} is not a swarm-monitor history; pass another --history PATH")
        if meta.get("schema") not in (None, str(SCHEMA_VERSION)):
            raise HistoryError(
                f"{self.path} is a history of schema {meta.get('schema')}, this monitor writes schema "
                f"{SCHEMA_VERSION}; pass another --history PATH"
            )
        if meta.get("swarm_id") not in (None, self.swarm_id):
            raise HistoryError(
                f"{self.path} holds the history of swarm {meta['swarm_id']}, not of {self.swarm_id}; "
                "pass another --history PATH (the default path is one file per swarm)"
            )
        self.db.execute("PRAGMA journal_mode = WAL")  # readers (the web server) never wait for the writer
        self.db.execute("PRAGMA synchronous = NORMAL")  # WAL: a power loss may lose the last samples, never the file
        self.db.executescript(SCHEMA)
        for key, value in (("application", APPLICATION), ("schema", str(SCHEMA_VERSION)), ("swarm_id", self.swarm_id)):
            self.db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (key, value))

    def close(self) -> None:
        with self.lock:
            self.db.close()

    # ------------------------------------------------------------------------------------------------- writing

    def record(self, sample: dict[str, Any], stages: list[dict[str, Any]], peers: list[dict[str, Any]]) -> int:
        """Write one sample (swarm row, stage rows, peer rows: see swarm/monitor/sampling.py) in one transaction;
        its id. Every THIN_EVERY samples, thin the old ones."""
        with self.lock:
            try:
                self.db.execute("BEGIN")
                cursor = self.db.execute(
                    f"INSERT INTO samples (time, {', '.join(SWARM_COLUMNS)}) VALUES ({', '.join('?' * (1 + len(SWARM_COLUMNS)))})",
                    (sample["time"], *(sample.get(c) for c in SWARM_COLUMNS)),
                )
                sample_id = cursor.lastrowid
                self.db.executemany(
                    f"INSERT INTO stage_samples VALUES (?, ?, {', '.join('?' * len(STAGE_COLUMNS))})",
                    [(sample_id, row["stage"], *(row.get(c) for c in STAGE_COLUMNS)) for row in stages],
                )
                self.db.executemany(
                    f"INSERT INTO peer_samples VALUES (?, ?, {', '.join('?' * len(PEER_COLUMNS))})",
                    [
                        (sample_id, p["peer_id"], *(p.get(c) for c in PEER_COLUMNS))
                        for p in peers[:MAX_PEERS_PER_SAMPLE]
                    ],
                )
                self.db.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise HistoryError(f"could not write to the history file {self.path} ({e})") from None
            self.samples_since_thinning += 1
            if self.samples_since_thinning >= THIN_EVERY:
                self.samples_since_thinning = 0
                self._thin(sample["time"])
            return sample_id

    def _rollback(self) -> None:
        try:
            self.db.execute("ROLLBACK")
        except sqlite3.Error:
            pass  # nothing was begun

    def _thin(self, now: float) -> None:
        """Keep the latest sample of each bucket of each tier (see THINNING); the rows of the others go."""
        young = 0.0
        try:
            self.db.execute("BEGIN")
            for age, bucket in THINNING:
                if bucket > 0:
                    newest, oldest = now - young, now - age
                    self.db.execute(
                        """DELETE FROM samples WHERE time < ? AND time >= ? AND id NOT IN (
                               SELECT max(id) FROM samples WHERE time < ? AND time >= ? GROUP BY CAST(time / ? AS INTEGER))""",
                        (newest, oldest, newest, oldest, bucket),
                    )
                young = age
            self.db.execute("DELETE FROM stage_samples WHERE sample_id NOT IN (SELECT id FROM samples)")
            self.db.execute("DELETE FROM peer_samples WHERE sample_id NOT IN (SELECT id FROM samples)")
            self.db.execute("COMMIT")
        except sqlite3.Error as e:
            self._rollback()
            raise HistoryError(f"could not thin the history file {self.path} ({e})") from None

    def execute(self, sql: str, parameters: tuple | list = ()) -> list[tuple]:
        """One statement under the lock (the leaderboard's updates and reads go through here)."""
        with self.lock:
            try:
                return self.db.execute(sql, parameters).fetchall()
            except sqlite3.Error as e:
                raise HistoryError(f"could not use the history file {self.path} ({e})") from None

    def executemany(self, statements: list[tuple[str, tuple]]) -> None:
        """Several statements in one transaction."""
        with self.lock:
            try:
                self.db.execute("BEGIN")
                for sql, parameters in statements:
                    self.db.execute(sql, parameters)
                self.db.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise HistoryError(f"could not write to the history file {self.path} ({e})") from None

    # ------------------------------------------------------------------------------------------------- reading

    def sample_count(self) -> int:
        return self.execute("SELECT count(*) FROM samples")[0][0]

    def series(self, window: str, now: float) -> dict[str, Any]:
        """The swarm's and each stage's figures over `window` (a key of WINDOWS), as JSON-ready columns: one list
        per figure, aligned with "time". At most MAX_POINTS points: the latest sample of each time bucket."""
        if window not in WINDOWS:
            raise HistoryError(f"unknown window {window!r}; use one of {', '.join(WINDOWS)}")
        since = now - WINDOWS[window] if math.isfinite(WINDOWS[window]) else -math.inf
        with self.lock:
            first = self.db.execute("SELECT min(time) FROM samples WHERE time >= ?", (since,)).fetchone()[0]
            span = 0.0 if first is None else max(now - first, 0.0)
            bucket = span / MAX_POINTS if span > 0 else 1.0
            rows = self.db.execute(
                f"""SELECT id, time, {", ".join(SWARM_COLUMNS)} FROM samples WHERE id IN (
                        SELECT max(id) FROM samples WHERE time >= ? GROUP BY CAST((time - ?) / ? AS INTEGER))
                    ORDER BY time""",
                (since, first or 0.0, bucket),
            ).fetchall()
            ids = [row[0] for row in rows]
            stage_rows = self.db.execute(
                f"""SELECT sample_id, stage, {", ".join(STAGE_COLUMNS)} FROM stage_samples
                    WHERE sample_id >= ? ORDER BY sample_id""",
                (ids[0] if ids else 0,),
            ).fetchall()
        position = {sample_id: k for k, sample_id in enumerate(ids)}
        series: dict[str, Any] = {"window": window, "points": len(rows), "time": [row[1] for row in rows]}
        for k, column in enumerate(SWARM_COLUMNS):
            series[column] = [_finite(row[2 + k]) for row in rows]
        stages: dict[str, dict[str, list]] = {}
        for sample_id, stage, *values in stage_rows:
            if sample_id not in position:
                continue
            columns = stages.setdefault(str(stage), {c: [None] * len(rows) for c in STAGE_COLUMNS})
            for column, value in zip(STAGE_COLUMNS, values):
                columns[column][position[sample_id]] = _finite(value)
        series["stages"] = dict(sorted(stages.items(), key=lambda item: int(item[0])))
        return series


def _finite(value: Any) -> Any:
    """JSON has no NaN: a missing figure is null (a gap in a plot)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
