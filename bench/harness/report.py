"""How a benchmark's results are written: its section of docs/benchmarks.md (replaced in place,
the other sections left alone), the pieces every section has (the command that reproduces it,
the machine line, Markdown tables), and the raw results as JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.harness.machine import cpu_model, described
from bench.harness.services import REPO

DOCS = REPO / "docs" / "benchmarks.md"


def write_docs(path: Path, section: str, heading: str) -> None:
    """Replace the section titled `heading` with `section`, or append it, leaving other
    sections alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = text.find(heading + "\n")
    if start < 0:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(heading))
        new = text[:start] + section + ("\n" + text[end + 1 :] if end >= 0 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new.rstrip("\n") + "\n")


def publish(docs: Path, no_docs: bool, section: str) -> None:
    """Write `section` (its first line is its heading) into `docs`, unless `no_docs`."""
    if no_docs:
        return
    write_docs(docs, section, heading=section.splitlines()[0])
    print(f"wrote {docs}")


def json_document(info: dict[str, str], indent: int = 2, **results: Any) -> str:
    """The raw results for --json: the machine first, then `results`."""
    return json.dumps({"machine": info, **results}, indent=indent)


def save(path: Path | None, text: str) -> None:
    """Write the raw results to `path`, when one was given."""
    if path is not None:
        path.write_text(text)


def reproduce(command: str) -> list[str]:
    """The command that reruns the benchmark, as a code block."""
    return ["```", command, "```"]


def machine_line(info: dict[str, str]) -> str:
    return "Machine: " + described(info)


def measured_on(info: dict[str, str]) -> str:
    """The opening of an in-process benchmark's section: the CPU and torch it ran on."""
    return f"Measured on {cpu_model()} ({os.cpu_count()} cores), torch {info['torch']}, "


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table: the header, its rule, a line per row."""
    return [
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
        *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows),
    ]
