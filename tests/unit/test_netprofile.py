"""``prism netprofile`` without measuring: the alpha-beta fit (prism.core.netfit),
the profile TOML it writes and reads back, the profile ``prism predict``
picks, and the command's refusals (real measurements over gloo and NCCL:
tests/integration/test_netprofile_measure.py)."""

import numpy as np
import pytest

from prism import cli
import prism.app.predict as app_predict
from prism.core.costmodel import parse_profile
from prism.core.trace import Manifest
from prism.app.netprofile import fitted_profile_path
from tests.support.gpus import cuda_device_count
from prism.core.netfit import Fit, Point, fit_per_op, fit_points, predict_seconds, profile_toml, relative_errors

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single", "send")


def _points(fit: Fit, noise: float = 0.0, seed: int = 0) -> list[Point]:
    grid = [Point(op, n, b, 1.0) for op in OPS for n in (2, 4) for b in (1 << 10, 1 << 16, 1 << 20, 1 << 24)
            if not (op == "send" and n != 2)]
    t = predict_seconds(fit, grid)
    rng = np.random.default_rng(seed)
    t = t * (1 + noise * rng.uniform(-1, 1, len(t)))
    return [Point(p.op, p.n, p.nbytes, float(x)) for p, x in zip(grid, t)]


def test_fit_recovers_alpha_beta_exactly_from_exact_points():
    truth = Fit(base_latency=30e-6, latency=12e-6, bandwidth=2.5e9)
    got = fit_points(_points(truth))
    assert got.base_latency == pytest.approx(truth.base_latency, rel=1e-6)
    assert got.latency == pytest.approx(truth.latency, rel=1e-6)
    assert got.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)
    assert relative_errors(got, _points(truth)).max() < 1e-9


def test_fit_with_noise_stays_close_and_reports_the_error():
    truth = Fit(30e-6, 12e-6, 2.5e9)
    pts = _points(truth, noise=0.05)
    got = fit_points(pts)
    assert got.bandwidth == pytest.approx(truth.bandwidth, rel=0.1)
    assert got.base_latency + got.latency == pytest.approx(truth.base_latency + truth.latency, rel=0.2)
    err = relative_errors(got, pts)
    assert 0 < np.median(err) < 0.05 and err.max() < 0.12


def test_fit_never_returns_negative_parameters():
    truth = Fit(0.0, 20e-6, 1e9)  # no base latency at all
    pts = _points(truth, noise=0.05, seed=3)
    got = fit_points(pts)
    assert got.base_latency >= 0 and got.latency >= 0 and got.bandwidth > 0


def test_fit_needs_three_points():
    with pytest.raises(ValueError, match="at least 3 measured points"):
        fit_points([Point("all_reduce", 2, 1024, 1e-4)])


def test_profile_toml_parses_and_predicts_what_the_fit_predicts():
    fit = Fit(30e-6, 12e-6, 2.5e9)
    pts = _points(fit)
    text = profile_toml(fit, pts, host="h", backend="gloo", ranks_per_node=2, command="x", date="2026-12-02T00:00:00Z",
                        measured=False)
    model = parse_profile(text, "p.toml")
    assert model.name == "gloo-h" and "fit error median" in model.description
    for p, t in zip(pts, predict_seconds(fit, pts)):
        ns = model.p2p_ns(p.nbytes, 0, 1) if p.op == "send" else model.collective_ns(p.op, p.nbytes, list(range(p.n)))
        assert ns == pytest.approx(t * 1e9, abs=2)


