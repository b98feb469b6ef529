"""Loss operators against hand-computed numpy values, under jit and grad, and through YAML."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipekit
from pipekit import ConfigError, ShapeError
from pipekit_train import ArraySource, EquinoxModel, TrainingDataset, TrainingLoop, read_jsonl, run_settings
from pipekit_train.losses._builtin import KL, MSE, NLL, CrossEntropy
from pipekit_train.losses._composite import Composite
from pipekit_train.losses._loss import Loss, split_loss_output

P = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
T = np.array([[0.0, 2.5], [1.0, 1.0]], np.float32)
SQ = (P - T) ** 2


class _Normal:
    """A minimal distribution object (log_prob / kl_divergence), as distrax or TFP would provide."""

    def __init__(self, mean, std):
        self.mean, self.std = jnp.asarray(mean), jnp.asarray(std)

    def log_prob(self, x):
        return -0.5 * ((x - self.mean) / self.std) ** 2 - jnp.log(self.std) - 0.5 * math.log(2 * math.pi)

    def kl_divergence(self, other):
        return jnp.log(other.std / self.std) + (self.std**2 + (self.mean - other.mean) ** 2) / (2 * other.std**2) - 0.5


ALL_LOSSES = [MSE(), MSE(reduction="sum"), NLL(), KL(), CrossEntropy(label_smoothing=0.1), Composite.example()]


@pytest.mark.parametrize("loss", ALL_LOSSES, ids=repr)
def test_every_loss_is_a_loss_and_round_trips_through_yaml(loss):
    assert isinstance(loss, Loss)
    assert pipekit.loads(pipekit.dumps(loss)) == loss


@pytest.mark.parametrize(
    ("reduction", "expected"), [("mean", SQ.mean()), ("sum", SQ.sum()), ("none", SQ)], ids=["mean", "sum", "none"]
)
def test_mse_reductions(reduction, expected):
    np.testing.assert_allclose(MSE(reduction=reduction)(P, T), expected, rtol=1e-6)


def test_mse_over_pytree_leaves_is_mean_over_all_elements():
    got = MSE()({"a": P, "b": P[0]}, {"a": T, "b": T[0]})
    expected = (SQ.sum() + SQ[0].sum()) / (SQ.size + 2)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_mse_refuses_broadcasting_shapes():
    with pytest.raises(ShapeError, match=r"predicted shape \(4, 1\) != target shape \(4,\)"):
        MSE()(jnp.zeros((4, 1)), jnp.zeros(4))


def test_mse_refuses_different_structures():
    with pytest.raises(ShapeError, match="predicted has 2 array leaves but target has 1"):
        MSE()((P, P), P)


def test_mse_rejects_unknown_reduction():
    with pytest.raises(ConfigError, match=r"MSE.reduction must be one of 'mean', 'sum', 'none', got 'avg'"):
        MSE(reduction="avg")


def _gaussian_nll(mean, log_var, y):
    return 0.5 * (np.log(2 * np.pi) + log_var + (y - mean) ** 2 / np.exp(log_var))


def test_nll_gaussian_tuple_matches_numpy():
    log_var = np.array([[0.0, 1.0], [-1.0, 0.5]], np.float32)
    per = _gaussian_nll(P, log_var, T)
    np.testing.assert_allclose(NLL()((P, log_var), T), per.mean(), rtol=1e-6)
    np.testing.assert_allclose(NLL(reduction="sum")((P, log_var), T), per.sum(), rtol=1e-6)
    np.testing.assert_allclose(NLL(reduction="none")((P, log_var), T), per, rtol=1e-6)


def test_nll_includes_the_constant():
    # a standard normal at its mean: 0.5 * log(2π)
    np.testing.assert_allclose(NLL()((jnp.zeros(3), jnp.zeros(3)), jnp.zeros(3)), 0.5 * np.log(2 * np.pi), rtol=1e-6)


def test_nll_with_a_distribution_object_equals_the_tuple_form():
    log_var = np.array([[0.0, 1.0], [-1.0, 0.5]], np.float32)
    dist = _Normal(P, np.exp(0.5 * log_var))
    np.testing.assert_allclose(NLL()(dist, T), NLL()((P, log_var), T), rtol=1e-5)


def test_nll_errors():
    with pytest.raises(TypeError, match=r"NLL: predicted must be a \(mean, log_var\) pair or an object with"):
        NLL()(jnp.zeros(3), jnp.zeros(3))
    with pytest.raises(ShapeError, match=r"mean shape \(3,\) != log_var shape \(2,\)"):
        NLL()((jnp.zeros(3), jnp.zeros(2)), jnp.zeros(3))
    with pytest.raises(ShapeError, match=r"NLL: predicted shape \(3,\) != target shape \(3, 1\)"):
        NLL()((jnp.zeros(3), jnp.zeros(3)), jnp.zeros((3, 1)))


def test_kl_known_value_and_zero_for_identical():
    # KL(N(0, 1) || N(1, e)) per dimension = 0.5 * (1 - 0 + (1 + 1) / e - 1) = 1 / e
    q = (jnp.zeros((2, 3)), jnp.zeros((2, 3)))
    p = (jnp.ones((2, 3)), jnp.ones((2, 3)))
    np.testing.assert_allclose(KL()(q, p), 3 / np.e, rtol=1e-6)  # batchmean: summed over 3 dims, per example
    np.testing.assert_allclose(KL(reduction="mean")(q, p), 1 / np.e, rtol=1e-6)
    np.testing.assert_allclose(KL(reduction="sum")(q, p), 6 / np.e, rtol=1e-6)
    np.testing.assert_allclose(KL(reduction="none")(q, p), np.full((2, 3), 1 / np.e), rtol=1e-6)
    some = (jnp.array([[0.3, -2.0]]), jnp.array([[0.1, 0.7]]))
    assert float(KL()(some, some)) == 0.0


def test_kl_with_distribution_objects_matches_the_tuple_form():
    mq, lq, mp, lp = (np.array([[0.5, -1.0]], np.float32), np.array([[0.2, -0.3]], np.float32), 0.0 * P[:1], 0 * P[:1])
    q, p = _Normal(mq, np.exp(0.5 * lq)), _Normal(mp, np.exp(0.5 * lp))
    np.testing.assert_allclose(KL()(q, p), KL()((mq, lq), (mp, lp)), rtol=1e-5)


def test_kl_errors():
    with pytest.raises(ShapeError, match=r"KL: q shape \(2,\) != p shape \(3,\)"):
        KL()((jnp.zeros(2), jnp.zeros(2)), (jnp.zeros(3), jnp.zeros(3)))
    with pytest.raises(TypeError, match=r"KL: q must be a \(mean, log_var\) pair or an object with .kl_divergence"):
        KL()(jnp.zeros(2), (jnp.zeros(2), jnp.zeros(2)))


def test_cross_entropy_int_and_one_hot_agree_and_match_numpy():
    logits = np.array([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0], [1.0, 1.5, 0.0]], np.float32)
    labels = np.array([0, 2, 0])
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -log_softmax[np.arange(3), labels].mean()
    loss_int, aux_int = CrossEntropy()(logits, labels)
    loss_hot, aux_hot = CrossEntropy()(logits, np.eye(3, dtype=np.float32)[labels])
    np.testing.assert_allclose(loss_int, expected, rtol=1e-6)
    np.testing.assert_allclose(loss_hot, loss_int, rtol=1e-6)
    np.testing.assert_allclose(aux_int["accuracy"], 2 / 3, rtol=1e-6)  # the third is predicted 1, labelled 0
    np.testing.assert_allclose(aux_hot["accuracy"], 2 / 3, rtol=1e-6)


def test_cross_entropy_label_smoothing_matches_numpy():
    logits = np.array([[2.0, 0.5, -1.0]], np.float32)
    s = 0.2
    target = (1 - s) * np.eye(3)[[0]] + s / 3
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    loss, _ = CrossEntropy(label_smoothing=s)(logits, np.array([0]))
    np.testing.assert_allclose(loss, -(target * log_softmax).sum(), rtol=1e-6)


def test_cross_entropy_errors():
    with pytest.raises(ConfigError, match=r"CrossEntropy.label_smoothing must be in \[0, 1\), got 1.0"):
        CrossEntropy(label_smoothing=1.0)
    with pytest.raises(ShapeError, match=r"integer labels of shape \(4, 1\) need logits of shape \(4, 1\)"):
        CrossEntropy()(jnp.zeros((4, 3)), jnp.zeros((4, 1), jnp.int32))
    with pytest.raises(ShapeError, match=r"one-hot target shape \(4, 2\) != logits shape \(4, 3\)"):
        CrossEntropy()(jnp.zeros((4, 3)), jnp.zeros((4, 2)))


def test_composite_weights_and_term_names():
    comp = Composite(components=((2.0, MSE()), (0.5, MSE(reduction="sum"))))
    total, terms = comp(P, T)
    assert list(terms) == ["MSE_0", "MSE_1"]
    np.testing.assert_allclose(terms["MSE_0"], SQ.mean(), rtol=1e-6)
    np.testing.assert_allclose(terms["MSE_1"], SQ.sum(), rtol=1e-6)
    np.testing.assert_allclose(total, 2.0 * SQ.mean() + 0.5 * SQ.sum(), rtol=1e-6)


def test_composite_uses_the_scalar_of_a_component_with_aux():
    logits, labels = np.array([[2.0, 0.0], [0.0, 1.0]], np.float32), np.array([0, 0])
    total, terms = Composite(components=((3.0, CrossEntropy()),))(logits, labels)
    ce, aux = CrossEntropy()(logits, labels)
    np.testing.assert_allclose(total, 3.0 * ce, rtol=1e-6)
    assert set(terms) == {"CrossEntropy_0", "CrossEntropy_0/accuracy"}
    np.testing.assert_allclose(terms["CrossEntropy_0/accuracy"], aux["accuracy"])


def test_composite_errors():
    with pytest.raises(ConfigError, match=r"Composite.components must hold at least one"):
        Composite(components=())
    with pytest.raises(ConfigError, match=r"components\[1\] is MSE\(reduction='none'\); a component must reduce"):
        Composite(components=((1.0, MSE()), (1.0, MSE(reduction="none"))))
    with pytest.raises(ConfigError, match=r"components\[0\] weight must be a finite float, got nan"):
        Composite(components=((float("nan"), MSE()),))
    with pytest.raises(ConfigError, match=r"Composite.components\[0\]\[1\] must be Loss"):
        Composite(components=((1.0, 3),))


def test_composite_from_yaml():
    text = "pipekit: 1\ntype: Composite\ncomponents:\n  - [1, {type: MSE}]\n  - [0.5, {type: NLL, reduction: sum}]\n"
    comp = pipekit.loads(text)
    assert comp == Composite(components=((1.0, MSE()), (0.5, NLL(reduction="sum"))))


def test_split_loss_output():
    assert split_loss_output(2.0) == (2.0, {})
    value, aux = split_loss_output((2.0, {"a": 1}))
    assert (value, aux) == (2.0, {"a": 1})
    # a plain pair without a mapping is a (strange) value, not (scalar, aux)
    assert split_loss_output((1.0, 2.0)) == ((1.0, 2.0), {})


_CASES = [
    (MSE(), lambda w: w * P, T),
    (NLL(), lambda w: (w * P, 0.1 * w * P), T),
    (KL(), lambda w: (w * P, 0.1 * w * P), (T, 0.0 * T)),
    (CrossEntropy(label_smoothing=0.1), lambda w: w * P, np.array([1, 0])),
    (Composite(components=((1.0, MSE()), (0.1, MSE(reduction="sum")))), lambda w: w * P, T),
]


@pytest.mark.parametrize(("loss", "make", "target"), _CASES, ids=[type(c[0]).__name__ for c in _CASES])
def test_losses_jit_and_grad(loss, make, target):
    def scalar(w):
        value, _ = split_loss_output(loss(make(w), target))
        return value

    eager = scalar(1.3)
    jitted = jax.jit(scalar)(1.3)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5)
    grad = jax.jit(jax.grad(scalar))(1.3)
    eps = 1e-2
    numeric = (scalar(1.3 + eps) - scalar(1.3 - eps)) / (2 * eps)
    assert np.isfinite(grad)
    np.testing.assert_allclose(grad, numeric, rtol=2e-2, atol=1e-3)


# Your own loss -----------------------------------------------------------------------------------------------
class ScaledL1(Loss):
    """A user's loss: registered as ``ScaledL1`` by defining it; returns its value and one aux term."""

    scale: float = 1.0

    def __call__(self, predicted, target):
        err = jnp.abs(predicted - target)
        return self.scale * jnp.mean(err), {"max_error": jnp.max(err)}


