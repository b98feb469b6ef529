"""`optimizer_config.lora`: adapters train on a frozen model, checkpoints hold the adapters and the base's digest,
the stage's model (registry, next stage, export) is the merged plain model, a SIGKILLed LoRA stage resumes bitwise,
and bad settings are refused in pre-flight with the nearest valid name.

One module-scoped pipeline (a pretrain stage, then a LoRA stage on its model) run in-process serves most asserts;
one subprocess is SIGKILLed in the LoRA stage and the run is resumed in-process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import MSE, ArraySource, EquinoxModel, TrainingDataset, TrainingLoop
from pipekit_train.cli._main import main
from pipekit_train.optim import lora_settings, resolve_lora
from pipekit_train.provenance._model_registry import load_model
from pipekit_train.stage.preflight import check_pipeline
from pipekit_train.tracking._progress import format_model_summary

#: One xdist worker (``--dist loadgroup``): the module's two-stage LoRA run (`pipeline`) is trained once.
pytestmark = pytest.mark.xdist_group("lora")

MLP = "{type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}"
STAGE = """\
- type: TrainingLoop
  name: {name}
  model_op: {model}
  dataset: {{type: TrainingDataset, source: {{type: NpzSource, path: data.npz}}}}
  loss: {{type: MSE}}
  optimizer_config: {{name: adam, lr: 1.0e-2{extra}}}
  max_steps: {steps}
  batch_size: 8
  seed: {seed}
  log_every_n_steps: 2
  progress: false
  callbacks: [{{type: Checkpoint, every_n_steps: 2}}]
"""
LORA = ", lora: {rank: 2, alpha: 4.0, targets: ['layers[0]']}"


def _run(work: Path, *extra: str) -> int:
    cwd = os.getcwd()
    os.chdir(work)
    try:
        return main(["run", "pipe.yaml", "--run-dir", "R", "--store", "s.sqlite", *extra])
    finally:
        os.chdir(cwd)


def _artifact(run: Path, stage: str) -> dict[str, Any]:
    return json.loads((run / stage / "artifact.json").read_text())


def _model(run: Path, stage: str) -> Any:
    uri = json.loads((run / stage / "final.json").read_text())["model_uri"]
    return load_model(uri, registry=run / "models")


def _history(run: Path, stage: str) -> list[tuple[int, float]]:
    lines = [json.loads(line) for line in (run / stage / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in lines if r["type"] == "metrics" and r["context"] == "train"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pretrain stage (4 steps) and a LoRA stage on its model (8 steps, a checkpoint every 2), run in-process."""
    work = tmp_path_factory.mktemp("lora")
    x = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    np.savez(work / "data.npz", x=x, y=np.sin(x).sum(axis=1, keepdims=True))
    stages = STAGE.format(name="pre", model=MLP, extra="", steps=4, seed=0)
    stages += STAGE.format(name="tune", model=MLP, extra=LORA, steps=8, seed=1)
    (work / "pipe.yaml").write_text("pipekit: 1\ntype: Sequential\nstages:\n" + stages)
    assert _run(work) == 0
    return work


def test_only_the_adapters_train_and_the_artifact_counts_them(pipeline, capsys):
    run = pipeline / "R"
    pre, tune = _artifact(run, "pre"), _artifact(run, "tune")
    info = tune["backend_info"]
    # layers[0]: 4 -> 8 (A: 2x4, B: 8x2); the model: 4*8 + 8 + 8*1 + 1 = 49 parameters.
    assert (info["num_params"], info["trainable_params"]) == (49, 24)
    assert pre["backend_info"]["trainable_params"] == pre["backend_info"]["num_params"] == 49
    assert info["lora"] == {
        "rank": 2,
        "alpha": 4.0,
        "targets": ["layers[0]"],
        "base_weights": pre["trained_model_hash"],  # the frozen base: the pretrain stage's model
    }
    assert tune["parent_ids"] == [pre["artifact_id"]]
    assert tune["model_summary"]["trainable_params"] == 24
    capsys.readouterr()
    assert main(["artifacts", "show", tune["artifact_id"], "--store", str(pipeline / "s.sqlite")]) == 0
    assert "params     49, trainable 24; LoRA rank 2 on layers[0]\n" in capsys.readouterr().out


def test_the_checkpoint_holds_the_adapters_and_the_base_digest_not_the_base(pipeline):
    run = pipeline / "R"
    meta = json.loads((run / "tune" / "checkpoints" / "8" / "meta.json").read_text())
    names = sorted(meta["leaves"])
    assert not [n for n in names if n.startswith("consts")]
    assert sorted(n for n in names if n.startswith("params/")) == [
        "params/layers/0/lora_a",
        "params/layers/0/lora_b",
    ]
    assert meta["leaves"]["base"]["shape"] == [32] and meta["leaves"]["base"]["dtype"] == "uint8"
    # The whole step: the 24 adapter numbers, Adam's two moments of them, the digest and a few scalars.
    assert sum(r["nbytes"] for r in meta["leaves"].values()) <= 3 * 24 * 4 + 32 + 64


