"""Where a restored state's arrays go, and what restoring compiles (counted, never timed).

A jitted call compiles one program for uncommitted arguments and another for arguments committed to a device, so a
state restored committed from a fresh (uncommitted) template made every step program compile again in the
process that had compiled it for the fresh state; and ``jnp.asarray`` compiled a conversion program per leaf
shape for a state restored as saved (a warm start). Both in the flat layout, the default of a one-process run.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import monitoring

from pipekit_train import MSE, ArraySource, Checkpoint, EquinoxModel, TrainingDataset, TrainingLoop, run_settings
from pipekit_train.checkpoint import Checkpointer, Last, average_checkpoints

_COMPILES: list[str] = []


def _count(name: str, secs: float, **kwargs: Any) -> None:
    if name.endswith("backend_compile_duration"):
        _COMPILES.append(str(kwargs.get("fun_name")))


monitoring.register_event_duration_secs_listener(_count)


def _state() -> dict[str, Any]:
    # Shapes no other test restores, so the programs counted here are this module's own.
    return {
        "w": jnp.arange(21.0, dtype=jnp.float32).reshape(3, 7),
        "b": jnp.ones((7,), jnp.float32),
        "count": jnp.zeros((), jnp.int32),
    }


def _saved(tmp_path: Any, steps: tuple[int, ...] = (1,)) -> Checkpointer:
    ck = Checkpointer(tmp_path / "ck", layout="flat", keep=(Last(n=len(steps)),))
    for step in steps:
        ck.save(step, state=_state(), data_iter={"position": step}, meta={})
    ck.wait()
    return ck


def test_a_state_restored_into_a_fresh_template_is_as_uncommitted_as_the_template(tmp_path):
    ck = _saved(tmp_path)
    try:
        fresh = _state()
        assert not any(x.committed for x in jax.tree.leaves(fresh))
        state, data_iter, _ = ck.restore(1, abstract_state=fresh)
        assert data_iter == {"position": 1}
        assert not any(x.committed for x in jax.tree.leaves(state))
        for name, x in state.items():
            np.testing.assert_array_equal(np.asarray(x), np.asarray(fresh[name]))
            assert x.dtype == fresh[name].dtype and x.devices() == fresh[name].devices()

        # So a program compiled for the fresh state runs the restored one without compiling again.
        step = jax.jit(lambda s: {**s, "w": s["w"] * 2.0 + s["b"], "count": s["count"] + 1})
        step(_state())
        _COMPILES.clear()
        out = step(state)
        assert _COMPILES == [] and int(out["count"]) == 1

        # A template committed to its device (a state on a mesh is) still gets its own sharding.
        device = jax.devices()[0]
        committed = jax.tree.map(lambda x: jax.device_put(x, device), _state())
        again, _, _ = ck.restore(1, abstract_state=committed)
        assert all(x.committed and x.devices() == {device} for x in jax.tree.leaves(again))
    finally:
        ck.close()


def test_a_state_restored_as_saved_compiles_nothing(tmp_path):
    ck = _saved(tmp_path)
    try:
        _COMPILES.clear()
        state, _, _ = ck.restore(1)
        assert _COMPILES == []  # `jnp.asarray` compiled one conversion per leaf shape and dtype: three here
        assert {k: (x.shape, x.dtype) for k, x in state.items()} == {k: (x.shape, x.dtype) for k, x in _state().items()}
        assert all(isinstance(x, jax.Array) and not x.committed for x in jax.tree.leaves(state))
    finally:
        ck.close()


def test_an_average_of_a_fresh_templates_checkpoints_is_uncommitted(tmp_path):
    _saved(tmp_path, steps=(1, 2)).close()
    mean = average_checkpoints(tmp_path / "ck", [1, 2], abstract_state=_state())
    assert not any(x.committed for x in jax.tree.leaves(mean))
    np.testing.assert_array_equal(np.asarray(mean["w"]), np.asarray(_state()["w"]))


def test_a_warm_start_in_the_process_that_trained_its_source_compiles_nothing(tmp_path):
    """`init_from` a finished run of the same structure, in the same process: every program is already compiled
    (six conversion programs were compiled for the restored weights)."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    dataset = TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :1]}))

    def loop(name: str, **kwargs: Any) -> TrainingLoop:
        return TrainingLoop(
            model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 5, "depth": 1}),
            dataset=dataset,
            loss=MSE(),
            max_steps=20,
            batch_size=8,
            log_every_n_steps=10,
            progress=False,
            name=name,
            callbacks=(Checkpoint(every_n_steps=10),),
            **kwargs,
        )

    with run_settings(store=False, run_dir=str(tmp_path / "source")):
        loop("fit").run()
    _COMPILES.clear()
    with run_settings(store=False, run_dir=str(tmp_path / "warm")):
        _, artifact = loop("warm", init_from=str(tmp_path / "source" / "fit")).run()
    assert collections.Counter(_COMPILES) == {}
    assert artifact.backend_info["steps"] == 20
