"""The one report writer: a benchmark measures and hands back a Report (its machine, its targets
with their verdicts, its tables, a few generated lines), and this module turns it into its
section of docs/benchmarks.md, the same text on stdout, and the raw numbers as JSON.

A benchmark writes only the generated block of its section, between two markers:

    ## Queue overhead
    (what is measured and how: prose kept by hand, in the docs)
    <!-- bench: from here, Queue overhead -->
    (the reproduce command, the machine line, targets, tables: rewritten by every run)
    <!-- bench: to here, Queue overhead -->
    (how to read it, notes of earlier runs: kept by hand)

so the prose around the figures, and notes appended by hand, survive a rerun. A section not in
the file yet is appended with its block.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.machine import described
from bench.harness.services import REPO

DOCS = REPO / "docs" / "benchmarks.md"


@dataclass
class Table:
    """A Markdown table, with an optional `### title` above it and one short generated paragraph
    before (`caption`: what the rows are) and after it (`note`)."""

    columns: Sequence[str]
    rows: Iterable[Sequence[object]]
    title: str | None = None
    caption: str | None = None
    note: str | None = None

    def lines(self) -> list[str]:
        out = [f"### {self.title}", ""] if self.title else []
        if self.caption:
            out += [self.caption, ""]
        out += table(self.columns, self.rows)
        return [*out, "", *([self.note, ""] if self.note else [])]


@dataclass(frozen=True)
class Target:
    """A target the benchmark is held to, what it measured, and whether that meets it (None:
    nothing to judge on this run)."""

    what: str
    measured: str
    met: bool | None


@dataclass
class Report:
    """What one run of a benchmark shows. `heading` names its section (`## ...`), `command`
    reruns it, `machine` is what it ran on; `facts` follow the machine line (run length, threads,
    settings); `targets` get a table with verdicts; `body` is its tables and generated lines,
    in order; `results` are the raw numbers `--json` writes."""

    heading: str
    command: str
    machine: dict[str, str]
    facts: Sequence[str] = ()
    targets: Sequence[Target] = ()
    body: Sequence[Table | str] = ()
    results: dict[str, Any] = field(default_factory=dict)

    def markdown(self) -> str:
        """The generated block, in Markdown."""
        lines = [
            "Reproduce (`--quick` is a smoke run that leaves this file alone):",
            "",
            *reproduce(self.command),
            "",
            " ".join([f"Machine: {described(self.machine)}.", *self.facts]),
        ]
        if self.targets:
            rows = ((t.what, t.measured, verdict(t.met)) for t in self.targets)
            lines += ["", *table(("target", "measured", "verdict"), rows)]
        lines.append("")
        for part in self.body:
            lines += part.lines() if isinstance(part, Table) else [part, ""]
        return "\n".join(lines).rstrip("\n") + "\n"


def verdict(met: bool | None) -> str:
    return "not judged" if met is None else "**met**" if met else "**not met**"


def markers(heading: str) -> tuple[str, str]:
    """The lines that open and close a section's generated block."""
    name = heading.removeprefix("## ").strip()
    return f"<!-- bench: from here, {name} -->", f"<!-- bench: to here, {name} -->"


def write_block(path: Path, heading: str, block: str) -> None:
    """Put `block` between the markers of the section `heading`, leaving everything else as it
    was. A section without markers gets them at its end; a missing section is appended."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = markers(heading)
    if begin not in text and heading + "\n" in text:
        start = text.index(heading + "\n")
        stop = text.find("\n## ", start + len(heading))
        stop = len(text) if stop < 0 else stop + 1
        text = text[:stop].rstrip("\n") + f"\n\n{begin}\n{end}\n\n" + text[stop:]
    elif begin not in text:
        text = text.rstrip("\n") + f"\n\n{heading}\n\n{begin}\n{end}\n"
    write_between(path, text, begin, end, block)


def write_between(path: Path, text: str, begin: str, end: str, block: str) -> None:
    """`text` with what stands between the lines `begin` and `end` replaced by `block`,
    written to `path`."""
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} ... {end} block to fill")
    head, rest = text.split(begin, 1)
    text = f"{head}{begin}\n{block.rstrip()}\n{end}{rest.split(end, 1)[1]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n")


def emit(report: Report, docs: Path | None, json_path: Path | None = None) -> None:
    """Everything a run hands back: the block on stdout, the raw numbers to `json_path` (when
    given), the block into `docs` (None: the docs left alone, as --quick and --no-docs do)."""
    block = report.markdown()
    print(f"\n{report.heading}\n\n{block}", flush=True)
    if json_path is not None:
        raw = {"machine": report.machine, **report.results}
        json_path.write_text(json.dumps(raw, indent=2, default=str))
    if docs is not None:
        write_block(docs, report.heading, block)
        print(f"wrote {docs}")


def docs_of(args: Any) -> Path | None:
    """Where a run's block goes: --docs, unless --no-docs (which --quick sets)."""
    return None if getattr(args, "no_docs", False) else getattr(args, "docs", DOCS)


def reproduce(command: str) -> list[str]:
    """The command that reruns the benchmark, as a code block."""
    return ["```", command, "```"]


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table: the header, its rule, a line per row."""
    return [
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]
