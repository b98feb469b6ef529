"""The stage flow of design/overview.md: each stage is pre-flighted once and builds its model once, from the Python
API and from the CLI; the core decides where a model starts and the backend is called through its contract."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import TrainingDataset, TrainingLoop, Transfer, run_settings
from pipekit_train.adapters.equinox import EquinoxModel, register_model
from pipekit_train.backends import get_backend
from pipekit_train.data import ArraySource, NpzSource
from pipekit_train.losses import MSE
from pipekit_train.stage.preflight import check, plan_pipeline
from pipekit_train.stage.start import route

BUILDS: Counter[str] = Counter()


@register_model("test_stage_counting")
def _counting_mlp(key: Any, in_size: int, out_size: int, tag: str = "") -> Any:
    """An MLP whose every concrete `EquinoxModel.build` is counted by `tag` (the `checks` fixture): the stage flow
    must build each stage's model once. The factory itself runs traced (the build is one jitted program, compiled
    once per architecture), so the count is taken at `build`, whose key is concrete; shape checks trace `build`
    abstractly (`jax.eval_shape`, a traced key): those initialise nothing and are not counted."""
    import equinox as eqx

    return eqx.nn.MLP(in_size, out_size, width_size=4, depth=1, key=key)


X = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
Y = X.sum(axis=1, keepdims=True)


def _loop(tag: str, name: str, **overrides: Any) -> TrainingLoop:
    fields: dict[str, Any] = dict(
        model_op=EquinoxModel(factory="test_stage_counting", kwargs={"in_size": 3, "out_size": 1, "tag": tag}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": Y})),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.01},
        max_steps=4,
        batch_size=8,
        progress=False,
        name=name,
    )
    fields.update(overrides)
    return TrainingLoop(**fields)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the Equinox backend's pre-flight `check` ran, by stage."""
    backend = get_backend("equinox")
    seen: Counter[str] = Counter()
    original = type(backend).check

    def counted(self: Any, loop: Any, incoming: Any, stage: str) -> None:
        seen[stage] += 1
        original(self, loop, incoming, stage)

    monkeypatch.setattr(type(backend), "check", counted)
    build = EquinoxModel.build

    def counted_build(self: Any, key: Any) -> Any:
        import jax

        if self.factory == "test_stage_counting" and not isinstance(key, jax.core.Tracer):
            BUILDS[self.kwargs.get("tag", "")] += 1
        return build(self, key)

    monkeypatch.setattr(EquinoxModel, "build", counted_build)
    return seen


def test_the_python_api_checks_and_builds_each_stage_once(checks: Counter[str]) -> None:
    BUILDS.clear()
    first = _loop("api", "first")
    second = _loop("api2", "second", transfer=Transfer(paths={"layers": "layers"}))
    with run_settings(store=False):
        model, _ = pipekit.Sequential([first, second]).run()
    assert checks == {"first": 1, "second": 1}
    # The second stage transfers its layers: one fresh model built for it to fill in, none rebuilt.
    assert BUILDS == {"api": 1, "api2": 1}
    assert model.module is not None


def test_the_cli_checks_and_builds_each_stage_once(checks: Counter[str], tmp_path: Any) -> None:
    from pipekit_train.cli._main import main

    BUILDS.clear()
    np.savez(tmp_path / "data.npz", x=X, y=Y)
    data = TrainingDataset(source=NpzSource(path=str(tmp_path / "data.npz")))
    pipeline = pipekit.Sequential([_loop("cli", "a", dataset=data), _loop("cli", "b", dataset=data)])
    (tmp_path / "p.yaml").write_text(pipekit.dumps(pipeline))
    assert main(["run", str(tmp_path / "p.yaml"), "--run-dir", str(tmp_path / "run"), "--no-store"]) == 0
    # Pre-flight of both stages before either trains; each stage's run takes its plan (no second check, and the
    # model pre-flight built); the second stage carries the first one's trained model over: it builds nothing.
    assert checks == {"a": 1, "b": 1}
    assert BUILDS == {"cli": 1}


def test_plans_say_where_each_model_starts() -> None:
    plans = plan_pipeline(
        pipekit.Sequential(
            [
                _loop("p", "a"),
                _loop("p", "b"),
                _loop("q", "c", transfer=Transfer(paths={"layers": "layers"})),
                _loop("q", "d", transfer=Transfer()),
            ]
        )
    )
    assert [(p.stage, p.route, p.fresh is not None) for p in plans] == [
        ("a", "fresh", True),
        ("b", "carried", False),
        ("c", "transferred", True),
        ("d", "fresh", True),
    ]


def test_another_architecture_without_transfer_is_refused_in_preflight() -> None:
    from pipekit_train import TrainerCarryState

    before = _loop("x", "a").model_op
    other = _loop("x", "b", model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "depth": 2}))
    incoming = TrainerCarryState(model=before, stage_index=1)
    with pytest.raises(ConfigError, match=r"stage 'b' trains .* but the previous stage produced .*transfer"):
        check(other, incoming, "b")
    assert route(other, None, "b", other.adapter()) == "fresh"
