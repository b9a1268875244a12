"""Campaign files (prism.core.campaign): the grid, point keys, errors that
name the key and its line; the result log (prism.shell.campaignstore)."""

import tomllib

import pytest

from prism.app.campaign import CampaignFileError, capture_command, load_campaign, whatif_of_point
from prism.core.campaign import CampaignError, parse_campaign
from prism.shell.campaignstore import ResultLog

BASE = """\
[campaign]
name = "t"

[capture]
command = ["-m", "prism.workloads.gpt", "--layers", "2"]
layout = ["tp=2,pp=2,dp=2", "tp=1,pp=2,dp=2"]

[model]
net = ["h200_nvlink_ib400", "zero"]
scale_dp = [2, 4, 8]
"""


def _parse(text, source="c.toml"):
    return parse_campaign(tomllib.loads(text), text, source)


def _error(text) -> str:
    with pytest.raises(CampaignError) as e:
        _parse(text)
    return str(e.value)


def test_every_list_is_a_dimension_and_captures_come_first():
    c = _parse(BASE.replace("[model]", "[capture.flags]\nseq_len = [8, 16]\nbatch = 2\n\n[model]"))
    assert list(c.dimensions.values()) == ["layout", "seq_len", "net", "scale_dp"]
    assert len(c.points) == 2 * 2 * 2 * 3
    assert c.distinct_captures() == 4
    # points of one capture run one after another
    caps = [p.capture_key for p in c.points]
    assert caps == sorted(caps, key=caps.index)
    p = c.points[0]
    assert p.values["capture.flags.batch"] == 2 and "capture.flags.batch" not in p.dims
    world, cmd = capture_command(p)
    assert world == 8 and cmd[-10:] == ["--tp", "2", "--pp", "2", "--dp", "2", "--seq-len", "8", "--batch", "2"]
    assert p.label == "layout=tp=2,pp=2,dp=2 seq_len=8 net=h200_nvlink_ib400 scale_dp=2"


def test_a_list_typed_key_sweeps_only_as_a_list_of_lists():
    c = _parse(BASE)
    assert "capture.command" not in c.dimensions
    c2 = _parse(BASE.replace('command = ["-m", "prism.workloads.gpt", "--layers", "2"]',
                             'command = [["-m", "prism.workloads.gpt"], ["-m", "prism.workloads.gpt", "--layers", "1"]]'))
    assert "capture.command" in c2.dimensions and len(c2.points) == 24


def test_point_keys_are_stable_and_cover_fixed_inputs():
    a, b = _parse(BASE), _parse(BASE)
    assert [p.key for p in a.points] == [p.key for p in b.points]
    assert len({p.key for p in a.points}) == 12
    # the same inputs written in another order give the same keys
    reordered = BASE.replace('net = ["h200_nvlink_ib400", "zero"]\nscale_dp = [2, 4, 8]',
                             'scale_dp = [2, 4, 8]\nnet = ["h200_nvlink_ib400", "zero"]')
    assert {p.key for p in _parse(reordered).points} == {p.key for p in a.points}
    # a fixed value changed: every key changes
    changed = _parse(BASE.replace('"--layers", "2"', '"--layers", "3"'))
    assert not {p.key for p in changed.points} & {p.key for p in a.points}


@pytest.mark.parametrize("edit, line, words", [
    (("scale_dp = [2, 4, 8]", "scale_dp = [2, 0, 8]"), 10, ["model.scale_dp", "positive integer", "got 0"]),
    (("scale_dp = [2, 4, 8]", "scale_dp = []"), 10, ["model.scale_dp", "empty list"]),
    (("net = [", "nett = ["), 9, ["model.nett", "unknown key", "allowed in [model]"]),
    (('layout = ["tp=2,pp=2,dp=2", ', 'layout = ["tp=2,pp=x,dp=2", '), 6, ["capture.layout", "tp=2,pp=x,dp=2"]),
    (("[model]", "[modle]"), 8, ["'modle'", "allowed tables"]),
    (('name = "t"', 'name = "a b"'), 2, ["campaign.name", "folder name"]),
    (("scale_dp = [2, 4, 8]", "scale_dp = [2, 4, 8]\n[whatif]\nthrottle_pct = 100"), 12,
     ["whatif.throttle_pct", "[0, 100)"]),
    (("scale_dp = [2, 4, 8]", "scale_dp = [2, 2]"), 10, ["repeats a value"]),
])
def test_errors_name_the_key_and_its_line(edit, line, words):
    msg = _error(BASE.replace(*edit))
    assert msg.startswith(f"c.toml:{line}: "), msg
    for w in words:
        assert w in msg, msg


