"""Sequence models: the token losses and metrics (shift, padding masked), the Equinox ``transformer`` and
``transformer_classifier`` (causal, padding never attended, the classifier takes the language model's weights,
``remat`` checkpoints each block), and the code example shortened: pretraining (with ``remat``, in bfloat16)
then finetuning, lineage, falling perplexity, ``generate``, and a chain of killed and resumed processes, bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipekit import ConfigError, ShapeError
from pipekit_train.adapters.equinox import EquinoxModel
from pipekit_train.losses import MaskedTokenCrossEntropy, NextTokenCrossEntropy
from pipekit_train.tracking import Perplexity, TokenAccuracy, compute_metrics, init_states, update_states

ROOT = Path(__file__).parent.parent
PAD = 258

#: The tests of the trained example (`pipeline`, `models`) on one xdist worker (``--dist loadgroup``): the fixture
#: trains the two-stage transformer once for the run, not once per worker that happens to draw one of them. The
#: check-resume test joins them, after the fixture: its processes' pretraining is the fixture's (the same `SETS`), so
#: they load those programs from the run's compilation cache instead of compiling them while the fixture does.
SHARED = pytest.mark.xdist_group("sequences")


def _manual_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1)[..., 0]


def test_next_token_loss_shifts_and_masks_padding_and_the_metrics_agree_over_the_split():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 259)).astype(np.float32)
    tokens = np.array([[256, 5, 6, 257], [256, 7, PAD, PAD]], np.int32)
    masked = np.full_like(tokens, PAD)  # masked LM: no shift, only the non-PAD targets count
    masked[0, 2] = 6

    @jax.jit
    def losses(logits, tokens, masked):
        return NextTokenCrossEntropy()(logits, tokens), MaskedTokenCrossEntropy()(logits, masked)[0]

    (loss, aux), masked_loss = losses(logits, tokens, masked)
    nll = _manual_nll(logits[:, :-1], tokens[:, 1:])
    counted = tokens[:, 1:] != PAD
    assert float(loss) == pytest.approx(nll[counted].mean(), rel=1e-5) and 0 <= float(aux["token_accuracy"]) <= 1
    assert float(masked_loss) == pytest.approx(_manual_nll(logits, np.minimum(masked, 258))[0, 2], rel=1e-5)
    # whole-split metrics over two batches: exp of the mean NLL per counted token, exactly
    metrics = (Perplexity(), TokenAccuracy())
    states = init_states(metrics)
    for i in range(2):
        states = update_states(metrics, states, logits[i : i + 1], tokens[i : i + 1])
    out = compute_metrics(metrics, states)
    assert out["perplexity"] == pytest.approx(float(np.exp(nll[counted].mean())), rel=1e-5)
    correct = (logits[:, :-1].argmax(-1) == tokens[:, 1:]) & counted
    assert out["token_accuracy"] == pytest.approx(correct.sum() / counted.sum())
    with pytest.raises(ShapeError, match=r"NextTokenCrossEntropy: token ids \(2,\) int32 need logits"):
        jax.eval_shape(NextTokenCrossEntropy(), logits, tokens[:, 0])
    with pytest.raises(ConfigError, match=r"Perplexity.pad_id must be a non-negative token id, got -1"):
        Perplexity(pad_id=-1)


def test_the_token_losses_target_contract_speaks_before_anything_compiles():
    check = NextTokenCrossEntropy.targets.check
    logits = jax.ShapeDtypeStruct((4, 8, 259), jnp.float32)
    assert check(logits, jax.ShapeDtypeStruct((4, 8), jnp.int32)) is None
    assert "not integer token ids" in check(logits, jax.ShapeDtypeStruct((4, 8), jnp.float32))
    assert "need logits of shape (4,) + (vocab,)" in check(logits, jax.ShapeDtypeStruct((4,), jnp.int32))


def _with(module, **static):
    """`module` with static fields changed (``eqx.tree_at`` reaches array leaves only)."""
    import dataclasses

    new = object.__new__(type(module))
    for f in dataclasses.fields(module):
        object.__setattr__(new, f.name, static.get(f.name, getattr(module, f.name)))
    return new


# The code example (examples/code/pretrain_finetune.yaml), shortened: a 1-layer d_model 32 transformer on records of
# 32 bytes, 10 steps a stage (the pretraining with remat, in bfloat16), 32 validation records.
EXAMPLE = ROOT / "examples" / "code" / "pretrain_finetune.yaml"
SHORT = {
    "model_op.kwargs.d_model": 32,
    "model_op.kwargs.num_layers": 1,
    "model_op.kwargs.num_heads": 2,
    "model_op.kwargs.max_len": 32,
    "dataset.source.seq_len": 32,
    "val_dataset.source.seq_len": 32,
    "val_dataset.source.max_records": 32,
    "max_steps": 10,
    "eval_every_n_steps": 5,
    "log_every_n_steps": 5,
    "steps_per_call": 5,
    "batch_size": 8,
    "callbacks.0.every_n_steps": 5,
    "optimizer_config.warmup_steps": 2,
}
SETS = [f"--set=stages.{i}.{k}={v}" for i in (0, 1) for k, v in SHORT.items()] + [
    "--set=stages.0.model_op.kwargs.remat=true",
    "--set=stages.0.precision={compute: bfloat16}",
]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The shortened example run once through the CLI in this process: ``(store path, pretrain, finetune)``."""
    from pipekit_train import ArtifactStore
    from pipekit_train.cli import main

    tmp = tmp_path_factory.mktemp("code")
    store = tmp / "store.sqlite"
    assert main(["run", str(EXAMPLE), "--run-dir", str(tmp / "run"), "--store", str(store), *SETS]) == 0
    found = {a.stage: a for a in ArtifactStore(store).query()}
    return store, found["pretrain"], found["finetune"]


