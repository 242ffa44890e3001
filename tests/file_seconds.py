"""Writes tests/file_seconds.json, each test file's seconds in a run, from that run's JUnit XML:

    pytest -n 2 --dist loadfile --junitxml=/tmp/run.xml && python tests/file_seconds.py /tmp/run.xml

`make test` hands the files to its two test processes heaviest first (tests/conftest.py): a process that
took a two-minute file last would run alone while the other one idles. The numbers only order the files; a file
missing from them (a new one) runs after the listed ones, and stale numbers cost time, never a result.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).with_suffix(".json")


def file_seconds(junit_xml: Path) -> dict[str, int]:
    """{test file name: whole seconds its tests took (setup, call and teardown)}, heaviest first."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        module = case.get("classname", "").split(".")  # tests.test_x[.Class]
        if len(module) >= 2:
            seconds[module[1] + ".py"] += float(case.get("time") or 0.0)
    return {name: round(s) for name, s in seconds.most_common() if round(s) > 0}


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_file():
        sys.exit("usage: python tests/file_seconds.py RUN.xml (pytest's --junitxml output)")
    OUT.write_text(json.dumps(file_seconds(Path(sys.argv[1])), indent=0) + "\n")
    print(f"wrote {OUT}")
