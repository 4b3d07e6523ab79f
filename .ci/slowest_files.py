"""Prints the test files and the tests that took longest in a pytest JUnit report:
`python .ci/slowest_files.py JUNIT [N]`.

CI calls it after the tests so that every run's log says where its minutes went (a file's time is the sum of
its tests' times, fixtures included; module-scoped fixtures count toward the first test that uses them).
"""

import collections
import sys
import xml.etree.ElementTree as ElementTree


def _file_of(case: ElementTree.Element) -> str:
    # classname is the dotted module path plus any class name; the file is its lower-case (tests.*) part
    names = [part for part in case.get("classname", "").split("::")[0].split(".") if not part[:1].isupper()]
    return "/".join(names) + ".py"


def test_seconds(junit_path: str) -> dict[str, float]:
    """`file::test` -> seconds, for every test case of the report."""
    return {f"{_file_of(case)}::{case.get('name', '')}": float(case.get("time", 0.0))
            for case in ElementTree.parse(junit_path).getroot().iter("testcase")}


def file_seconds(junit_path: str) -> dict[str, float]:
    seconds: dict[str, float] = collections.defaultdict(float)
    for name, value in test_seconds(junit_path).items():
        seconds[name.split("::")[0]] += value
    return dict(seconds)


def _print_slowest(title: str, seconds: dict[str, float], count: int) -> None:
    total = sum(seconds.values())
    print(f"slowest {count} of {len(seconds)} {title} ({total:.0f} s of tests in all):")
    for name, value in sorted(seconds.items(), key=lambda item: -item[1])[:count]:
        print(f"  {value:7.1f} s  {100 * value / total:4.1f}%  {name}")


def main(argv: list[str]) -> int:
    path, count = argv[0], int(argv[1]) if len(argv) > 1 else 15
    _print_slowest("test files", file_seconds(path), count)
    _print_slowest("tests", test_seconds(path), count)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
