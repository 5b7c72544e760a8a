"""Renders the tables of `benchmarks/README.md` from `benchmarks/results/*.json`.

Each benchmark script writes its results with `_timing.write_json` (by default
`benchmarks/results/<script>.json`). In the README a table is asked for by a
pair of markers, and everything between them is replaced:

    <!-- table bench_plan:main -->
    (rendered here)
    <!-- /table -->

`bench_plan` names the JSON file (`results/bench_plan.json`) and `main` the
table in it. Under each table a line gives the command, the date, the machine
and, for figures not measured by the script itself, where they come from. A
marker whose file is missing renders as a line saying how to make it.

Run: `python benchmarks/render.py` (rewrites the README), or
`python benchmarks/render.py --check` (exit status 1 if the README is not what
the JSON files render, without writing it).
"""

import argparse
import json
import pathlib
import re
import sys
from typing import Any


HERE = pathlib.Path(__file__).resolve().parent
MARKER = re.compile(
    r"(?P<open><!-- table (?P<file>[\w.-]+):(?P<table>[\w.-]+) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- /table -->)",
    re.S,
)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_table(record: dict[str, Any], name: str) -> str:
    """The Markdown of table `name` of one results `record`, and its source line."""
    try:
        table = record["tables"][name]
    except KeyError:
        raise SystemExit(
            f"render.py: {record.get('script')} has no table {name!r}; "
            f"it has {sorted(record.get('tables', {}))}"
        ) from None
    columns = table["columns"]
    lines = ["| " + " | ".join(map(_cell, columns)) + " |"]
    lines.append("|" + "---|" * len(columns))
    for row in table["rows"]:
        if len(row) != len(columns):
            raise SystemExit(
                f"render.py: {record.get('script')}:{name}: a row of {len(row)} "
                f"cells under {len(columns)} columns: {row}"
            )
        lines.append("| " + " | ".join(map(_cell, row)) + " |")
    about = [f"`{record['command']}`", record["date"], record["machine"]["kind"]]
    if table.get("unit"):
        about.insert(0, f"unit: {table['unit']}")
    if table.get("title"):
        about.insert(0, table["title"])
    if record.get("source", "measured") != "measured":
        about.append(record["source"])
    lines += ["", "<sub>" + "; ".join(about) + "</sub>"]
    return "\n".join(lines) + "\n"


def render(readme: str, results: pathlib.Path) -> str:
    """`readme` with every marked table rendered from the JSON under `results`."""

    def one(match: re.Match[str]) -> str:
        path = results / f"{match['file']}.json"
        if path.exists():
            body = render_table(json.loads(path.read_text()), match["table"])
        else:
            body = (
                f"No results recorded yet (`benchmarks/results/{path.name}`): "
                "run the script, then `python benchmarks/render.py`.\n"
            )
        return match["open"] + body + match["close"]

    return MARKER.sub(one, readme)


def main() -> int:
    parser = argparse.ArgumentParser(description="Renders README.md's tables.")
    parser.add_argument("--check", action="store_true", help="only compare")
    parser.add_argument("--readme", default=str(HERE / "README.md"))
    parser.add_argument("--results", default=str(HERE / "results"))
    args = parser.parse_args()
    readme = pathlib.Path(args.readme)
    old = readme.read_text()
    new = render(old, pathlib.Path(args.results))
    if args.check:
        if new != old:
            print(f"{readme} is out of date: run python benchmarks/render.py")
            return 1
        print(f"{readme} is up to date")
        return 0
    if new != old:
        readme.write_text(new)
    print(f"rendered {len(MARKER.findall(old))} tables into {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
