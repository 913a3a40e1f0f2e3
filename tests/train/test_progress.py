"""Progress without a terminal: a plain line every N steps, its ETA timed from after the first step."""
import re

from k3jax.training import metrics
from k3jax.training.metrics import Progress


def test_plain_lines_every_n_steps_with_an_eta_that_leaves_out_the_first_step(capsys, monkeypatch):
    clock = iter([100.0, 101.0, 102.0, 103.0, 104.0, 105.0])   # after the first step (compiling), 1 s a step
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    progress = Progress(True, 0, 10, 2)          # enabled, but stderr is not a terminal under pytest
    progress.update(1, 3.0, 1000.0)              # step 1: starts the clock
    for _ in range(5):
        progress.update(1, 2.5, 2000.0)          # steps 2-6, 1 s each
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert [re.match(r"step (\d+)/10 ", line).group(1) for line in lines] == ["2", "4", "6"]
    assert lines[0] == "step 2/10  loss 2.5000  2,000 tok/s  ETA 0:00:08"      # 8 steps left at 1 s each
    assert lines[-1].endswith("ETA 0:00:04")


def test_records_and_summaries_with_non_finite_values_are_strict_json():
    import json

    import numpy as np

    summary = {"heldout_bits_per_byte": float("nan"), "loss": np.float32(np.inf), "by_layer": [1.0, -np.inf],
               "nested": {"x": np.array([np.nan, 2.0])}}
    text = json.dumps(metrics.jsonable(summary), allow_nan=False)   # raises on a bare NaN / Infinity
    assert json.loads(text) == {"heldout_bits_per_byte": "nan", "loss": "inf", "by_layer": [1.0, "-inf"],
                                "nested": {"x": ["nan", 2.0]}}
