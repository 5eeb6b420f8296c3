"""The docs against the code (pure: reads docs/*.md and README.md, imports swarm modules; no processes).

What the code can state, the docs must state the same way:
- the table of exceptions lists exactly the classes derived from swarm.errors.SwarmError, each with its bases;
- the table of error codes lists exactly swarm.wire.codes.ErrorCode's values;
- the table of events lists exactly swarm.events.EventKind's values;
- every module path the docs name (`swarm/server/stage.py`, `server/stage.py`, `peers/swarm_peer.py`,
  `tests/test_x.py::test_y`, a folder such as `swarm/preflight/`) exists;
- every page is linked from docs/ARCHITECTURE.md or README.md, and every link between pages (anchors included)
  leads somewhere;
- the pages say what is, not how it came to be: no issue numbers (docs/BENCHMARKS.md, a dated log of measurements,
  is the exception), and docs/ARCHITECTURE.md stays an overview.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import swarm.errors
from swarm.events import EventKind
from swarm.wire.codes import ErrorCode

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
OVERVIEW = DOCS / "ARCHITECTURE.md"
README = ROOT / "README.md"
MAX_OVERVIEW_LINES = 320
HISTORY_EXEMPT = ("BENCHMARKS.md",)  # a log of measurements, each under the issue it was made for
SOURCE_FOLDERS = ("swarm", "peers", "tests", "benchmarks", "examples")
LIBRARY_PACKAGES = tuple(sorted(path.parent.name for path in (ROOT / "swarm").glob("*/__init__.py")))


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of every row of the tables whose header line starts with `header` (the separator row skipped)."""
    rows: list[list[str]] = []
    inside = False
    for line in text.splitlines():
        if line.startswith(header):
            inside = True
            continue
        if inside and not line.startswith("|"):
            inside = False
        if inside and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def find_table(header: str) -> tuple[Path, list[list[str]]]:
    """The one page holding a table with this header, and its rows."""
    found = [(page, table_rows(page.read_text(), header)) for page in pages()]
    found = [(page, rows) for page, rows in found if rows]
    assert len(found) == 1, (
        f"expected exactly one table in docs/ whose header starts with {header!r}, found it in "
        f"{[name(page) for page, _ in found] or 'no page'}: keep one such table (other pages link to it)"
    )
    return found[0]


def first_column(rows: list[list[str]]) -> list[str]:
    """The backticked names of the rows' first cells (`` `moved` `` -> moved)."""
    return [re.sub(r"`", "", row[0]) for row in rows]


def compare(listed: list[str], actual: set[str], page: Path, what: str, source: str, add: str) -> None:
    doubles = sorted({item for item in listed if listed.count(item) > 1})
    missing = sorted(actual - set(listed))
    extra = sorted(set(listed) - actual)
    problems = []
    if missing:
        problems.append(f"add a row for each of {missing} ({add})")
    if extra:
        problems.append(f"remove the rows of {extra}: {source} has no such {what}")
    if doubles:
        problems.append(f"keep one row each of {doubles}")
    assert not problems, f"{name(page)}'s table of {what}s is out of step with {source}: " + "; ".join(problems)


# ------------------------------------------------------------------------------------------ tables


