"""The ``prism`` command line in-process: --help lists every command, unbuilt
commands refuse and name their issue (``python -m prism`` itself:
tests/integration/test_cli_commands.py)."""

import pytest

from prism import cli


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in cli._COMMANDS:
        assert cmd.name in out


@pytest.mark.parametrize("name", [c.name for c in cli._COMMANDS if c.build is None])
def test_unbuilt_command_refuses_and_names_its_issue(name, capsys):
    assert cli.main([name, "--whatever"]) == 2
    err = capsys.readouterr().err
    assert "not built yet" in err
    assert "issue #" in err or "phase 2" in err
