"""Every command's ``--help`` renders: argparse formats help strings with ``%``, so a literal percent
sign left unescaped in one (``90%`` rather than ``90%%``) makes ``meshnet node --help`` a traceback."""

from __future__ import annotations

import argparse

import pytest

from meshnet.cli.main import _build_parser


def _parsers(parser: argparse.ArgumentParser, name: str = "meshnet") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += _parsers(sub, f"{name} {sub_name}")
    return found


PARSERS = _parsers(_build_parser())


def test_every_command_is_covered() -> None:
    names = {name for name, _ in PARSERS}
    assert {"meshnet node", "meshnet up", "meshnet gateway", "meshnet serve", "meshnet shard make"} <= names


@pytest.mark.parametrize(("name", "parser"), PARSERS, ids=[name for name, _ in PARSERS])
def test_help_renders(name: str, parser: argparse.ArgumentParser) -> None:
    text = parser.format_help()
    assert text.startswith(f"usage: {name}")
    assert "Traceback" not in text
