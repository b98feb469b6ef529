"""Accumulating metrics: exact whole-split values, merge, no host read per batch, and TrainingLoop(metrics=...)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train import (
    MAE,
    RMSE,
    Accuracy,
    ArraySource,
    ConfusionMatrix,
    CrossEntropy,
    EquinoxModel,
    Metric,
    OneHot,
    PrecisionRecallF1,
    TopKAccuracy,
    TrainingDataset,
    TrainingLoop,
    read_jsonl,
    run_settings,
)
from pipekit_train.tracking._metrics import compute_metrics, evaluate_metrics, init_states, update_states

RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(50, 4)).astype(np.float32)
LABELS = RNG.integers(0, 4, size=50)
BUILT_IN = [
    Accuracy(),
    TopKAccuracy(k=2),
    ConfusionMatrix(num_classes=4),
    PrecisionRecallF1(num_classes=4),
    MAE(),
    RMSE(),
]


def _batches(x, y, size=16):
    return [{"x": x[i : i + size], "y": y[i : i + size]} for i in range(0, len(x), size)]


def _identity(x):
    return jnp.asarray(x)


def test_classification_metrics_are_exact_over_the_whole_split():
    pred, truth = LOGITS.argmax(axis=1), LABELS
    out = evaluate_metrics(
        _identity,
        _batches(LOGITS, LABELS),
        [Accuracy(), TopKAccuracy(k=2), ConfusionMatrix(num_classes=4), PrecisionRecallF1(num_classes=4)],
    )
    assert out["accuracy"] == pytest.approx(np.mean(pred == LABELS))
    top2 = np.argsort(-LOGITS, axis=1)[:, :2]
    assert out["top2_accuracy"] == pytest.approx(np.mean((top2 == LABELS[:, None]).any(axis=1)))
    for t in range(4):
        for p in range(4):
            assert out[f"confusion/{t}/{p}"] == np.sum((truth == t) & (pred == p))
        tp = np.sum((truth == t) & (pred == t))
        precision, recall = tp / max(np.sum(pred == t), 1), tp / max(np.sum(truth == t), 1)
        assert out[f"precision/{t}"] == pytest.approx(precision)
        assert out[f"recall/{t}"] == pytest.approx(recall)
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        assert out[f"f1/{t}"] == pytest.approx(f1)
    assert out["f1_macro"] == pytest.approx(np.mean([out[f"f1/{t}"] for t in range(4)]))
    # one-hot targets (what the OneHot transform makes) mean the same
    onehot = np.eye(4, dtype=np.float32)[LABELS]
    assert evaluate_metrics(_identity, _batches(LOGITS, onehot), [Accuracy()]) == {"accuracy": out["accuracy"]}


def test_regression_metrics():
    target = RNG.normal(size=(50, 4)).astype(np.float32)
    out = evaluate_metrics(_identity, _batches(LOGITS, target), [MAE(), RMSE()])
    assert out["mae"] == pytest.approx(np.mean(np.abs(LOGITS - target)), rel=1e-5)
    assert out["rmse"] == pytest.approx(np.sqrt(np.mean((LOGITS - target) ** 2)), rel=1e-5)


@pytest.mark.parametrize("metric", BUILT_IN, ids=lambda m: type(m).__name__)
def test_every_metric_merges_and_round_trips(metric: Metric):
    assert pipekit.loads(pipekit.dumps(metric)) == metric
    y = LABELS if not isinstance(metric, (MAE, RMSE)) else LOGITS[::-1].copy()
    whole = evaluate_metrics(_identity, _batches(LOGITS, y), [metric])
    (a,) = update_states((metric,), init_states([metric]), jnp.asarray(LOGITS[:20]), y[:20])
    (b,) = update_states((metric,), init_states([metric]), jnp.asarray(LOGITS[20:]), y[20:])
    merged = compute_metrics([metric], [metric.merge(a, b)])
    assert merged == pytest.approx(whole, rel=1e-6)


def test_no_host_read_per_batch_and_one_compile():
    metrics = (Accuracy(), PrecisionRecallF1(num_classes=4), TopKAccuracy(k=2))
    batches = _batches(LOGITS, LABELS, size=10)  # five batches of one shape
    states = init_states(metrics)
    from pipekit_train.tracking import _metrics

    with jax.transfer_guard_device_to_host("disallow"):  # any read of a device value would raise here
        for batch in batches:
            states = update_states(metrics, states, jnp.asarray(batch["x"]), batch["y"])
    assert _metrics._UPDATE._cache_size() >= 1
    before = _metrics._UPDATE._cache_size()
    update_states(metrics, states, jnp.asarray(batches[0]["x"]), batches[0]["y"])
    assert _metrics._UPDATE._cache_size() == before  # the same configuration and shapes: nothing recompiled
    assert compute_metrics(metrics, states)["accuracy"] == pytest.approx(np.mean(LOGITS.argmax(1) == LABELS))


class Brier(Metric, register=False):
    """A user metric: the mean squared distance of softmax probabilities from one-hot targets."""

    num_classes: int = 4

    def init(self):
        return {"total": jnp.zeros(()), "count": jnp.zeros((), jnp.int32)}

    def update(self, state, y_pred, y_true):
        p = jax.nn.softmax(y_pred, axis=-1)
        sq = jnp.sum((p - jax.nn.one_hot(y_true, self.num_classes)) ** 2, axis=-1)
        return {"total": state["total"] + sq.sum(), "count": state["count"] + sq.size}

    def compute(self, state):
        return {"brier": float(state["total"]) / int(state["count"])}


def test_a_user_metric_needs_only_init_update_compute():
    out = evaluate_metrics(_identity, _batches(LOGITS, LABELS), [Brier()])
    p = np.exp(LOGITS) / np.exp(LOGITS).sum(axis=1, keepdims=True)
    assert out["brier"] == pytest.approx(np.mean(np.sum((p - np.eye(4)[LABELS]) ** 2, axis=1)), rel=1e-5)


def _classes(n: int, seed: int) -> TrainingDataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    return TrainingDataset(source=ArraySource(arrays={"x": x, "y": y}), transforms=(OneHot(key="y", num_classes=3),))


def test_training_loop_metrics_for_validation_and_test(tmp_path: Path):
    val = _classes(40, 1).replace(shuffle=False)
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 3, "width_size": 8, "depth": 1}),
        dataset=_classes(64, 0),
        val_dataset=val,
        test_dataset=val,
        loss=CrossEntropy(),
        optimizer_config={"name": "adam", "lr": 0.05},
        max_steps=10,
        batch_size=16,
        eval_batch_size=16,  # 40 records: batches of 16, 16 and 8; the metrics are over all 40
        eval_every_n_steps=5,
        metrics=(Accuracy(), PrecisionRecallF1(num_classes=3)),
        progress=False,
    )
    with run_settings(run_dir=str(tmp_path / "run"), store=False):
        model, artifact = loop.run()
    arrays = val.arrays()
    pred = np.asarray(model(arrays["x"])).argmax(axis=1)
    expected = np.mean(pred == arrays["y"])
    assert artifact.final_metrics["validate/accuracy"] == pytest.approx(expected)
    assert artifact.final_metrics["test/accuracy"] == pytest.approx(expected)
    assert "validate/f1_macro" in artifact.final_metrics and "test/recall/2" in artifact.final_metrics
    records = read_jsonl(tmp_path / "run" / "stage0" / "metrics.jsonl")
    val_records = [r for r in records if r["type"] == "metrics" and r["context"] == "validate"]
    assert [r["step"] for r in val_records] == [5, 10] and all("precision/0" in r for r in val_records)


def test_metrics_must_be_metric_operators():
    with pytest.raises(ConfigError, match=r"metrics\[0\]"):
        TrainingLoop.example().replace(metrics=("accuracy",))
