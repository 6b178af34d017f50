"""`calibrated`: a cluster's device speeds fitted to what serving workers measure (the
autoscaler's live model)."""

import pytest

from pdserve.sim.calibration import calibrated
from pdserve.sim.deployment import Cluster
from pdserve.sim.hardware import get_gpu, get_link
from pdserve.sim.latency import Batch
from pdserve.sim.models import get_model


def test_calibrated_reproduces_the_measured_speeds():
    cluster = Cluster(get_model("llama-3.1-8b"), get_gpu("h100"), get_link("ib-ndr"))
    prompt, tok_s, batch, context, step_s = 2048, 9000.0, 16, 1024, 0.030
    fitted = calibrated(cluster, prompt, tok_s, batch, context, step_s)
    lat = fitted.latency(1)
    assert prompt / lat.prefill(prompt) == pytest.approx(tok_s, rel=0.05)
    step = Batch(batch, batch, 0, batch * context, batch)
    assert lat.iteration(step) == pytest.approx(step_s, rel=0.05)
    # A speed not measured keeps its factor.
    only_prefill = calibrated(cluster, prompt, tok_s, batch, context, None)
    assert only_prefill.accel.mem_bytes_per_s == cluster.accel.mem_bytes_per_s
