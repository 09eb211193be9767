"""``python -m pergrad_viz --help``: each command listed once, with its help line."""

from __future__ import annotations

import re

import pytest

from pergrad_viz.cli.main import build_parser

COMMANDS = ("bench", "scan", "scan-bench")


def test_the_top_help_lists_each_command_once(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for name in COMMANDS:
        # a command's entry: the name at the start of an indented line (its help beside it or below)
        entries = re.findall(rf"^ {{1,8}}{re.escape(name)}(?:  |$)", text, re.M)
        assert len(entries) == 1, f"{name!r} is listed {len(entries)} times in:\n{text}"
    assert "{bench,scan,scan-bench}" not in text
