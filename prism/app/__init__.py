"""The library API: what the commands do, callable from a campaign or a test.

Each function takes a config object and returns a result object; none
prints. Problems with the caller's input raise ``prism.app.errors.PrismError``
(its ``exit_code`` is what the command line exits with); a capture that fails
(mismatch, deadlock, failed rank) is a result, not an exception.

    from prism.app.capture import CaptureConfig, capture
    from prism.app.predict import PredictConfig, predict

    out = capture(CaptureConfig(world_size=16, command=["-m", "prism.workloads.gpt", "--tp", "2", "--pp", "2"],
                                out="runs/gpt", show_ranks="none", progress="off"))
    if out.ok:
        print(predict(PredictConfig(run=out.run_dir, warmup=1)).mean_iteration_ns / 1e6, "ms")

Modules (each named for its command; import the function from its module):
``capture`` (capture a script; a standalone coordinator), ``predict``
(replay a run under a cost model), ``report`` (Perfetto, plot, Chakra ET),
``netprofile`` (measure and fit a cost profile), ``trace`` (read, summarise,
validate a run), ``emulate`` (sandbox ranks against virtual ones),
``calibrate`` (slice calibration of a run's compute durations), ``errors``.
"""
