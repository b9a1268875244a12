import subprocess
import sys

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


def test_python_dash_m_prism_runs():
    r = subprocess.run([sys.executable, "-m", "prism", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    assert "capture" in r.stdout