@pytest.fixture(scope="module")
def models(pipeline):
    from pipekit_train import load_model

    _, pretrain, finetune = pipeline
    return load_model(pretrain.model_registry_uri).module, load_model(finetune.model_registry_uri).module


@SHARED
def test_the_example_pretrains_then_finetunes_with_lineage_and_falling_perplexity(pipeline):
    from pipekit_train import ArtifactStore
    from pipekit_train.tracking import history

    store, pretrain, finetune = pipeline
    assert finetune.parent_ids == (pretrain.artifact_id,)
    lineage = ArtifactStore(store).lineage(finetune.artifact_id)
    assert pretrain.artifact_id in str(lineage)
    run_dir = str(Path(pretrain.run_dir))
    perplexity = history([run_dir])[run_dir]["pretrain"]["validate"]["perplexity"]
    assert perplexity["steps"] == [5, 10] and perplexity["values"][1] < perplexity["values"][0] < 259 * 1.1
    packages = ["asyncio", "email", "http", "importlib", "json", "logging", "unittest", "urllib"]
    assert finetune.source_statistics == {"classes": packages}
    assert pretrain.dataset_hash != finetune.dataset_hash


@SHARED
def test_generate_samples_the_same_text_for_the_same_seed_and_refuses_a_classifier(pipeline, capsys):
    from pipekit_train.cli import main

    store, pretrain, finetune = pipeline
    command = ["generate", pretrain.artifact_id[:12], "--prompt", "def ", "--max-new-tokens", "5"]
    command += ["--store", str(store)]
    assert main([*command, "--seed", "1"]) == 0 and main([*command, "--seed", "1"]) == 0
    first, second = capsys.readouterr().out.splitlines()[-2:]
    assert first == second and first.startswith("def ")
    command[1] = finetune.artifact_id[:12]
    assert main(command) == 2
    assert "not a language model (a transformer, not a transformer_classifier)" in capsys.readouterr().err


