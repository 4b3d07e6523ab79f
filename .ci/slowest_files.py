"""Prints the test files that took longest in a pytest JUnit report: `python .ci/slowest_files.py JUNIT [N]`.

CI calls it after the tests so that every run's log says where its minutes went (a file's time is the sum of
its tests' times, fixtures included; module-scoped fixtures count toward the first test that uses them).
"""

import collections
import sys
import xml.etree.ElementTree as ElementTree


def file_seconds(junit_path: str) -> dict[str, float]:
    seconds: dict[str, float] = collections.defaultdict(float)
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        module = case.get("classname", "").split("::")[0]
        # classname is the dotted module path plus any class name; the file is its tests.* prefix
        parts = module.split(".")
        names = [p for p in parts if not p[:1].isupper()]
        seconds["/".join(names) + ".py"] += float(case.get("time", 0.0))
    return dict(seconds)


def main(argv: list[str]) -> int:
    path, count = argv[0], int(argv[1]) if len(argv) > 1 else 15
    seconds = file_seconds(path)
    total = sum(seconds.values())
    print(f"slowest {count} of {len(seconds)} test files ({total:.0f} s of tests in all):")
    for name, value in sorted(seconds.items(), key=lambda item: -item[1])[:count]:
        print(f"  {value:7.1f} s  {100 * value / total:4.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
