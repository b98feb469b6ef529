"""Shared data for the Bayesian backend tests: a conjugate normal problem with an analytic posterior."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numpyro")

N = 50
Y = np.random.default_rng(0).normal(1.5, 1.0, size=N).astype(np.float32)
#: Prior Normal(0, 1), noise sd 1: the posterior of mu is Normal(sum(y) / (1 + n), (1 + n) ** -0.5).
POST_MEAN = float(Y.astype(np.float64).sum() / (1 + N))
POST_SD = float((1 + N) ** -0.5)
