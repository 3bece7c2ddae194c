"""Write tests/seconds.json, the seconds each test took (setup, call and teardown summed), from
the output of pytest runs made with `--durations=0` (the parts of `make test-all`, merged).
conftest.longest_files_first hands the files out longest first from it. Run it again when costs
move a lot: a stale table costs balance, never a test (a file with no test in it goes first).

    python -m pytest ... --durations=0 > part1.txt
    python tests/seconds_table.py part1.txt part2.txt
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import sys

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S+\.py::\S.*?)\s*$")
OUT = pathlib.Path(__file__).with_name("seconds.json")


def seconds_of(texts: list[str]) -> dict[str, float]:
    """Seconds per test id, the longest first, from pytest's --durations lines."""
    seconds: collections.Counter = collections.Counter()
    for text in texts:
        for line in text.splitlines():
            if m := LINE.match(line):
                seconds[m.group(2)] += float(m.group(1))
    return {name: round(s, 2) for name, s in seconds.most_common()}


def main(paths: list[str]) -> None:
    if not paths:
        sys.exit(__doc__)
    table = seconds_of([pathlib.Path(p).read_text() for p in paths])
    if not table:
        sys.exit("no --durations lines in " + ", ".join(paths))
    OUT.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{OUT}: {len(table)} tests, {sum(table.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