def test_per_op_fits_recover_each_ops_parameters_and_round_trip_through_the_profile():
    truth = {op: Fit(20e-6 + 5e-6 * i, 3e-6 * i, 1e9 * (i + 1)) for i, op in enumerate(OPS)}
    pts = [q for op, f in truth.items() for q in _points(f) if q.op == op]
    one = fit_points(pts)
    per_op = fit_per_op(pts)
    assert sorted(per_op) == sorted(OPS)
    for op, f in truth.items():
        assert per_op[op].bandwidth == pytest.approx(f.bandwidth, rel=1e-6)
        assert per_op[op].base_latency + per_op[op].latency == pytest.approx(f.base_latency + f.latency, rel=1e-6)
    assert relative_errors(one, pts, per_op).max() < 1e-6 < relative_errors(one, pts).max()
    text = profile_toml(one, pts, host="h", backend="nccl", ranks_per_node=4, command="x", date="2026-12-02T00:00:00Z",
                        per_op=per_op, measured=False)
    model = parse_profile(text, "p.toml")
    assert dict(model.per_op).keys() == set(OPS)
    for p, t in zip(pts, predict_seconds(one, pts, per_op)):
        ns = model.p2p_ns(p.nbytes, 0, 1) if p.op == "send" else model.collective_ns(p.op, p.nbytes, list(range(p.n)))
        assert ns == pytest.approx(t * 1e9, abs=2)
    # A family member takes its measured op's parameters (recv as send, all_gather as all_gather_into_tensor).
    assert model.collective_ns("all_gather", 1 << 20, [0, 1]) == model.collective_ns("all_gather_into_tensor",
                                                                                     1 << 20, [0, 1])


def test_measured_points_correct_the_model_per_op_size_and_group_size():
    # Measured times that no alpha-beta form fits: the profile reproduces them
    # at the measured points and interpolates in log(bytes) between them.
    fit = Fit(30e-6, 12e-6, 2.5e9)
    pts = [Point("all_reduce", n, b, t) for n, b, t in
           [(2, 1024, 50e-6), (2, 1 << 20, 900e-6), (2, 1 << 24, 30e-3), (4, 1024, 150e-6), (4, 1 << 20, 2e-3)]]
    pts += [Point("send", 2, b, t) for b, t in [(1024, 20e-6), (1 << 20, 500e-6)]]
    text = profile_toml(fit, pts, host="h", backend="gloo", ranks_per_node=8, command="x", date="2026-12-02T00:00:00Z")
    assert text.count("[[measured]]") == 3
    model = parse_profile(text, "p.toml")
    for p in pts:
        ns = model.p2p_ns(p.nbytes, 0, 1) if p.op == "send" else model.collective_ns(p.op, p.nbytes, list(range(p.n)))
        assert ns == pytest.approx(p.seconds * 1e9, rel=1e-5)
    bare = parse_profile(profile_toml(fit, pts, host="h", backend="gloo", ranks_per_node=8, command="x",
                                      date="2026-12-02T00:00:00Z", measured=False), "q.toml")
    # between two measured sizes: between their corrections
    mid = model.collective_ns("all_reduce", 1 << 15, [0, 1])
    r_lo = 50e-6 / (bare.collective_ns("all_reduce", 1024, [0, 1]) / 1e9)
    r_hi = 900e-6 / (bare.collective_ns("all_reduce", 1 << 20, [0, 1]) / 1e9)
    r_mid = mid / bare.collective_ns("all_reduce", 1 << 15, [0, 1])
    assert min(r_lo, r_hi) < r_mid < max(r_lo, r_hi)
    # a group size not measured takes the nearest one's correction (8 -> 4)
    r8 = model.collective_ns("all_reduce", 1024, list(range(8))) / bare.collective_ns("all_reduce", 1024, list(range(8)))
    r4 = 150e-6 / (bare.collective_ns("all_reduce", 1024, list(range(4))) / 1e9)
    assert r8 == pytest.approx(r4, rel=1e-4)  # both rounded to whole ns
    # an op never measured keeps the fitted form; a group spanning nodes too
    assert model.collective_ns("broadcast", 1024, [0, 1]) == bare.collective_ns("broadcast", 1024, [0, 1])
    assert model.collective_ns("all_reduce", 1024, [0, 8]) == bare.collective_ns("all_reduce", 1024, [0, 8])


#: A profile with only its required keys, for the error tests.
BASE = 'name = "x"\nranks_per_node = 2\n[intra]\nbandwidth_GBps = 1\nlatency_us = 1\n' \
       '[inter]\nbandwidth_GBps = 1\nlatency_us = 1\n'