def test_a_user_loss_is_a_frozen_typed_registered_operator():
    loss = ScaledL1(scale=2)
    assert isinstance(loss, Loss) and isinstance(loss, pipekit.Operator)
    assert loss == ScaledL1(scale=2.0) and repr(loss) == "ScaledL1(scale=2.0)"
    assert pipekit.registered()["ScaledL1"] is ScaledL1
    value, aux = loss(P, T)
    np.testing.assert_allclose(value, 2.0 * np.abs(P - T).mean(), rtol=1e-6)
    np.testing.assert_allclose(aux["max_error"], np.abs(P - T).max())
    with pytest.raises(dataclasses.FrozenInstanceError):
        loss.scale = 3.0
    with pytest.raises(ConfigError, match=r"ScaledL1.scale must be float, got 'big'"):
        ScaledL1(scale="big")


def test_loss_is_abstract_and_not_registered():
    assert "Loss" not in pipekit.registered()
    with pytest.raises(TypeError, match=r"Can't instantiate abstract class Loss"):
        Loss()

    class NoCall(Loss, register=False):
        scale: float = 1.0

    with pytest.raises(TypeError, match=r"Can't instantiate abstract class NoCall .*__call__"):
        NoCall()


def test_a_user_loss_round_trips_through_yaml_alone_and_in_a_pipeline():
    loss = ScaledL1(scale=0.5)
    assert pipekit.dumps(loss) == "pipekit: 1\ntype: ScaledL1\nscale: 0.5\n"
    assert pipekit.loads(pipekit.dumps(loss)) == loss
    text = (
        "pipekit: 1\ntype: TrainingLoop\n"
        "model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 2, out_size: 2}}\n"
        "dataset: {type: TrainingDataset, source: {type: NpzSource, path: train.npz}}\n"
        "loss: {type: Composite, components: [[1.0, {type: MSE}], [0.1, {type: ScaledL1, scale: 0.5}]]}\n"
    )
    loop = pipekit.loads(text)
    assert loop.loss == Composite(components=((1.0, MSE()), (0.1, loss)))
    assert pipekit.loads(pipekit.dumps(loop)) == loop


