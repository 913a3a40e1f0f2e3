"""Rewrite tests/durations.json from the ``--durations`` lists of a `.ci/run` log:

    PYTEST_ADDOPTS=--durations=100 .ci/run > ci.log; python -m tests.durations ci.log

Each test's seconds (call + setup + teardown) as pytest printed them; tests/conftest.py starts the
costliest groups first with them. Tests missing from the lists count one second there.
"""
from __future__ import annotations

import collections
import json
import pathlib
import re
import sys

LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+)")


def durations(lines) -> dict[str, float]:
    """{node id (without pytest-xdist's @group suffix): seconds} of every ``--durations`` line."""
    seconds = collections.defaultdict(float)
    for line in lines:
        match = LINE.match(line)
        if match:
            seconds[match.group(2).split("@")[0]] += float(match.group(1))
    return {node: round(value, 1) for node, value in sorted(seconds.items())}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tests.durations CI_LOG", file=sys.stderr)
        return 2
    found = durations(pathlib.Path(argv[0]).read_text().splitlines())
    if not found:
        print(f"error: {argv[0]} holds no --durations lines", file=sys.stderr)
        return 1
    target = pathlib.Path(__file__).with_name("durations.json")
    target.write_text(json.dumps(found, indent=0) + "\n")
    print(f"wrote {len(found)} tests' seconds to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
