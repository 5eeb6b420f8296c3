"""The manifest's validation helpers: typed reading of a decoded JSON object, with errors that name the field.

A `Fields` reads one object of the manifest (the whole manifest, or a section such as `training`) for the
dataclass that object becomes. A missing field takes that dataclass field's default, and a field whose
dataclass field has no default is required: defaults are stated once, in swarm/manifests/manifest.py's
dataclasses, never here. `validate_multiaddrs` checks the peers' addresses a manifest lists. The rules (types,
ranges, choices) are swarm/manifests/validation.py's `manifest_from_dict`.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from typing import Any

from multiaddr import Multiaddr

from swarm.errors import ManifestError

_MISSING = object()  # no value and no default: the field is required
_FROM_DATACLASS = object()  # take the dataclass field's default


def shown(value: Any) -> str:
    """A value as error messages show it: short, whatever it is (an int of 5,000 digits or a list nested 5,000
    deep cannot even be repr()ed)."""
    try:
        return reprlib.repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__} too large to show"


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


class Fields:
    """Typed access to one JSON object of the manifest, with errors that name the field.

    `of` is the dataclass the object describes: a missing field takes its dataclass field's default, and is
    required if that field has none (with `of` None, every field is required, unless `get` is given a default)."""

    def __init__(self, raw: Any, path: str, of: type | None = None):
        self.path = path
        self.of = of
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ManifestError(f"{self._name(None)}: must be a JSON object, got {type(raw).__name__}")
        self.raw = raw
        self.used: set[str] = set()

    def _name(self, key: str | None) -> str:
        prefix = "" if self.path == "manifest" else self.path
        full = key if not prefix else (prefix if key is None else f"{prefix}.{key}")
        return "manifest" if full is None else f"manifest field '{full}'"

    def _default(self, key: str) -> Any:
        """The default of `key`'s dataclass field, or _MISSING if it has none."""
        if self.of is None:
            return _MISSING
        for f in dataclasses.fields(self.of):
            if f.name == key:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:
                    return f.default_factory()
                return _MISSING
        raise KeyError(f"{self.of.__name__} has no field {key!r}")  # a bug of the validator, not of the manifest

    def get(self, key: str, default: Any = _FROM_DATACLASS) -> Any:
        """The raw value of `key`; if it is missing, `default` (by default, the dataclass field's default)."""
        self.used.add(key)
        if key in self.raw:
            return self.raw[key]
        if default is _FROM_DATACLASS:
            default = self._default(key)
        if default is _MISSING:
            raise ManifestError(f"{self._name(key)}: is required but missing")
        return default

    def section(self, key: str, of: type | None = None) -> Fields:
        """The JSON object in `key`, read for dataclass `of`; required unless its own field has a default."""
        optional = self._default(key) is not _MISSING
        value = self.get(key, default=None if optional else _MISSING)
        sub_path = key if self.path == "manifest" else f"{self.path}.{key}"
        return Fields(value, sub_path, of)

    def string(self, key: str, empty: bool = False) -> str:
        """A non-empty string (or, with `empty`, also exactly "")."""
        value = self.get(key)
        if empty and value == "":
            return value
        if not isinstance(value, str) or not value.strip():
            raise ManifestError(f"{self._name(key)}: must be a non-empty string, got {shown(value)}")
        return value

    def integer(self, key: str, minimum: int | None = None, maximum: int | None = None) -> int:
        value = self.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ManifestError(f"{self._name(key)}: must be an integer, got {shown(value)}")
        self._check_range(key, value, minimum, maximum)
        return value

    def number(self, key: str, minimum: float | None = None, maximum: float | None = None) -> float:
        value = self.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not _finite(value):
            raise ManifestError(f"{self._name(key)}: must be a finite number, got {shown(value)}")
        self._check_range(key, value, minimum, maximum)
        return float(value)

    def boolean(self, key: str) -> bool:
        value = self.get(key)
        if not isinstance(value, bool):
            raise ManifestError(f"{self._name(key)}: must be true or false, got {shown(value)}")
        return value

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        value = self.get(key)
        if value not in options:
            raise ManifestError(f"{self._name(key)}: must be one of {', '.join(options)}, got {shown(value)}")
        return value

    def array(self, key: str, of_what: str) -> list[Any]:
        """A JSON array (its items unchecked); if it is missing, the dataclass field's default, as a list."""
        value = self.get(key)
        if key not in self.raw:
            return list(value)  # the default: a tuple, as the frozen dataclasses hold sequences
        if not isinstance(value, list):
            raise ManifestError(f"{self._name(key)}: must be a list of {of_what}")
        return value

    def _check_range(self, key: str, value: float, minimum: float | None, maximum: float | None) -> None:
        if minimum is not None and value < minimum:
            raise ManifestError(f"{self._name(key)}: must be at least {minimum}, got {shown(value)}")
        if maximum is not None and value > maximum:
            raise ManifestError(f"{self._name(key)}: must be at most {maximum}, got {shown(value)}")

    def no_unknown(self) -> None:
        unknown = sorted(set(self.raw) - self.used)
        if unknown:
            raise ManifestError(f"{self._name(unknown[0])}: unknown field (misspelled?)")


def validate_multiaddrs(values: list[Any], where: str) -> list[str]:
    """Parse every multiaddr with the `multiaddr` library; raise ManifestError on the first bad one."""
    result = []
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise ManifestError(f"manifest field '{where}[{i}]': must be a multiaddr string, got {shown(value)}")
        try:
            addr = Multiaddr(value)
        except Exception as e:  # the multiaddr library raises several unrelated types
            raise ManifestError(
                f"manifest field '{where}[{i}]': {shown(value)} is not a valid multiaddr ({e})"
            ) from None
        if "p2p" not in [p.name for p in addr.protocols()]:
            raise ManifestError(
                f"manifest field '{where}[{i}]': {shown(value)} has no /p2p/<peer id> part; copy the full address "
                "that swarm-peer printed"
            )
        result.append(str(addr))
    return result
