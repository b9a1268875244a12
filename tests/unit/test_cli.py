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


def test_calibrate_packs_unless_told_not_to(monkeypatch):
    import prism.app.calibrate as app_calibrate

    seen = []

    class Result:
        manifest: dict = {}

        def text(self):
            return "calibrated"

    monkeypatch.setattr(app_calibrate, "calibrate", lambda config: seen.append(config) or Result())
    for argv, pack in ((["calibrate", "runs/x"], None), (["calibrate", "runs/x", "--no-pack"], False),
                       (["calibrate", "runs/x", "--pack", "--gpus", "0,1"], True)):
        assert cli.main(argv) == 0
        assert seen[-1].pack is pack
    assert app_calibrate._packs(seen[0]) is True and seen[-1].gpus == "0,1"


def test_calibrate_and_predict_name_what_is_wrong(tmp_path, capsys):
    assert cli.main(["calibrate", str(tmp_path)]) == 2
    assert f"prism calibrate: {tmp_path} has no graph to calibrate" in capsys.readouterr().err
    assert cli.main(["predict", str(tmp_path), "--calibration", "on"]) != 0
    assert "prism predict:" in capsys.readouterr().err


def test_run_passes_the_scale_out_to_predict_and_emulate(monkeypatch, tmp_path, capsys):
    import prism.app.capture as app_capture
    import prism.app.emulate as app_emulate
    import prism.app.predict as app_predict

    seen = {}

    class Captured:
        ok, exit_code = True, 0

        class result:
            steps_done, wall_s = 3, 1.0

        def text(self):
            return "captured"

    class Predicted:
        def text(self):
            return "predicted"

    class Emulated:
        exit_code, summary = 0, {}

        def text(self):
            return "emulated"

    monkeypatch.setattr(app_capture, "capture", lambda plan: seen.setdefault("plan", plan) and Captured())
    monkeypatch.setattr(app_predict, "predict", lambda config: seen.setdefault("predict", config) and Predicted())
    monkeypatch.setattr(app_emulate, "emulate", lambda config: seen.setdefault("emulate", config) and Emulated())
    argv = ["run", "-n", "4", "--out", str(tmp_path / "r"), "--sandbox", "0", "--scale-dp", "64",
            "--layout", "tp=2,pp=1,dp=2", "--", "-m", "prism.workloads.gpt", "--tp", "2", "--dp", "2"]
    assert cli.main(argv) == 0
    assert (seen["predict"].scale_dp, seen["predict"].layout) == (64, "tp=2,pp=1,dp=2")
    assert (seen["emulate"].scale_dp, seen["emulate"].layout, seen["emulate"].sandbox) == (64, "tp=2,pp=1,dp=2", "0")
    assert seen["plan"].config.world_size == 4 and "emulating at dp 64" in capsys.readouterr().err