def swarm_errors() -> dict[str, type]:
    """SwarmError and every class derived from it in the library (swarm.errors and any swarm module imported)."""
    found: dict[str, type] = {}
    todo = [swarm.errors.SwarmError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("swarm") and cls.__name__ not in found:
            found[cls.__name__] = cls
            todo.extend(cls.__subclasses__())
    return found


def test_the_table_of_exceptions_lists_every_swarm_error_with_its_bases():
    page, rows = find_table("| class | base |")
    errors = swarm_errors()
    compare(
        first_column(rows),
        set(errors),
        page,
        "exception",
        "swarm/errors.py",
        "| `Name` | `Base` | what it means |, as swarm/errors.py's docstring says",
    )
    wrong_bases = [
        f"{cls_name}: the table says {row[1]!r}, swarm/errors.py says {bases!r}"
        for row, cls_name in zip(rows, first_column(rows), strict=True)
        if cls_name in errors
        for bases in [", ".join(f"`{base.__name__}`" for base in errors[cls_name].__bases__)]
        if row[1] != bases
    ]
    assert not wrong_bases, (
        f"{name(page)}'s table of exceptions names wrong bases (fix the base column):\n" + "\n".join(wrong_bases)
    )


def test_the_table_of_error_codes_lists_every_code():
    page, rows = find_table("| error code |")
    compare(
        first_column(rows),
        {str(code) for code in ErrorCode},
        page,
        "error code",
        "swarm/wire/codes.py (ErrorCode)",
        "| `code` | what it means | whether it blames the answering peer |",
    )


def test_the_table_of_events_lists_every_event_kind():
    page, rows = find_table("| `event` |")
    compare(
        first_column(rows),
        {str(kind) for kind in EventKind},
        page,
        "event",
        "swarm/events.py (EventKind)",
        "| `kind` | when | fields |, with the fields swarm/events.py's docstring gives",
    )


# ------------------------------------------------------------------------------------------ paths

# a path from the repository's root: swarm/server/stage.py, tests/test_x.py::test_y, swarm/preflight/
ROOTED = re.compile(r"(?<![\w/.$~-])((?:" + "|".join(SOURCE_FOLDERS) + r")/[\w/.]*?)(\.py(?:::\w+)?|/)(?![\w/])")
# a module named from inside swarm/: server/stage.py
IN_LIBRARY = re.compile(r"(?<![\w/.$~-])((?:" + "|".join(LIBRARY_PACKAGES) + r")/\w+\.py)(?![\w/])")


def named_paths(text: str) -> set[str]:
    found = set()
    for match in ROOTED.finditer(text):
        path, end = match.group(1), match.group(2)
        if any(part.isupper() for part in path.split("/")):  # a placeholder: benchmarks/NAME.py
            continue
        found.add(path + end)
    found.update("swarm/" + match.group(1) for match in IN_LIBRARY.finditer(text))
    return found


def missing(path: str) -> str | None:
    """Why `path` (as named in the docs) does not exist, or None."""
    file, _, function = path.partition("::")
    target = ROOT / file
    if file.endswith("/"):
        return None if target.is_dir() else "no such folder"
    if not target.is_file():
        return "no such file"
    if function and not re.search(rf"^\s*(async )?def {function}\b", target.read_text(), re.MULTILINE):
        return f"{file} has no function {function}"
    return None


@pytest.mark.parametrize("page", pages(), ids=[page.name for page in pages()])
def test_every_path_the_docs_name_exists(page: Path):
    text = page.read_text()
    wrong = sorted(f"{path}: {why}" for path in named_paths(text) for why in [missing(path)] if why)
    assert not wrong, (
        f"{name(page)} names paths that do not exist (the code moved: name where it is now, or drop the claim):\n"
        + "\n".join(wrong)
    )


# ------------------------------------------------------------------------------------------ links

LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def test_every_page_is_linked_from_the_overview_or_the_readme():
    overview, readme = OVERVIEW.read_text(), README.read_text()
    linked = {target.split("#")[0] for target in LINK.findall(overview)}
    linked |= {target.split("#")[0].removeprefix("docs/") for target in LINK.findall(readme)}
    unlinked = [page.name for page in pages() if page != OVERVIEW and page.name not in linked]
    assert not unlinked, (
        f"pages nobody can find: {unlinked}. Link each from docs/ARCHITECTURE.md's list of topic pages "
        "([TOPIC.md](TOPIC.md)) or from README.md ([docs/TOPIC.md](docs/TOPIC.md))"
    )


@pytest.mark.parametrize("page", [*pages(), README], ids=[page.name for page in [*pages(), README]])
def test_every_link_between_pages_leads_somewhere(page: Path):
    wrong = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        if not linked.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            wrong.append(f"{target}: {linked.name} has no heading with the anchor #{anchor}")
    assert not wrong, f"{name(page)} has links that lead nowhere (fix the file or the heading's anchor):\n" + "\n".join(
        wrong
    )


# ------------------------------------------------------------------------------------------ what is, not history

HISTORY = re.compile(
    r"\b(issues? \d+|issue #?\d+|last session|(first|second) session|was added in|until issue)\b", re.I
)


@pytest.mark.parametrize("page", pages(), ids=[page.name for page in pages()])
def test_pages_say_what_is_not_how_it_came_to_be(page: Path):
    if page.name in HISTORY_EXEMPT:
        pytest.skip(f"{page.name} is a dated log of measurements")
    found = [
        f"line {number}: {match.group(0)!r}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for match in HISTORY.finditer(line)
    ]
    assert not found, (
        f"{name(page)} narrates history (say what is and why, without issue numbers or sessions):\n" + "\n".join(found)
    )


def test_the_overview_stays_short():
    lines = len(OVERVIEW.read_text().splitlines())
    assert lines <= MAX_OVERVIEW_LINES, (
        f"docs/ARCHITECTURE.md has {lines} lines (at most {MAX_OVERVIEW_LINES}): it is the map; move detail into the "
        "topic page it belongs to and link to it"
    )
