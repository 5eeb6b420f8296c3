"""Atomic writes (swarm/files.py), and the writers that use them: real files, in tmp_path."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from conftest import tiny_manifest_dict
from swarm.client.export import write_safetensors
from swarm.errors import ExportError, ManifestError
from swarm.files import atomic_write, cache_root
from swarm.manifests.loading import load_manifest, write_manifest
from swarm.manifests.validation import manifest_from_dict
from swarm.server.checkpoint import save_checkpoint
from swarm.throughput import read_cached, write_cached
from swarm.trust.secret import read_secret, write_secret


@pytest.fixture
def umask():
    """Set the process's umask for one test (restored after it)."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def test_the_content_is_replaced_whole_and_no_temporary_file_is_left(tmp_path):
    path = tmp_path / "file.txt"
    path.write_text("an old and much longer content\n" * 100)
    atomic_write(path, b"new")
    assert path.read_bytes() == b"new"
    atomic_write(path, "d\u00e9j\u00e0 vu")  # a str is written as UTF-8
    assert path.read_bytes() == "d\u00e9j\u00e0 vu".encode()
    atomic_write(str(tmp_path / "other"), b"")  # a str path, and an empty file
    assert (tmp_path / "other").read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "other"]


def test_a_failure_raises_leaves_no_temporary_file_and_the_old_file_untouched(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "file.txt", b"data")
    assert list(tmp_path.iterdir()) == []

    (tmp_path / "folder").mkdir()
    with pytest.raises(OSError):  # the target cannot be replaced: it is a folder
        atomic_write(tmp_path / "folder", b"data")
    assert list(tmp_path.iterdir()) == [tmp_path / "folder"] and list((tmp_path / "folder").iterdir()) == []

    path = tmp_path / "file.txt"
    path.write_bytes(b"old")
    with pytest.raises(TypeError):  # an error while writing, not an OSError: cleaned up all the same
        atomic_write(path, 12345)  # type: ignore[arg-type]
    assert path.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [tmp_path / "file.txt", tmp_path / "folder"]


def test_without_a_mode_the_file_has_an_ordinary_files_permissions(tmp_path, umask):
    path = tmp_path / "file.txt"
    atomic_write(path, b"x")
    assert path.stat().st_mode & 0o777 == 0o644  # 0o666 less the umask (0o022)
    umask(0o077)
    atomic_write(path, b"y")
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_mode_is_honoured_exactly_and_the_file_is_never_wider(tmp_path, umask, monkeypatch):
    path = tmp_path / "secret"
    path.write_text("world-readable before")
    path.chmod(0o644)
    umask(0)  # the widest umask: the mode alone must keep the file private
    created, replaced = [], []
    real_open, real_replace = os.open, os.replace

    def open_(file, flags, mode=0o777, **kwargs):  # the temporary file is created private, not made so later
        if flags & os.O_CREAT:
            created.append(mode)
        return real_open(file, flags, mode, **kwargs)

    def replace(source, destination):  # and is still private when it takes the path
        replaced.append(os.stat(source).st_mode & 0o777)
        real_replace(source, destination)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(path, b"hidden", mode=0o600)
    assert created == [0o600] and replaced == [0o600]
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_bytes() == b"hidden"
    umask(0o077)
    atomic_write(path, b"shared", mode=0o644)  # exactly the mode, whatever the umask
    assert path.stat().st_mode & 0o777 == 0o644


# ---------------------------------------------------------------------------------- the writers that use it


def test_a_secret_is_written_private_over_a_readable_file(tmp_path):
    path = tmp_path / "swarm.secret"
    path.write_text("x" * 64)
    path.chmod(0o644)
    write_secret(path)
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text().strip() != "x" * 64
    assert len(path.read_text().strip()) == 64 and read_secret(path) is not None
    with pytest.raises(ManifestError, match="cannot write the secret file"):
        write_secret(tmp_path / "missing" / "swarm.secret")
    assert list(tmp_path.iterdir()) == [path]


def test_a_manifest_is_written_whole_or_a_clear_error(tmp_path):
    manifest = manifest_from_dict(tiny_manifest_dict())
    path = tmp_path / "swarm.json"
    write_manifest(manifest, path)
    assert load_manifest(path) == manifest
    with pytest.raises(ManifestError, match="cannot write the manifest to"):
        write_manifest(manifest, tmp_path / "missing" / "swarm.json")
    assert list(tmp_path.iterdir()) == [path]


def test_checkpoints_exports_and_the_throughput_cache_leave_no_temporary_file(tmp_path, caplog):
    manifest = manifest_from_dict(tiny_manifest_dict())
    path = save_checkpoint(tmp_path / "checkpoints", manifest, 0, [("param/x", torch.ones(3))], {"optimizer_steps": 1})
    assert list(path.parent.iterdir()) == [path]

    out = tmp_path / "model.safetensors"
    assert write_safetensors(out, {"x": torch.ones(3)}, {"swarm_export": "1"}) == out.stat().st_size
    with pytest.raises(ExportError, match="cannot write"):
        write_safetensors(tmp_path / "missing" / "model.safetensors", {"x": torch.ones(3)}, {})

    cache = tmp_path / "cache" / "throughput.json"
    write_cached(cache, "a", 1.5)
    write_cached(cache, "b", 2.5)
    assert read_cached(cache, "a") == 1.5 and read_cached(cache, "b") == 2.5
    assert list(cache.parent.iterdir()) == [cache]
    (tmp_path / "taken").mkdir()
    with caplog.at_level(logging.WARNING):
        write_cached(tmp_path / "taken", "a", 1.0)  # only a cache: a warning, no error
    assert "could not write the throughput cache" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "checkpoints", "model.safetensors", "taken"]


def test_every_cache_lives_under_one_root_that_honours_swarm_cache_dir_then_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("SWARM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "swarm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "swarm"
    monkeypatch.setenv("SWARM_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
