"""Write one benchmark's section of docs/benchmarks.md, between its markers."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(name: str, markdown: str, path: Path = BENCHMARKS) -> None:
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1]
        text = f"{before}{start}\n{markdown.strip()}\n{end}{after}"
    else:
        text = f"{text.rstrip()}\n\n{start}\n{markdown.strip()}\n{end}\n"
    path.write_text(text)
