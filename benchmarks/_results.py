"""What every benchmark script shares: its section of RESULTS.md, and CPU time used."""

from __future__ import annotations

from pathlib import Path
from resource import RUSAGE_CHILDREN, RUSAGE_SELF, getrusage

RESULTS = Path(__file__).with_name("RESULTS.md")


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of benchmark `name`'s section."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(name: str, body: str) -> None:
    """Replace benchmark `name`'s section of RESULTS.md (between its markers), or append it;
    the other sections are left as they are."""
    start, end = markers(name)
    section = f"{start}\n{body}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else "# hexiseq benchmark results\n"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS.write_text(text)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children."""
    own, children = (getrusage(who) for who in (RUSAGE_SELF, RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