def test_measured_tables_errors_name_the_key():
    with pytest.raises(ValueError, match="'measured\\[0\\].op' has value 'allreduce'"):
        parse_profile(BASE + '[[measured]]\nop = "allreduce"\nranks = 2\nbytes = [1]\nus = [1]\n', "p.toml")
    with pytest.raises(ValueError, match="as many 'us' as 'bytes'"):
        parse_profile(BASE + '[[measured]]\nop = "send"\nranks = 2\nbytes = [1, 2]\nus = [1]\n', "p.toml")
    with pytest.raises(ValueError, match="ascending distinct"):
        parse_profile(BASE + '[[measured]]\nop = "send"\nranks = 2\nbytes = [2, 1]\nus = [1, 1]\n', "p.toml")


def test_profile_op_table_errors_name_the_key():
    with pytest.raises(ValueError, match="'ops.allreduce': unknown op"):
        parse_profile(BASE + "[ops.allreduce]\nbase_latency_us = 1\nlatency_us = 1\nbandwidth_GBps = 1\n", "p.toml")
    with pytest.raises(ValueError, match="missing key 'ops.send.bandwidth_GBps'"):
        parse_profile(BASE + "[ops.send]\nbase_latency_us = 1\nlatency_us = 1\n", "p.toml")
    with pytest.raises(ValueError, match="'ops.send.bandwidth_GBps' has value 0"):
        parse_profile(BASE + "[ops.send]\nbase_latency_us = 1\nlatency_us = 1\nbandwidth_GBps = 0\n", "p.toml")


def test_fitted_profile_path_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PRISM_PROFILE_DIR", str(tmp_path))
    assert fitted_profile_path("gloo", "box") == tmp_path / "gloo-box.toml"
    monkeypatch.delenv("PRISM_PROFILE_DIR")
    assert fitted_profile_path("gloo", "box").parts[-3:] == ("prism", "profiles", "gloo-box.toml")


def test_predict_uses_the_fitted_profile_of_the_runs_host(monkeypatch, tmp_path):
    monkeypatch.setenv("PRISM_PROFILE_DIR", str(tmp_path))
    m = Manifest(1, "r", 4, 0, ("x",), "cpu", "0", "0", "box")
    model, why = app_predict.resolve_profile(None, m)
    assert model.name == "h200_nvlink_ib400" and "no fitted profile at" in why and "gloo-box.toml" in why
    assert "far too cheap" in why  # a CPU run told that the shipped profile is a GPU one
    _, why_gpu = app_predict.resolve_profile(None, Manifest(1, "r", 4, 0, ("x",), "cuda", "0", "0", "box"))
    assert "nccl-box.toml" in why_gpu and "far too cheap" not in why_gpu
    fit = Fit(30e-6, 12e-6, 2.5e9)
    (tmp_path / "gloo-box.toml").write_text(profile_toml(fit, _points(fit), host="box", backend="gloo",
                                                         ranks_per_node=2, command="x", date="2026-12-02T00:00:00Z"))
    model, why = app_predict.resolve_profile(None, m)
    assert model.name == "gloo-box" and "fitted by `prism netprofile`" in why
    model, why = app_predict.resolve_profile("zero", m)
    assert model.name == "zero" and why == "given with --net"
    # A script that takes CUDA when it is there names no device: the manifest
    # guessed cpu, the ranks' trace shows CUDA memory, so NCCL's profile.
    from prism.core.trace import Memory

    ranks = {0: [Memory(t_ns=1, device="cuda:0", allocated=1, reserved=2, peak_allocated=1, step=0)]}
    assert app_predict.traced_device_kind(ranks) == "cuda"
    assert app_predict.traced_device_kind({0: []}) is None
    _, why = app_predict.resolve_profile(None, m, app_predict.traced_device_kind(ranks))
    assert "nccl-box.toml" in why


def test_netprofile_refuses_more_ranks_than_cores(capsys):
    assert cli.main(["netprofile", "--group-sizes", "100000"]) == 2
    assert "must be in 2.." in capsys.readouterr().err


