"""docs/reference/cli.md is generated from the click definitions (scripts/gen_cli_docs.py):
the committed file must equal a fresh generation, so an option added or changed in the
code shows in the reference or fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_cli_reference_is_the_generated_one():
    gen = _generator()
    committed = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert committed == gen.generate(), "docs/reference/cli.md is stale: run python scripts/gen_cli_docs.py"


def test_the_cli_reference_names_every_command_and_option():
    """The generator walks the whole group: every subcommand (report's too) and every
    option of `run` appears, so a walk that stopped early cannot pass."""
    from numbisect.cli import cli

    text = _generator().generate()
    for name, cmd in cli.commands.items():
        assert f"## `bisect {name}`" in text
        for sub in getattr(cmd, "commands", {}):
            assert f"## `bisect {name} {sub}`" in text
    for p in cli.commands["run"].params:
        for opt in getattr(p, "opts", []):
            if opt.startswith("--"):
                assert f"`{opt}`" in text, opt
