"""The exception hierarchy: every error class of the library derives from SwarmError, is defined in swarm/errors.py
and is listed there, with its bases, in the docstring: one place shows a newcomer everything Swarm raises on purpose."""

from __future__ import annotations

import importlib
import pkgutil
import re

import swarm
from swarm import errors
from swarm.errors import SwarmError


def all_subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *all_subclasses(sub)}
    return found


def library_error_classes() -> set[type]:
    """Every SwarmError subclass defined in swarm/ (every module imported first)."""
    for module in pkgutil.walk_packages(swarm.__path__, prefix="swarm."):
        importlib.import_module(module.name)
    return {cls for cls in all_subclasses(SwarmError) if cls.__module__.startswith("swarm.")}


def test_every_error_is_listed_with_its_bases_in_the_hierarchy():
    listed = dict(re.findall(r"^    (\w+) -> ([\w, ]+):", errors.__doc__, flags=re.MULTILINE))
    classes = library_error_classes()
    for cls in classes:
        bases = ", ".join(base.__name__ for base in cls.__bases__)
        assert cls.__module__ == "swarm.errors", (
            f"{cls.__name__} is defined in {cls.__module__}: move it to swarm/errors.py"
        )
        assert listed.get(cls.__name__) == bases, f"list '{cls.__name__} -> {bases}' in swarm/errors.py's docstring"
    assert listed.pop("SwarmError") == "Exception"
    assert set(listed) == {cls.__name__ for cls in classes}, "the docstring lists a class that no longer exists"


def test_errors_that_hivemind_reads_are_value_errors_too():
    """hivemind's readers (and the DHT records' parser) refuse a malformed input by catching ValueError."""
    assert issubclass(errors.MalformedDataError, ValueError) and issubclass(errors.MalformedDataError, SwarmError)