def test_a_non_loss_as_loss_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text(
        "pipekit: 1\ntype: TrainingLoop\n"
        "model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 2, out_size: 2}}\n"
        "dataset: {type: TrainingDataset, source: {type: NpzSource, path: train.npz}}\n"
        "loss: {type: EarlyStopping}\n"
    )
    with pytest.raises(ConfigError, match=r"pipe.yaml:5:7: TrainingLoop.loss must be Loss or null, got EarlyStopping"):
        pipekit.load(path)
    model = EquinoxModel(factory="mlp", kwargs={"in_size": 2, "out_size": 2})
    data = TrainingDataset(source=ArraySource(arrays={"x": P, "y": T}))
    with pytest.raises(ConfigError, match=r"TrainingLoop.loss must be Loss or null, got EarlyStopping\(\)"):
        TrainingLoop(model_op=model, dataset=data, loss=pipekit.registered()["EarlyStopping"]())
    with pytest.raises(ConfigError, match=r"TrainingLoop.loss must be Loss or null, got 'MSE'"):
        TrainingLoop(model_op=model, dataset=data, loss="MSE")
    with pytest.raises(ConfigError, match=r"^TrainingLoop.loss is the class MSE, not a loss: give MSE\(\)$"):
        TrainingLoop(model_op=model, dataset=data, loss=MSE)
    with pytest.raises(
        ConfigError,
        match=r"^TrainingLoop.loss is .*<lambda>\(p\), which cannot be called as loss\(predicted, target\): a loss "
        r"takes the predictions and the targets as two positional arguments$",
    ):
        TrainingLoop(model_op=model, dataset=data, loss=lambda p: p)
    with pytest.raises(ConfigError, match=r"^Composite.components\[1\]\[1\] is .*<lambda>\(\), which cannot be"):
        Composite(components=((1.0, MSE()), (1.0, lambda: 0.0)))


