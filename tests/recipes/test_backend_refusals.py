"""The recipe fields are refused, in one line before anything compiles, on backends that do not honour them."""

from __future__ import annotations

import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import SAM, ArraySource, ParamGroup, TrainingDataset, TrainingLoop
from pipekit_train.stage.preflight import check_pipeline

pytest.importorskip("numpyro")
from pipekit_train.adapters.numpyro import NumpyroGuide, Trace_ELBO


def _svi(**changes) -> TrainingLoop:
    y = np.random.default_rng(0).normal(1.0, 1.0, size=(20,)).astype(np.float32)
    fields = dict(
        model_op=NumpyroGuide(model="conjugate_normal", guide="AutoNormal"),
        dataset=TrainingDataset(source=ArraySource(arrays={"y": y})),
        loss=Trace_ELBO(),
        optimizer_config={"name": "adam", "lr": 0.05},
        backend="numpyro-svi",
        batch_size=20,
        max_steps=10,
        progress=False,
        name="svi",
    )
    fields.update(changes)
    return TrainingLoop(**fields)


@pytest.mark.parametrize(
    "field,value",
    [
        ("gradient", SAM(rho=0.05)),
        ("param_groups", (ParamGroup(pattern="*"),)),
        ("diagnostics", True),
        ("carry", {"optimizer_state": True}),
    ],
)
def test_numpyro_svi_refuses_recipe_fields(field, value):
    with pytest.raises(ConfigError, match=rf"stage 'svi': backend 'numpyro-svi' cannot honour TrainingLoop.{field} "):
        check_pipeline(_svi(**{field: value}))
    # The remedy names the installed backends whose capabilities list it, not a hard-coded one.
    with pytest.raises(ConfigError, match=r"train this stage with a backend that can \(equinox\)"):
        check_pipeline(_svi(**{field: value}))