def test_the_stage_model_is_the_base_with_the_adapters_merged(pipeline):
    from pipekit_train.adapters.equinox._lora import LoraLinear
    from pipekit_train.checkpoint._flat import read_leaves

    run = pipeline / "R"
    base, merged = _model(run, "pre").weights(), _model(run, "tune").weights()
    assert list(merged) == list(base)  # a plain model of the same architecture, no adapter arrays
    meta = json.loads((run / "tune" / "checkpoints" / "8" / "meta.json").read_text())
    arrays, bad, problem = read_leaves(run / "tune" / "checkpoints" / "8", meta["leaves"])
    assert not bad and problem is None
    a, b = arrays["params/layers/0/lora_a"], arrays["params/layers/0/lora_b"]
    assert np.abs(b).max() > 0  # B starts at zero and trained
    expected = base[".layers[0].weight"] + (4.0 / 2) * (b @ a)
    np.testing.assert_allclose(merged[".layers[0].weight"], expected, rtol=1e-6, atol=1e-7)
    for frozen in (".layers[0].bias", ".layers[1].weight", ".layers[1].bias"):
        assert np.array_equal(merged[frozen], base[frozen]), frozen
    # The adapted layer computes what the merged one does; with B at zero (the start), what the base does.
    layer = _model(run, "pre").module.layers[0]
    x = np.linspace(-1.0, 1.0, 4, dtype=np.float32)
    adapted = LoraLinear(base=layer, lora_a=a, lora_b=b, scale=2.0)
    np.testing.assert_allclose(adapted(x), _model(run, "tune").module.layers[0](x), rtol=1e-5, atol=1e-6)
    assert np.array_equal(LoraLinear(base=layer, lora_a=a, lora_b=np.zeros_like(b), scale=2.0)(x), layer(x))


def test_a_sigkilled_lora_stage_resumes_bitwise(pipeline, tmp_path, xla_cache_env):
    """A process SIGKILLs itself after step 6 of the LoRA stage (before that step's checkpoint); ``--resume auto``
    in this process continues it from step 4 and ends where the uninterrupted run ended. The run starts from a copy
    of the reference run with the pretrain stage finished (``--resume auto`` takes it as it is), so the one
    subprocess trains only the LoRA stage."""
    work = tmp_path
    for name in ("pipe.yaml", "data.npz"):
        shutil.copy(pipeline / name, work / name)
    shutil.copytree(pipeline / "R", work / "R", ignore=lambda d, names: ["tune"] if d == str(pipeline / "R") else [])
    probe = {"trace": str(work / "trace.jsonl"), "kill": {"stage": "tune", "step": 5, "signal": "SIGKILL"}}
    env = {**os.environ, **xla_cache_env, "JAX_PLATFORMS": "cpu", "PIPEKIT_RESUME_PROBE": json.dumps(probe)}
    args = ["run", "pipe.yaml", "--run-dir", "R", "--store", "s.sqlite", "--resume", "auto"]
    proc = subprocess.run(
        [sys.executable, "-m", "pipekit_train.cli", *args],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert '"kill": "SIGKILL"' in (work / "trace.jsonl").read_text()
    assert not (work / "R" / "tune" / "final.json").exists()
    assert _run(work, "--resume", "auto") == 0
    ref, got = pipeline / "R", work / "R"
    assert _artifact(got, "tune")["trained_model_hash"] == _artifact(ref, "tune")["trained_model_hash"]
    # The killed process logged steps 2 to 6, the resumed one 6 and 8 again: the last record of each step counts.
    assert dict(_history(got, "tune")) == dict(_history(ref, "tune"))


def test_extend_continues_a_lora_stage_from_the_model_it_started_from(pipeline, tmp_path):
    """``extend`` takes the frozen model from the stage's parent (its checkpoint holds only the adapters), and the
    extension is bitwise the stage planned 4 steps longer."""
    shutil.copytree(pipeline, tmp_path / "w")
    work = tmp_path / "w"
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert main(["extend", "R", "--stage", "tune", "--steps", "4", "--store", "s.sqlite"]) == 0
        text = (work / "pipe.yaml").read_text()
        (work / "pipe.yaml").write_text(text.replace("max_steps: 8", "max_steps: 12"))
        assert main(["run", "pipe.yaml", "--run-dir", "R12", "--store", "s.sqlite"]) == 0
    finally:
        os.chdir(cwd)
    extended, longer = _artifact(work / "R", "tune-extend1"), _artifact(work / "R12", "tune")
    assert extended["backend_info"]["lora"]["base_weights"] == _artifact(work / "R", "pre")["trained_model_hash"]
    assert extended["trained_model_hash"] == longer["trained_model_hash"]


def _loop(**changes: Any) -> TrainingLoop:
    x = np.zeros((16, 4), np.float32)
    fields: dict[str, Any] = dict(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=ArraySource(arrays={"x": x, "y": x[:, :1]})),
        loss=MSE(),
        max_steps=2,
        batch_size=8,
        progress=False,
        name="ft",
    )
    fields.update(changes)
    return TrainingLoop(**fields)


