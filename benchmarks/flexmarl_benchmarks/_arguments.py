"""Command-line checks the benches share: `--set KEY=VALUE` config overrides and comma-separated subsets."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def add_config_overrides(parser: argparse.ArgumentParser, applies_to: str, example: str) -> None:
    """`--set KEY=VALUE` (repeatable), collected into ``args.set``; check it with `config_overrides`."""
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"config override for {applies_to}, e.g. --set {example} (repeatable)")


def config_overrides(parser: argparse.ArgumentParser, items: Sequence[str]) -> dict[str, str]:
    """``items`` (`KEY=VALUE` strings) as a mapping; a parser error naming the first item without '='."""
    bad = [item for item in items if "=" not in item]
    if bad:
        parser.error(f"--set {bad[0]!r}: expected KEY=VALUE")
    return dict(item.split("=", 1) for item in items)


def checked_subset(parser: argparse.ArgumentParser, flag: str, value: str, allowed: Sequence[str],
                   noun: str) -> list[str]:
    """The comma-separated names in ``value``; a parser error listing those not in ``allowed``."""
    names = value.split(",")
    unknown = [name for name in names if name not in allowed]
    if unknown:
        parser.error(f"{flag}: unknown {noun}(s) {unknown}; allowed: {', '.join(allowed)}")
    return names
