"""The gaps an outside backend author hit (issue 41), each closed and kept closed: the optimizer configuration
resolves idempotently, the template uses public names only (no private attribute either) and its `check_input`
returns a shape and a dtype, a backend honours the `EMA` callback through the ``ema`` capability (and pre-flight
refuses it elsewhere), an outside backend's ``extra = None`` gives a ``pip install <package>`` hint, and
`split_loss_output` is public. The state-inside-the-module rules are checked by the Flax backend's tests
(tests/adapters/flax: dropout and BatchNorm resume bitwise after a SIGKILL)."""

from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import TrainingDataset, TrainingLoop, register_backend, run_settings
from pipekit_train.backends import Backend, get_backend
from pipekit_train.backends.kit import build_optimizer, learning_rate_at
from pipekit_train.callbacks import EMA
from pipekit_train.data import ArraySource
from pipekit_train.losses import MSE
from pipekit_train.optim import resolve_optimizer_config, schedule_numbers
from pipekit_train.optim._config import _OPTIMIZERS, _SCHEDULES

ROOT = Path(__file__).resolve().parents[2]


# 1. resolve_optimizer_config is idempotent ------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "schedule"), list(itertools.product(_OPTIMIZERS, _SCHEDULES)))
def test_a_resolved_config_resolves_to_itself_and_builds(name: str, schedule: str) -> None:
    raw: dict[str, Any] = {"name": name, "schedule": schedule, "lr": 0.1}
    if schedule in ("warmup_cosine", "constant", "exponential"):
        raw["warmup_steps"] = 2
    once = resolve_optimizer_config(raw)
    assert resolve_optimizer_config(once) == once
    # the raw and the resolved config build the same optimizer and the same rates (the derived keys from max_steps)
    assert build_optimizer(once, max_steps=20) == build_optimizer(raw, max_steps=20)
    assert [learning_rate_at(once, s, 20) for s in (0, 3, 19)] == [learning_rate_at(raw, s, 20) for s in (0, 3, 19)]
    assert schedule_numbers(once, 20) == schedule_numbers(raw, 20)


# 2, 3. The template: public names only; check_input gives a shape and a dtype ------------------------------------
def private_attributes(source: str) -> list[str]:
    """``line: x._name`` for each private attribute read of another object than ``self`` / ``cls`` in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not (node.attr.startswith("__") and node.attr.endswith("__"))
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_rule_catches_a_private_attribute() -> None:
    assert private_attributes("ModelOp._bound(op, m)\nself._x\nx.__class__") == ["1: ModelOp._bound"]


@pytest.mark.parametrize("path", ["adapters/template.py", "tests/backends/numpy_linear/__init__.py"])
def test_the_template_and_the_reference_backend_read_no_private_attribute(path: str) -> None:
    assert private_attributes((ROOT / path).read_text()) == []


def _template() -> Any:
    sys.path.insert(0, str(ROOT / "adapters"))
    try:
        import template  # registers "my-backend"
    finally:
        sys.path.remove(str(ROOT / "adapters"))
    return template


def test_the_templates_check_input_returns_a_shape_and_a_dtype() -> None:
    out = _template().MyModel(in_size=3, out_size=2).check_input((3,), np.float32)
    assert tuple(out.shape) == (2,) and np.dtype(out.dtype) == np.float32


# 4. EMA: the `ema` capability ---------------------------------------------------------------------------------------
X = np.random.default_rng(0).standard_normal((32, 3)).astype(np.float32)
Y = X @ np.ones((3, 1), np.float32)


def _loop(backend: str, model: Any, **fields: Any) -> TrainingLoop:
    return TrainingLoop(
        model_op=model,
        dataset=TrainingDataset(source=ArraySource(arrays={"x": X, "y": Y})),
        loss=MSE(),
        optimizer_config={"name": "sgd", "lr": 0.05},
        max_steps=6,
        batch_size=8,
        backend=backend,
        progress=False,
        **fields,
    )


def test_the_template_honours_the_ema_callback(tmp_path: Path) -> None:
    """A decay near 1 keeps the starting weights, near 0 follows the parameters; the average is checkpointed."""
    template = _template()
    model = template.MyModel(in_size=3)
    assert "ema" in get_backend("my-backend").capabilities
    runs = {}
    for label, callbacks in (
        ("plain", ()),
        ("slow", (EMA(decay=0.999999, warmup=False, return_ema=True),)),
        ("fast", (EMA(decay=1e-6, warmup=False, return_ema=True),)),
    ):
        with run_settings(run_dir=str(tmp_path / label), store=False):
            runs[label], _ = _loop("my-backend", model, callbacks=callbacks).run()
    start = model.bind(model.build(0)).weights()
    for name in start:
        np.testing.assert_allclose(runs["slow"].weights()[name], start[name], atol=1e-4)
        np.testing.assert_allclose(runs["fast"].weights()[name], runs["plain"].weights()[name], atol=1e-4)
    loop = _loop("my-backend", model, callbacks=(EMA(),))
    assert "ema" in get_backend("my-backend").start(loop, model.bind(model.build(0)), None).state_tree()


class NoEma(Backend):
    """The template's backend, without the ``ema`` capability."""

    name = "my-backend-no-ema"
    capabilities = frozenset({"weights"})

    def check(self, loop: Any, incoming: Any, stage: str) -> None:
        return None

    def build(self, loop: Any) -> Any:
        return get_backend("my-backend").build(loop)

    def start(self, loop: Any, model: Any, incoming: Any) -> Any:
        return get_backend("my-backend").start(loop, model, incoming)


def test_an_ema_on_a_backend_without_the_capability_is_refused_in_preflight() -> None:
    from pipekit_train.stage.preflight import check

    class NoEmaModel(_template().MyModel, register=False):
        backend = "my-backend-no-ema"

    model = NoEmaModel(in_size=3)
    register_backend("my-backend-no-ema", NoEma())
    with pytest.raises(ConfigError, match=r"cannot keep an EMA of the weights .*backend that can \(.*my-backend"):
        check(_loop("my-backend-no-ema", model, callbacks=(EMA(),)), None, "fit")


# 5. extra = None: the hint names the package -----------------------------------------------------------------------
class Outside(NoEma):
    name = "outside-backend"
    requires = ("pipekit_surely_not_installed",)
    extra = None


def test_an_outside_backend_without_its_package_says_pip_install_the_package() -> None:
    from pipekit_train.backends import BackendError

    register_backend("outside-backend", Outside())
    with pytest.raises(BackendError) as info:
        get_backend("outside-backend")
    assert "pip install pipekit_surely_not_installed" in str(info.value)
    assert "pipekit-train[" not in str(info.value)


# 6. split_loss_output is public -------------------------------------------------------------------------------------
def test_split_loss_output_is_public() -> None:
    import pipekit_train.losses as losses

    assert "split_loss_output" in losses.__all__
    assert losses.split_loss_output((1.5, {"a": 2})) == (1.5, {"a": 2})
