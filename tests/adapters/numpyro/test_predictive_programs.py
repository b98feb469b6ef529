"""The predictive draws and observed data a finished sampler stage records come from one compiled program per
model and argument structure, with the data as its arguments: a later stage of the same model (an extension, the
next stage of a sweep or of a notebook) compiles nothing for them, and a model that reads a data value while it is
traced is still served (as a closure over its arguments)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest

numpyro = pytest.importorskip("numpyro")
dist = numpyro.distributions

from pipekit_train.adapters.bayes._predictive import predictive_groups  # noqa: E402


def _regression(x: Any, y: Any = None) -> None:
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def _reads_a_value(x: Any, n_used: Any, y: Any = None) -> None:
    """Uses the first ``n_used.sum()`` rows: a size read from an array's value, impossible with a traced array."""
    k = int(np.asarray(n_used).sum())
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    numpyro.sample("y", dist.Normal(x[:k] @ w, 1.0), obs=None if y is None else y[:k])


def _wants_numpy(x: Any, y: Any = None) -> None:
    """Refuses anything but a NumPy array (a traced one included), with an error of its own."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a NumPy array, got {type(x).__name__}")
    _regression(x, y)


@pytest.fixture
def compiles() -> Iterator[list[str]]:
    seen: list[str] = []

    def listen(event: str, duration: float, **kw: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(str(kw.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)


def _data(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(20, 3)).astype(np.float32)
    return {"x": x, "y": (x @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)}


def _draws(seed: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(seed).normal(size=(2, 5, 3)).astype(np.float32)}


def test_a_second_stage_of_the_same_model_compiles_no_predictive_program(compiles):
    first = predictive_groups(_regression, _data(0), _draws(0), 4, ("y",), seed=1)
    assert compiles  # the first stage of the model compiles its program
    del compiles[:]
    again = predictive_groups(_regression, _data(1), _draws(1), 4, ("y",), seed=1)  # other data, same structure
    assert compiles == []
    np.testing.assert_array_equal(again["observed_data"]["y"], _data(1)["y"])  # the data are arguments, not constants
    assert again["posterior_predictive"]["y"].shape == (2, 5, 20) and again["prior"]["w"].shape == (1, 4, 3)
    # The same inputs give the same bits, and the draws follow the data given (not the first call's).
    same = predictive_groups(_regression, _data(0), _draws(0), 4, ("y",), seed=1)
    for group in first:
        for name in first[group]:
            np.testing.assert_array_equal(same[group][name], first[group][name])
    assert not np.array_equal(again["posterior_predictive"]["y"], first["posterior_predictive"]["y"])


def test_a_model_that_cannot_take_its_data_as_arguments_is_still_served(compiles):
    # Any failure with traced arguments: compiled as a closure over the data, as before.
    out = predictive_groups(_wants_numpy, _data(0), _draws(0), 0, ("y",), seed=1)
    np.testing.assert_array_equal(out["observed_data"]["y"], _data(0)["y"])
    data = {**_data(0), "n_used": np.array([1] * 12 + [0] * 8, np.int32)}
    out = predictive_groups(_reads_a_value, data, _draws(0), 0, ("y",), seed=1)
    assert out["posterior_predictive"]["y"].shape == (2, 5, 12)
    np.testing.assert_array_equal(out["observed_data"]["y"], data["y"][:12])
    # Its data are baked into the program, as before: no failed attempt per stage either, one compile per call.
    del compiles[:]
    predictive_groups(_reads_a_value, data, _draws(0), 0, ("y",), seed=1)
    assert len(compiles) == 1, compiles