@pytest.mark.parametrize(
    "lora,match",
    [
        ({"rank": 0}, r"optimizer_config.lora.rank must be an int >= 1, got 0"),
        ({"rank": 2.5}, r"optimizer_config.lora.rank must be an int >= 1, got 2.5"),
        ({"alpha": -1.0}, r"optimizer_config.lora.alpha must be a float > 0, got -1.0"),
        ({"ranks": 4}, r"unknown optimizer_config.lora key 'ranks' \(did you mean 'rank'\?\); allowed keys: rank"),
        ({"targets": []}, r"optimizer_config.lora.targets must be a non-empty list"),
        (4, r"optimizer_config.lora must be a mapping"),
    ],
)
def test_bad_lora_settings_are_refused_when_the_loop_is_built(lora, match):
    with pytest.raises(ConfigError, match=match):
        _loop(optimizer_config={"name": "adam", "lora": lora})


def test_settings_resolve_to_themselves_with_defaults():
    resolved = resolve_lora({"rank": 4})
    assert resolved == {"rank": 4, "alpha": 4.0, "targets": None} and resolve_lora(resolved) == resolved
    settings = lora_settings({"lora": {"rank": 4, "alpha": 8, "targets": "layers[*]"}})
    assert settings is not None and settings.scale == 2.0 and settings.targets == ("layers[*]",)


def test_targets_are_checked_against_the_model_in_preflight():
    def cfg(**lora: Any) -> dict[str, Any]:
        return {"name": "adam", "lora": {"rank": 2, **lora}}

    # The default (a transformer's projections) matches nothing in an MLP: its linear layers, and a pattern.
    with pytest.raises(
        ConfigError,
        match=r"targets is not set, and its default .*matches no linear layer of the 'mlp' model; its linear "
        r"layers are layers\[0\], layers\[1\]: set optimizer_config.lora.targets, e.g. \['layers\[\*\]'\]",
    ):
        check_pipeline(_loop(optimizer_config=cfg()))
    with pytest.raises(
        ConfigError,
        match=r"targets\[1\] 'layer\[1\]' matches no linear layer of the 'mlp' model \(did you mean 'layers\[1\]'",
    ):
        check_pipeline(_loop(optimizer_config=cfg(targets=["layers[0]", "layer[1]"])))
    # Globs and the dotted form select the same layers.
    check_pipeline(_loop(optimizer_config=cfg(targets=["layers.*"])))
    with pytest.raises(ConfigError, match=r"cannot be combined with TrainingLoop.carry"):
        check_pipeline(_loop(optimizer_config=cfg(targets=["layers[*]"]), carry={"optimizer_state": True}))


def test_a_backend_without_the_capability_refuses_lora():
    pytest.importorskip("flax")
    from pipekit_train.adapters.flax import FlaxModel
    from pipekit_train.stage.preflight import check_without_jax

    loop = _loop(
        backend="flax",
        model_op=FlaxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}),
        optimizer_config={"name": "adam", "lora": {"rank": 2}},
    )
    with pytest.raises(
        ConfigError,
        match=r"stage 'ft': backend 'flax' cannot train low-rank adapters \(optimizer_config.lora is .*\); remove "
        r"optimizer_config.lora to train every weight, or train this stage with a backend that can \(equinox\)",
    ):
        check_without_jax(loop, "ft")


def test_the_model_summary_shows_trainable_beside_total():
    summary = {"total_params": 1000, "total_bytes": 4000, "submodules": [], "trainable_params": 24}
    assert format_model_summary(summary)[0] == "model: 1,000 parameters, 3.9 KiB; trainable: 24 (2.4% of the model's)"


