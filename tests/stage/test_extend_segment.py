"""`extend --new-segment` needs a backend that can restart its learning-rate schedule (the `schedule_segment`
capability); any other is refused in one line before the extension writes anything. The backend here is the
reference NumPy backend (tests/backends/numpy_linear), which does not list the capability."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import Checkpoint, Last, TrainingLoop, run_settings
from pipekit_train.data import ArraySource, TrainingDataset
from pipekit_train.losses import MSE
from pipekit_train.stage import extend


def test_new_segment_on_a_backend_without_schedule_segment_is_refused_before_anything_is_written(tmp_path):
    backends = str(Path(__file__).resolve().parents[1] / "backends")
    if backends not in sys.path:  # imported as the conformance kit imports it (one registration per process)
        sys.path.insert(0, backends)
    import numpy_linear

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 2)).astype(np.float32)
    loop = TrainingLoop(
        model_op=numpy_linear.NumpyLinear(in_size=2),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": x @ np.ones((2, 1), np.float32)})),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        batch_size=8,
        max_steps=4,
        callbacks=(Checkpoint(every_n_steps=4, keep=(Last(n=1),), async_save=False),),
        progress=False,
        name="fit",
    )
    run = tmp_path / "run"
    with run_settings(run_dir=str(run), store=False):
        loop.run()
    with pytest.raises(ConfigError) as e:
        extend(str(run), "fit", 4, loop=loop, store=False, new_segment=True)
    from pipekit_train.backends import backends_with

    able = backends_with("schedule_segment")  # equinox, lightning, and flax with the flax extra
    assert {"equinox", "lightning"} <= set(able)
    assert str(e.value) == (
        "extend: backend 'numpy-linear' of stage 'fit' cannot restart its learning-rate schedule (it does not list "
        f"the schedule_segment capability), so new_segment is refused; backends that can: {', '.join(able)}"
    )
    assert not (run / "fit-extend1").exists()  # no extension stage was started
    _, artifact = extend(str(run), "fit", 4, loop=loop, store=False)  # a constant rate extends exactly
    assert artifact.user["extension"]["exact"] is True
