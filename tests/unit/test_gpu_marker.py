"""tests/conftest.py's ``gpu`` marker: which GPU counts skip, and the reason
each skip gives (the count torch reports is replaced, so every case runs
on any machine)."""

import pytest

import tests.conftest as conftest


@pytest.mark.parametrize(("mark", "have", "reason"), [
    (pytest.mark.gpu, 0, "needs a CUDA device"),
    (pytest.mark.gpu, 1, None),
    (pytest.mark.gpu(reason="measures GPU busy time"), 0, "needs a CUDA device: measures GPU busy time"),
    (pytest.mark.gpu(2), 1, "needs 2 GPUs"),
    (pytest.mark.gpu(2, reason="NCCL between processes"), 0, "needs 2 GPUs: NCCL between processes"),
    (pytest.mark.gpu(2, reason="NCCL between processes"), 2, None),
    (pytest.mark.gpu(2), 8, None),
])
def test_gpu_mark_skips_with_its_reason_where_too_few_gpus(monkeypatch, mark, have, reason):
    monkeypatch.setattr(conftest, "cuda_device_count", lambda: have)
    assert conftest._gpu_skip(mark.mark) == reason


@pytest.mark.parametrize("mark", [pytest.mark.gpu(0), pytest.mark.gpu("2"), pytest.mark.gpu(True),
                                  pytest.mark.gpu(1, 2), pytest.mark.gpu(count=2)])
def test_a_malformed_gpu_mark_is_a_usage_error(monkeypatch, mark):
    monkeypatch.setattr(conftest, "cuda_device_count", lambda: 8)
    with pytest.raises(pytest.UsageError, match="pytest.mark.gpu"):
        conftest._gpu_skip(mark.mark)


class _Item:
    """What pytest_collection_modifyitems reads of an item, and the marks it adds."""

    def __init__(self, path, gpu=None):
        self.path, self.gpu, self.added = path, gpu, []

    def get_closest_marker(self, name):
        return self.gpu if name == "gpu" else None

    def add_marker(self, mark):
        self.added.append(mark.mark)


def test_items_under_tests_integration_get_the_integration_marker_and_gpu_items_a_skip(monkeypatch):
    monkeypatch.setattr(conftest, "cuda_device_count", lambda: 0)
    root = conftest._INTEGRATION.parent
    items = [_Item(root / "integration" / "test_capture.py"), _Item(root / "unit" / "test_trace.py"),
             _Item(root / "unit" / "test_x.py", gpu=pytest.mark.gpu(reason="why").mark)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [[(m.name, m.kwargs) for m in it.added] for it in items] == [
        [("integration", {})], [], [("skip", {"reason": "needs a CUDA device: why"})]]