def test_cross_checks_and_missing_keys():
    assert "campaign.name" in _error(BASE.replace('name = "t"\n', ""))
    assert "leave them out of the command" in _error(BASE.replace('"--layers", "2"', '"--tp", "2"'))
    assert "world_size" in _error(BASE.replace('layout = ["tp=2,pp=2,dp=2", "tp=1,pp=2,dp=2"]', ""))
    emu = BASE.replace('name = "t"', 'name = "t"\nstep = ["predict", "emulate"]') + "\n[whatif]\nstraggler_pct = 10\n"
    msg = _error(emu)
    assert "whatif.straggler_pct" in msg and "emulate step" in msg
    msg = _error(BASE + '\n[plot]\nx = "dp"\n')
    assert msg.startswith("c.toml:13:") and "not a dimension" in msg and "scale_dp" in msg


def test_syntax_errors_and_unreadable_files_are_usage_errors(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text(BASE.replace("scale_dp = [2, 4, 8]", "scale_dp == [2, 4]"))
    with pytest.raises(CampaignFileError, match=r"bad.toml: not valid TOML: .*line 10"):
        load_campaign(f)
    with pytest.raises(CampaignFileError, match="cannot read campaign file"):
        load_campaign(tmp_path / "missing.toml")


def test_whatif_keys_map_onto_the_knobs():
    c = _parse(BASE + "\n[whatif]\nstraggler_rank = 3\nstraggler_pct = [0, 20]\nthrottle_ranks = \"0-1\"\n"
                      "throttle_pct = 10\nlink_slowdown = 2.0\nlink_tier = \"inter\"\nmemory_limit_gib = 40\n")
    w0 = whatif_of_point(c.points[0])
    w1 = whatif_of_point(c.points[1])
    assert w0.straggler == () and w1.straggler == ((3, 20.0),)
    assert w1.throttle == ((0, 1), 10) and w1.link == (2.0, "inter") and w1.memory_limit_gib == 40


def test_result_log_survives_a_torn_last_line(tmp_path):
    log = ResultLog(tmp_path / "points.jsonl")
    log.append({"key": "a", "status": "ok"})
    with open(log.path, "a") as f:
        f.write('{"key": "b", "sta')  # killed mid-write
    assert set(log.read()) == {"a"}
    log.append({"key": "c", "status": "ok"})
    assert set(log.read()) == {"a", "c"}
    assert log.path.read_text().count("\n") == 2


def test_failed_points_are_rows_and_a_rerun_skips_or_retries_them(tmp_path):
    from prism.app.campaign import CampaignConfig, run_campaign

    f = tmp_path / "c.toml"
    f.write_text(f'[campaign]\nname = "f"\n[capture]\nrun = "{tmp_path / "nothing"}"\n[model]\nscale_dp = [2, 4]\n')
    events = []
    res = run_campaign(CampaignConfig(file=f, out=tmp_path / "out", on_event=events.append))
    assert res.exit_code == 1 and res.ran == 2 and len(res.failed) == 2
    assert "cannot read run" in res.failed[0]["message"]
    assert [e.kind for e in events] == ["start", "done", "start", "done", "tables"]
    assert res.csv_path.read_text().count("\n") == 3 and res.plot_path.is_file()
    again = run_campaign(CampaignConfig(file=f, out=tmp_path / "out"))
    assert again.ran == 0 and again.skipped == 2 and again.exit_code == 1
    retried = run_campaign(CampaignConfig(file=f, out=tmp_path / "out", retry_failed=True))
    assert retried.ran == 2 and retried.skipped == 0
