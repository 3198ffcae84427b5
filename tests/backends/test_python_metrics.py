"""pb_utils custom metric families: shared by name, owned by the model instances that made them,
gone when the last one unloads (the e2e test checks the exported text against Triton's)."""

from __future__ import annotations

import pytest

from pier.backends.python import triton_python_backend_utils as pb_utils


def _made_by(owner: object, name: str, kind: int) -> pb_utils.MetricFamily:
    pb_utils._owner.current = owner
    try:
        return pb_utils.MetricFamily(name=name, description="d", kind=kind)
    finally:
        pb_utils._owner.current = None


def test_families_are_shared_by_name_and_released_with_their_last_owner() -> None:
    a, b = object(), object()
    fa = _made_by(a, "unit_shared", pb_utils.MetricFamily.GAUGE)
    fb = _made_by(b, "unit_shared", pb_utils.MetricFamily.GAUGE)
    fa.Metric(labels={"x": "1"}).set(3)
    assert fb.Metric(labels={"x": "1"}).value() == 3  # the same family, the same series
    assert "unit_shared{x=\"1\"} 3" in pb_utils.render_metric_families(a)
    assert pb_utils.render_metric_families(b) == ""  # rendered once, by its first holder
    with pytest.raises(pb_utils.TritonModelException, match="another kind"):
        _made_by(a, "unit_shared", pb_utils.MetricFamily.COUNTER)
    pb_utils.release_metric_families(a)
    assert "unit_shared" in pb_utils.render_metric_families(b)  # b holds it now
    pb_utils.release_metric_families(b)
    assert "unit_shared" not in pb_utils._families


def test_label_values_are_escaped_and_bad_definitions_refused() -> None:
    """As Triton 2.51 (prometheus-cpp) writes and refuses them."""
    owner = object()
    family = _made_by(owner, "unit_escaped", pb_utils.MetricFamily.GAUGE)
    family.Metric(labels={"q": 'a"b', "n": "x\ny", "bs": "c\\d"}).set(1)
    assert 'unit_escaped{bs="c\\\\d",n="x\\ny",q="a\\"b"} 1\n' in pb_utils.render_metric_families(owner)
    for make, text in ((lambda: _made_by(owner, "bad name", pb_utils.MetricFamily.GAUGE), "Invalid metric name"),
                       (lambda: family.Metric(labels={"bad-key": "v"}), "Invalid label name"),
                       (lambda: family.Metric(labels={"k": 3}), "must be a string"),
                       (lambda: _made_by(owner, "unit_hist", pb_utils.MetricFamily.HISTOGRAM).Metric(buckets=[2, 1]),
                        "strictly sorted")):
        with pytest.raises(pb_utils.TritonModelException, match=text):
            make()
    pb_utils.release_metric_families(owner)
