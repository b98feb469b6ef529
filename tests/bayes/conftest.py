"""Shared data for the Bayesian backend tests: a conjugate normal problem with an analytic posterior."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("numpyro")

N = 50
Y = np.random.default_rng(0).normal(1.5, 1.0, size=N).astype(np.float32)
#: Prior Normal(0, 1), noise sd 1: the posterior of mu is Normal(sum(y) / (1 + n), (1 + n) ** -0.5).
POST_MEAN = float(Y.astype(np.float64).sum() / (1 + N))
POST_SD = float((1 + N) ** -0.5)


def stage_model(run_dir: Path, stage: str) -> Any:
    """The trained model a finished stage recorded in its ``final.json`` (a relative registry root made absolute)."""
    from pipekit_train import load_model

    uri = json.loads((run_dir / stage / "final.json").read_text())["model_uri"]
    if "root=" in uri and not uri.split("root=", 1)[1].startswith("/"):
        uri = uri.split("?", 1)[0] + "?root=" + str(run_dir / uri.split("root=", 1)[1])
    return load_model(uri)