@SHARED
def test_the_transformer_is_causal_and_never_attends_to_padding(models):
    lm, clf = models
    ids = jnp.arange(32, dtype=jnp.int32) + 60
    short = jnp.array([256, 100, 101] + [PAD] * 29, jnp.int32)
    bidirectional = _with(clf, causal=False)

    @eqx.filter_jit
    def outputs(lm, clf, bidirectional):
        pooled = [(m(short), m(short[:3])) for m in (clf, bidirectional)]
        return lm(ids), lm(ids.at[5].set(9)), pooled

    out, changed, pooled = outputs(lm, clf, bidirectional)
    assert out.shape == (32, 259)
    np.testing.assert_array_equal(out[:5], changed[:5])  # positions before 5 never see token 5
    assert not np.allclose(out[5:], changed[5:])
    for padded, unpadded in pooled:  # pooled over the non-PAD tokens, whose states never look at padding
        np.testing.assert_allclose(padded, unpadded, rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeError, match=r"expects \(32,\) or shorter integer token ids"):
        eqx.filter_eval_shape(lm, jnp.zeros(33, jnp.int32))


@SHARED
def test_the_classifier_takes_the_language_models_embed_and_blocks(models):
    from pipekit_train.adapters.equinox import apply_transfer
    from pipekit_train.backends import Transfer

    lm, clf = models  # trained: the classifier's embed and blocks moved on from the language model's
    moved = apply_transfer(Transfer(paths={"embed": "embed", "blocks": "blocks"}), lm, clf)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(eqx.filter(clf, eqx.is_array))]
    assert ".blocks[0].attention.query_proj.weight" in paths and ".blocks[0].mlp.down.weight" in paths
    for a, b in zip(jax.tree.leaves((lm.embed, lm.blocks)), jax.tree.leaves((moved.embed, moved.blocks)), strict=True):
        np.testing.assert_array_equal(a, b)
    kwargs = {"vocab_size": 259, "d_model": 10, "num_heads": 4, "num_layers": 1, "max_len": 8}
    with pytest.raises(ConfigError, match=r"d_model \(10\) must be a multiple of num_heads \(4\)"):
        EquinoxModel(factory="transformer", kwargs=kwargs).build(0)


@SHARED
def test_remat_checkpoints_each_block(models):
    """Traced only: `jax.checkpoint` (``remat2`` in the jaxpr) recomputes the same numbers by construction."""
    lm, _ = models
    assert lm.remat  # the example's pretraining ran with remat: true
    ids = jnp.array([256, 1, 2, 3, 4, 5, 6, PAD], jnp.int32)

    def grad_jaxpr(model):
        params, static = eqx.partition(model, eqx.is_array)
        return str(jax.make_jaxpr(jax.grad(lambda p: eqx.combine(p, static)(ids).sum()))(params))

    assert "remat" in grad_jaxpr(lm) and "remat" not in grad_jaxpr(_with(lm, remat=False))


@SHARED
@pytest.mark.slow
def test_the_example_with_a_lora_finetune_resumes_bitwise_after_a_sigterm_and_a_sigkill(
    tmp_path, monkeypatch, capsys, xla_cache_env
):
    """One chain of real processes (``check-resume --kills 1``) of the example with its finetuning done by LoRA
    (rank 2 on the default targets, folded as on every zoo transformer: under 10% of the parameters train): a
    SIGTERM at the end of the pretraining, a SIGKILL inside a checkpoint write of the LoRA finetuning, each resumed
    with ``--resume auto`` and compared step by step with an uninterrupted run. (The full finetuning's path is the
    shortened run's above.)"""
    from pipekit_train.cli import main

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    for key, value in xla_cache_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    lora = ["--set=stages.1.optimizer_config.lora={rank: 2}"]
    sets = [a for s in SETS + lora for a in ("--set", s.removeprefix("--set="))]
    code = main(["check-resume", str(EXAMPLE), "--kills", "1", "--work-dir", "w", *sets])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "SIGTERM at step 10 of stage 'pretrain'" in out and "SIGKILL during the checkpoint save" in out, out
    assert "of stage 'finetune'" in out and "result: bitwise at all 2 kill points" in out, out
    # The finetuning trained the adapters only: the artifact records them beside the model's parameter count.
    info = json.loads((tmp_path / "w" / "chain" / "finetune" / "artifact.json").read_text())["backend_info"]
    assert info["lora"]["rank"] == 2 and 0 < info["trainable_params"] < 0.1 * info["num_params"], info


