"""The ``spectra`` parser: every subcommand's options, defaults and help text as they were
before the subcommands registered their own arguments (``expected_help/``).

``expected_help/*.txt`` is ``spectra [COMMAND] --help`` at 100 columns and
``expected_help/actions.json`` every option's strings, default, type, choices, nargs,
metavar, group and whether it is required; both were written from the parser built in one
function, so a change in any of them, in any subcommand, fails here.
"""

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from spectra.cli._parser import build_parser

EXPECTED = Path(__file__).parent / "expected_help"
COLUMNS = "100"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _describe_action(action: argparse.Action, group: str) -> dict[str, Any]:
    default = action.default
    if default is not None and not isinstance(default, (bool, int, float, str, list)):
        default = repr(default)
    kind = action.type
    return {
        "options": list(action.option_strings) or [action.dest],
        "dest": action.dest,
        "action": type(action).__name__,
        "default": default,
        "type": None if kind is None else getattr(kind, "__name__", repr(kind)),
        "choices": None if action.choices is None else [str(c) for c in action.choices],
        "nargs": action.nargs,
        "metavar": action.metavar,
        "required": action.required,
        "group": group,
        "help": action.help,
    }


def describe_parser(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``{"help": {name: --help text}, "actions": {name: [option descriptions]}}`` for
    ``spectra`` (name "spectra") and each subcommand."""
    parsers = {"spectra": parser, **_subparsers(parser)}
    help_texts, actions = {}, {}
    for name, sub in parsers.items():
        help_texts[name] = sub.format_help()
        described = []
        for group in sub._action_groups:
            for action in group._group_actions:
                if isinstance(action, argparse._SubParsersAction):
                    described.append({"subcommands": list(action.choices)})
                else:
                    described.append(_describe_action(action, group.title))
        actions[name] = described
    return {"help": help_texts, "actions": actions}


@pytest.fixture(scope="module")
def described() -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", COLUMNS)
        return describe_parser(build_parser())


@pytest.mark.parametrize("name", ["spectra", "analyze", "sharpness", "landscape", "plot"])
def test_help_text_unchanged(described, name):
    expected = (EXPECTED / f"{name}.txt").read_text(encoding="utf-8")
    assert described["help"][name] == expected


def test_options_defaults_and_types_unchanged(described):
    expected = json.loads((EXPECTED / "actions.json").read_text(encoding="utf-8"))
    assert set(described["actions"]) == set(expected)
    for name, actions in expected.items():
        assert described["actions"][name] == actions, name