def test_default_targets_are_a_transformers_projections():
    """On the agreed part names (`blocks[i].attention.*_proj`, an `eqx.nn.MultiheadAttention`, and
    `blocks[i].mlp.{up,down}`), the default selects the six projections of each block, the adapted model runs
    through the attention's projections, and the merge gives back plain linear layers. Traced abstractly (nothing
    compiles: attention is seconds of compiling here); the numbers are checked on the MLP stage above."""
    import equinox as eqx
    import jax

    from pipekit_train.adapters.equinox._lora import LoraLinear, attach, merge

    class Mlp(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

    class Block(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        mlp: Mlp

    class Tiny(eqx.Module):
        embed: eqx.nn.Linear
        blocks: list

        def __call__(self, x):
            h = jax.vmap(self.embed)(x)
            for block in self.blocks:
                h = h + block.attention(h, h, h)
                h = h + jax.vmap(lambda v, m=block.mlp: m.down(jax.nn.relu(m.up(v))))(h)
            return h

    settings = lora_settings({"lora": {"rank": 2, "alpha": 2.0}})
    assert settings is not None
    seen: dict[str, Any] = {}

    def outputs(key, x):
        k = jax.random.split(key, 5)
        mlp = Mlp(up=eqx.nn.Linear(8, 16, key=k[1]), down=eqx.nn.Linear(16, 8, key=k[2]))
        model = Tiny(
            embed=eqx.nn.Linear(4, 8, key=k[3]), blocks=[Block(eqx.nn.MultiheadAttention(2, 8, key=k[0]), mlp)]
        )
        adapted, seen["paths"] = attach(model, settings, k[4], "the test model")
        seen["wrapped"] = type(adapted.blocks[0].attention.value_proj)
        merged = merge(adapted)
        seen["merged"] = type(merged.blocks[0].attention.value_proj), type(merged.blocks[0].mlp.down)
        return adapted(x), merged(x)

    out = eqx.filter_eval_shape(outputs, jax.random.key(0), jax.ShapeDtypeStruct((3, 4), np.float32))
    assert [o.shape for o in out] == [(3, 8), (3, 8)]
    assert seen["paths"] == [
        *(f"blocks[0].attention.{p}_proj" for p in ("query", "key", "value", "output")),
        "blocks[0].mlp.up",
        "blocks[0].mlp.down",
    ]
    assert seen["wrapped"] is LoraLinear and seen["merged"] == (eqx.nn.Linear, eqx.nn.Linear)


def test_a_transformers_adapters_are_folded_and_compute_exactly_what_the_merged_model_computes():
    """The zoo's transformers compute LoRA in the folded form (``W + scale * B @ A``, then one product: faster there
    than the thin products, docs/sequences.md), so the adapted model and its merged export give the same bits and the
    same gradients' direction reaches the adapters; an MLP keeps the thin form (``base(x) + scale * B (A x)``)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from pipekit_train.adapters.equinox._lora import LoraLinear, attach, merge, trainable

    settings = lora_settings({"lora": {"rank": 2, "alpha": 4.0}})
    assert settings is not None
    kwargs = {"vocab_size": 20, "d_model": 8, "num_heads": 2, "num_layers": 1, "max_len": 6}
    lm = EquinoxModel(factory="transformer", kwargs=kwargs).build(0)

    def adapters(m: Any) -> list[Any]:
        return [n for n in jax.tree.leaves(m, is_leaf=lambda n: isinstance(n, LoraLinear)) if isinstance(n, LoraLinear)]

    adapted, paths = attach(lm, settings, jax.random.key(1), "the 'transformer' model")
    wrappers = adapters(adapted)
    assert len(wrappers) == len(paths) == 6 and all(w.fold for w in wrappers)
    # B starts at zero: give it values, so the adapters change the outputs. (Drawn and summed in NumPy, and the
    # gradient taken under one `filter_jit`: op by op, each small JAX operation is a compile of its own.)
    adapted = eqx.tree_at(
        lambda m: [w.lora_b for w in adapters(m)],
        adapted,
        replace=[
            jnp.asarray(np.random.default_rng(i).normal(size=w.lora_b.shape), jnp.float32)
            for i, w in enumerate(wrappers)
        ],
    )
    ids = jnp.array([1, 5, 7, 2, 19, 3], jnp.int32)
    out = eqx.filter_jit(lambda m, x: m(x))
    assert np.array_equal(np.asarray(out(adapted, ids)), np.asarray(out(merge(adapted), ids)))
    assert not np.array_equal(np.asarray(out(adapted, ids)), np.asarray(out(lm, ids)))
    params, rest = eqx.partition(adapted, trainable(adapted))
    grads = eqx.filter_jit(eqx.filter_grad(lambda p, rest: jnp.sum(eqx.combine(p, rest)(ids) ** 2)))(params, rest)
    assert all(np.abs(np.asarray(g)).sum() > 0 for g in jax.tree.leaves(grads))

    mlp = EquinoxModel(factory="mlp", kwargs={"in_size": 4, "out_size": 1, "width_size": 8, "depth": 1}).build(0)
    thin, _ = attach(mlp, lora_settings({"lora": {"rank": 2, "targets": ["layers[*]"]}}), jax.random.key(1), "mlp")
    assert not any(w.fold for w in thin.layers)
