"""The Dockerfile matches the project, without building it (no Docker here): what it copies exists, it installs
torch within the project's own range, its entry point is one of the project's commands and runs with the flags
the Dockerfile gives it (in this environment, which the image reproduces with pip), and the cache it keeps in
its volume is the variable Swarm reads."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, comments and blank lines left out."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if line and not line.startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_what_the_dockerfile_copies_exists_and_the_tests_stay_out():
    copies = [args.split()[:-1] for kind, args in instructions() if kind == "COPY"]
    assert copies
    for sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)


def test_it_installs_torch_in_the_projects_range_and_the_project_itself():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_requirement = next(r for r in project["dependencies"] if re.match(r"torch\b", r))
    runs = " ".join(args for kind, args in instructions() if kind == "RUN")
    assert f'"{torch_requirement}"' in runs, (torch_requirement, runs)
    assert "pip install --no-cache-dir ." in runs  # the project, with its pinned dependencies


def test_the_entry_point_is_swarm_peer_and_runs_with_the_dockerfiles_flags(tmp_path):
    entry = json.loads(next(args for kind, args in instructions() if kind == "ENTRYPOINT"))
    default = json.loads(next(args for kind, args in instructions() if kind == "CMD"))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry[0] == "swarm-peer" and entry[0] in scripts
    module = scripts[entry[0]].split(":")[0]
    # the flags parse (the identity's folder is the volume: here a temporary one)
    flags = [tmp_path.as_posix() + "/identity.key" if arg == "/data/identity.key" else arg for arg in entry[1:]]
    from peers.swarm_peer_args import parse_args

    args = parse_args([*flags, "--join", "https://example.org/swarm.json"])
    assert args.identity.endswith("identity.key") and args.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"]
    # `docker run IMAGE` alone prints the help, with the examples
    done = subprocess.run(
        [sys.executable, "-m", module, *flags, *default], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0 and "--join" in done.stdout and "examples" in done.stdout, done.stderr[-2000:]


def test_the_volume_keeps_the_cache_swarm_reads():
    env = dict(args.split("=", 1) for kind, args in instructions() if kind == "ENV")
    assert env["SWARM_CACHE_DIR"].startswith("/data/")
    assert "SWARM_CACHE_DIR" in (ROOT / "swarm" / "files.py").read_text()
    volumes = json.loads(next(args for kind, args in instructions() if kind == "VOLUME"))
    assert volumes == ["/data"]
    port = next(args for kind, args in instructions() if kind == "EXPOSE")
    entry = json.loads(next(args for kind, args in instructions() if kind == "ENTRYPOINT"))
    assert f"/tcp/{port}" in " ".join(entry)