def _compare_module(monkeypatch):
    """examples/code/compare.py, imported from its file (examples/ is not a package)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("code_compare", ROOT / "examples" / "code" / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@SHARED  # last of the group: it trains its arms into the fixture's run folder
def test_the_code_comparison_trains_three_arms_and_judges_from_the_numbers(pipeline, monkeypatch):
    """compare.py on the shortened example's run (1 seed, 10 steps an arm): its finished pretraining is read back,
    full finetuning, LoRA and the classifier from scratch each train, and the verdict follows the numbers."""
    compare = _compare_module(monkeypatch)
    _, pretrain, _ = pipeline
    run_dir = Path(pretrain.run_dir).parent  # the artifact's run_dir is its stage's folder
    sets = [s.removeprefix("--set=") for s in SETS]
    before = (run_dir / "pretrain" / "metrics.jsonl").read_text()
    arms, has_test = compare.run_arms(run_dir, 1, sets)
    after = (run_dir / "pretrain" / "metrics.jsonl").read_text()
    assert after.startswith(before) and "stepping" not in after[len(before) :]  # read back, not trained again
    assert not has_test and list(arms) == ["full", "lora", "scratch"]
    for name, arm in arms.items():
        assert len(arm.metrics) == 1 and 0 <= arm.values("validate/accuracy")[0] <= 1
        assert arm.metrics[0]["train/lr"] == 0.0 and (run_dir / f"{name}_seed0" / "artifact.json").exists()
    full, lora, scratch = arms["full"], arms["lora"], arms["scratch"]
    assert full.trainable == scratch.trainable == full.params == 22_216
    # rank 8 on 4 attention projections (32x32), the MLP's up (32->128) and down, and the head (32->8)
    assert lora.trainable == 8 * (4 * 64 + 2 * 160 + 40) and lora.params == full.params
    assert full.metrics[0]["train/loss"] != scratch.metrics[0]["train/loss"]  # the trunk was handed over
    text = compare.table(arms, has_test, 1, sets)
    assert all(label in text for label in compare.LABELS.values()) and "SHORTENED" in text
    assert "verdict (validate accuracy): full finetune - scratch = " in text and "one seed" in text

    def judged(full, lora, scratch):
        values = {"full": full, "lora": lora, "scratch": scratch}
        fake = {n: compare.Arm(n, metrics=[{"validate/accuracy": v} for v in vs]) for n, vs in values.items()}
        return compare.verdict(fake, "validate/accuracy")

    assert "pretraining helps here" in judged([0.5, 0.52, 0.51], [0.5, 0.5, 0.52], [0.2, 0.22, 0.21])
    assert "LoRA and full finetuning are within the seeds' spread" in judged([0.5, 0.52, 0.51], [0.5, 0.5, 0.52], [0.2])
    assert "does not measurably help" in judged([0.3, 0.5, 0.2], [0.2, 0.21, 0.2], [0.25, 0.3, 0.35])
    assert "LoRA falls short of full finetuning" in judged([0.3, 0.5, 0.2], [0.1, 0.11, 0.1], [0.25, 0.3, 0.35])
    assert "pretraining hurts here" in judged([0.2, 0.21, 0.2], [0.5, 0.52, 0.51], [0.4, 0.41, 0.42])