# A plain callable as the loss (design seed 004: "a Loss, or any callable satisfying the Protocol") -----------------
def _l1(predicted, target):
    err = jnp.abs(predicted - target)
    return jnp.mean(err), {"max_error": jnp.max(err)}


def _l2(predicted, target):
    return jnp.mean((predicted - target) ** 2)


def _small_loop(**fields) -> TrainingLoop:
    x = np.random.default_rng(0).normal(size=(32, 2)).astype(np.float32)
    base = dict(
        # A width no other test uses: the train step compiled below is this test's own.
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 2, "out_size": 2, "width_size": 7, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": 2 * x})),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=4,
        batch_size=8,
        log_every_n_steps=2,
        progress=False,
    )
    return TrainingLoop(**{**base, **fields})


def test_a_plain_callable_as_the_loss_is_wrapped_in_a_loss_function():
    from pipekit_train.losses import LossFunction

    loop = _small_loop(loss=_l1)
    assert isinstance(loop.loss, LossFunction) and isinstance(loop.loss, Loss) and loop.loss.fn is _l1
    assert repr(loop.loss) == f"LossFunction({__name__}._l1)"
    # equal (and hashed alike) when wrapping the same object: what the compiled step's cache is keyed by
    assert loop.loss == LossFunction(fn=_l1) and hash(loop.loss) == hash(LossFunction(fn=_l1))
    assert loop.loss != LossFunction(fn=_l2)
    assert loop.replace(max_steps=8).loss == loop.loss and loop.replace(loss=_l2).loss == LossFunction(fn=_l2)
    value, aux = loop.loss(P, T)
    np.testing.assert_allclose(value, np.abs(P - T).mean(), rtol=1e-6)
    np.testing.assert_allclose(aux["max_error"], np.abs(P - T).max())
    # a Composite wraps its components too; a term is named after the function
    total, terms = Composite(components=((1.0, _l2), (0.5, MSE())))(P, T)
    assert sorted(terms) == ["MSE_1", "_l2_0"]
    np.testing.assert_allclose(total, 1.5 * SQ.mean(), rtol=1e-6)