@pytest.mark.skipif(cuda_device_count() >= 2, reason="checks the refusal on a machine with fewer than 2 GPUs")
def test_netprofile_nccl_needs_two_gpus(capsys):
    assert cli.main(["netprofile", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "--backend nccl needs at least 2 GPUs" in err and "torch sees" in err


def test_issue_times_round_trip_per_op_and_a_ping_pong_gets_none():
    # NCCL points carry the CPU time per call; send's ping-pong holds both sides' CPU already.
    fit = Fit(10e-6, 0.0, 300e9)
    pts = [Point(p.op, p.n, p.nbytes, p.seconds, None if p.op == "send" else 20e-6 + 10e-6 * OPS.index(p.op))
           for p in _points(fit)]
    text = profile_toml(fit_points(pts), pts, host="h", backend="nccl", ranks_per_node=4, command="x", date="2026-12-02T00:00:00Z",
                        per_op=fit_per_op(pts))
    assert "issue 20.0" in text and "CPU time per call" in text
    model = parse_profile(text, "p.toml")
    assert model.issue_ns("all_reduce") == 20_000 and model.issue_ns("all_gather") == 30_000
    assert model.issue_ns("all_to_all_single") == 60_000 and model.issue_ns("send") == model.issue_ns("recv") == 0
    assert model.issue == pytest.approx(40e-6)  # median over the points that have one
    assert parse_profile(BASE, "p.toml").issue_ns("all_reduce") == 0
    with pytest.raises(ValueError, match="'issue_us' has value -1"):
        parse_profile("issue_us = -1\n" + BASE, "p.toml")
    with pytest.raises(ValueError, match="'ops.send.issue_us' has value 'a'"):
        parse_profile(BASE + '[ops.send]\nbase_latency_us = 1\nlatency_us = 1\nbandwidth_GBps = 1\nissue_us = "a"\n',
                      "p.toml")


def test_netprofile_concurrent_checks_its_world(capsys, monkeypatch):
    from prism.app import netprofile as app_np

    monkeypatch.setattr(app_np, "usable_cores", lambda: 8)
    plan = app_np.plan_netprofile(app_np.NetprofileConfig(concurrent=8))
    assert plan.concurrent == 8 and plan.group_sizes == (2, 4, 8) and "--concurrent 8" in plan.command
    assert app_np.plan_netprofile(app_np.NetprofileConfig(concurrent=6)).group_sizes == (2,)
    for argv, msg in ((["--concurrent", "6", "--group-sizes", "4"], "group size 4 does not divide it"),
                      (["--concurrent", "16"], "must be in 2..8"),
                      (["--concurrent", "4", "--backend", "nccl"], "--concurrent is for gloo")):
        monkeypatch.setattr(app_np, "gpu_count", lambda: 8)
        assert cli.main(["netprofile", *argv]) == 2
        assert msg in capsys.readouterr().err


def test_netprofile_gap_is_for_gloo_and_goes_into_the_command(capsys, monkeypatch):
    from prism.app import netprofile as app_np

    monkeypatch.setattr(app_np, "usable_cores", lambda: 8)
    plan = app_np.plan_netprofile(app_np.NetprofileConfig(concurrent=8, gap_us=500))
    assert plan.gap_us == 500 and plan.command.endswith("--concurrent 8 --gap-us 500")
    assert "--gap-us" not in app_np.plan_netprofile(app_np.NetprofileConfig()).command
    monkeypatch.setattr(app_np, "gpu_count", lambda: 8)
    for argv, msg in ((["--gap-us", "500", "--backend", "nccl"], "--gap-us is for gloo"),
                      (["--gap-us", "-3"], "--gap-us -3 must be more than 0")):
        assert cli.main(["netprofile", *argv]) == 2
        assert msg in capsys.readouterr().err


def test_profile_toml_says_the_points_were_concurrent():
    fit = Fit(10e-6, 0.0, 300e9)
    pts = _points(fit)
    text = profile_toml(fit, pts, host="h", backend="gloo", ranks_per_node=16, command="x",
                        date="2026-12-02T00:00:00Z", concurrent=16)
    assert "# Concurrent: 16 ranks" in text
    assert "(16 ranks at once)" in parse_profile(text, "p.toml").description
