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


def test_unbuilt_command_refuses_and_names_its_issue(capsys, monkeypatch):
    # Every command is built today: an unbuilt one is put in for the test.
    monkeypatch.setattr(cli, "_COMMANDS", (*cli._COMMANDS, cli._Command("fleet", "x", pending_issue=21)))
    assert cli.main(["fleet", "--whatever"]) == 2
    err = capsys.readouterr().err
    assert "not built yet" in err and "issue #21" in err


def test_emulate_takes_the_script_after_its_options(monkeypatch, capsys):
    import prism.app.emulate as app_emulate

    seen = {}

    class Outcome:
        exit_code, summary = 0, {}

        def text(self):
            return "emulated"

    monkeypatch.setattr(app_emulate, "emulate", lambda config: seen.setdefault("config", config) and Outcome())
    assert cli.main(["emulate", "runs/x", "--sandbox", "0,5", "--", "-m", "pkg.train", "--tp", "2"]) == 0
    c = seen["config"]
    assert str(c.run) == "runs/x" and c.sandbox == "0,5" and list(c.command) == ["-m", "pkg.train", "--tp", "2"]
    assert "emulated" in capsys.readouterr().out


def test_calibrate_and_predict_name_what_is_wrong(tmp_path, capsys):
    assert cli.main(["calibrate", str(tmp_path)]) == 2
    assert f"prism calibrate: {tmp_path} has no graph to calibrate" in capsys.readouterr().err
    assert cli.main(["predict", str(tmp_path), "--calibration", "on"]) != 0
    assert "prism predict:" in capsys.readouterr().err