def test_a_callable_loss_has_no_yaml_form_and_records_name_it(tmp_path):
    from pipekit_train.engine._fingerprint import fingerprint

    np.savez(tmp_path / "t.npz", x=P, y=T)
    source = pipekit.registered()["NpzSource"](path=str(tmp_path / "t.npz"))
    loop = _small_loop(loss=_l1, dataset=TrainingDataset(source=source))
    with pytest.raises(
        ConfigError,
        match=rf"^loss: LossFunction\({__name__}._l1\) wraps a Python object, which cannot be written to YAML; to "
        r"name a loss in a pipeline file, write it as a Loss subclass",
    ):
        pipekit.dumps(loop)
    described = {"type": f"{__name__}._l1 (Python object, not written to YAML)"}
    assert f"loss:\n  type: {described['type']}\n" in pipekit.dumps(loop, strict=False)
    # what a resume compares: the function's module and qualified name
    assert fingerprint(loop)["loss"] == described
    other = fingerprint(loop.replace(loss=_l2))["loss"]
    assert other == {"type": f"{__name__}._l2 (Python object, not written to YAML)"}


def test_a_callable_loss_trains_on_equinox_compiling_once_per_function(tmp_path):
    from pipekit_train.adapters.equinox._steps import chunk_cache_size

    def weights(model):
        return [np.asarray(w) for w in model.weights().values()]

    before = chunk_cache_size()
    with run_settings(run_dir=str(tmp_path / "fn"), store=False):
        stages = pipekit.Sequential([_small_loop(loss=_l1, name="a"), _small_loop(loss=_l1, name="b")])
        stages.run()
    assert chunk_cache_size() - before == 1  # the second stage found the first stage's program
    logged = [r for r in read_jsonl(tmp_path / "fn" / "a" / "metrics.jsonl") if r.get("context") == "train"]
    assert all({"loss", "loss/max_error"} <= set(r) for r in logged if r["type"] == "metrics")
    with run_settings(run_dir=str(tmp_path / "fn1"), store=False):
        by_function, _ = _small_loop(loss=_l1).run()
    with run_settings(run_dir=str(tmp_path / "cls"), store=False):
        by_class, _ = _small_loop(loss=ScaledL1()).run()  # the same formula as a Loss subclass
    assert chunk_cache_size() - before == 2  # ... which compiles its own program
    assert all(np.array_equal(a, b) for a, b in zip(weights(by_function), weights(by_class)))
    with run_settings(run_dir=str(tmp_path / "l2"), store=False):
        by_other, _ = _small_loop(loss=_l2).run()
    assert chunk_cache_size() - before == 3  # another function: its own program, not _l1's
    assert not all(np.array_equal(a, b) for a, b in zip(weights(by_function), weights(by_other)))


def test_a_user_losss_aux_terms_are_logged_under_its_aux_prefix(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 2)).astype(np.float32)
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 2, "out_size": 2, "width_size": 4, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": 2 * x})),
        loss=ScaledL1(),
        max_steps=4,
        batch_size=8,
        log_every_n_steps=2,
        progress=False,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        loop.run()
    train = [r for r in read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl") if r.get("context") == "train"]
    logged = [r for r in train if r["type"] == "metrics"]
    assert [r["step"] for r in logged] == [2, 4]
    assert all({"loss", "loss/max_error"} <= set(r) for r in logged)
