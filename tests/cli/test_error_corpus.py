# ruff: noqa: E501  (the expected error lines are whole lines, as a user sees them)
"""A corpus of user mistakes: each is one line on standard error, naming what was wrong, and exit code 2.

The CLI runs in-process (`main([...])`), in a directory set up once with a tiny pipeline, its data and a set of
broken variants. Each case asserts the exact first line of standard error (``{cwd}`` is the directory), that it
is the only line, and that no traceback was printed; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from pipekit_train.cli import main

PIPE = """\
pipekit: 1
type: Sequential
stages:
- type: TrainingLoop
  name: fit
  model_op: {type: EquinoxModel, factory: mlp, kwargs: {in_size: 4, out_size: 1, width_size: 8, depth: 1}}
  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}
  val_dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}, shuffle: false}
  loss: {type: MSE}
  optimizer_config: {name: adam, lr: 1e-2}
  max_steps: 20
  batch_size: 8
  eval_every_n_steps: 10
  log_every_n_steps: 5
"""

#: Broken variants of PIPE: file name -> (text to replace, replacement).
VARIANTS = {
    "field.yaml": ("max_steps: 20", "max_step: 20"),
    "type.yaml": ("type: MSE", "type: MSEE"),
    "wrongtype.yaml": ("batch_size: 8", "batch_size: eight"),
    "lr.yaml": ("lr: 1e-2}", "learning_rate: 1e-2}"),
    "optname.yaml": ("name: adam,", "name: adamm,"),
    "nodata.yaml": ("path: data.npz}}\n  val", "path: nodata.npz}}\n  val"),
    "wrongkeys.yaml": ("path: data.npz}}\n  val", "path: wrongkeys.npz}}\n  val"),
    "objects.yaml": ("path: data.npz}}\n  val", "path: objects.npz}}\n  val"),
    "datadir.yaml": ("path: data.npz}}\n  val", "path: folder}}\n  val"),
    "notnpz.yaml": ("path: data.npz}}\n  val", "path: pipe.yaml}}\n  val"),
    "ragged.yaml": ("{type: NpzSource, path: data.npz}}\n  val", "{type: DataFile, path: ragged.json}}\n  val"),
    "bigbatch.yaml": ("batch_size: 8", "batch_size: 100000"),
    "syntax.yaml": ("loss: {type: MSE}", "loss: {type: MSE"),
    "losskind.yaml": ("loss: {type: MSE}", "loss: {type: EarlyStopping}"),
    "warmup.yaml": ("lr: 1e-2}", "lr: 1e-2, schedule: warmup_cosine, warmup_steps: 100}"),
    "factory.yaml": ("factory: mlp", "factory: mpl"),
    "shape.yaml": ("in_size: 4", "in_size: 5"),
    "kwarg.yaml": ("width_size: 8", "width: 8"),
    "tab.yaml": ("  max_steps: 20", "\tmax_steps: 20"),
    "dupkey.yaml": ("  batch_size: 8", "  batch_size: 8\n  batch_size: 16"),
    "pyobj.yaml": ("loss: {type: MSE}", "loss: !!python/object:os.system {}"),
    "dotted.yaml": ("type: MSE", "type: os.system"),
    "notype.yaml": ("loss: {type: MSE}", "loss: {name: MSE}"),
    "missing.yaml": ("  dataset: {type: TrainingDataset, source: {type: NpzSource, path: data.npz}}\n", ""),
    "negsteps.yaml": ("max_steps: 20", "max_steps: -5"),
    "ckptsel.yaml": (
        "  max_steps: 20",
        "  max_steps: 20\n  callbacks: [{type: Checkpoint, keep: [{type: Lats, n: 3}]}]",
    ),
    "writer.yaml": ("  max_steps: 20", "  max_steps: 20\n  metric_writer: {type: TensorboardWriter}"),
    "monitor.yaml": ("  max_steps: 20", "  max_steps: 20\n  callbacks: [{type: EarlyStopping, monitr: validate/loss}]"),
    "backend.yaml": ("  max_steps: 20", "  max_steps: 20\n  backend: jaxx"),
}

#: (command line, the exact first line of standard error). ``…`` stands for what grows as types, fields and
#: commands are added (registered types, allowed fields, further close names); ``{cwd}`` for the working directory.
CASES: list[tuple[str, str]] = [
    (
        "rnu pipe.yaml",
        "pipekit-train: error: unknown command 'rnu' (did you mean 'run'…?); choose from run, validate, … (see pipekit-train --help)",
    ),
    (
        "valdiate pipe.yaml",
        "pipekit-train: error: unknown command 'valdiate' (did you mean 'validate'…?); choose from run, validate, … (see pipekit-train --help)",
    ),
    (
        "artifacts shwo abc",
        "pipekit-train artifacts: error: unknown value for ACTION 'shwo' (did you mean 'show'…?); choose from list, show, … (see pipekit-train artifacts --help)",
    ),
    (
        "validate",
        "pipekit-train validate: error: the following arguments are required: PIPELINE.yaml (see pipekit-train validate --help)",
    ),
    ("validate nope.yaml", "pipekit-train: error: pipeline file not found: nope.yaml"),
    ("validate folder.yaml", "pipekit-train: error: folder.yaml is a directory, not a pipeline file"),
    ("validate data.npz", "pipekit-train: error: data.npz: not UTF-8 text (byte 14 is b'\\xf4')"),
    (
        "validate field.yaml",
        "pipekit-train: error: field.yaml:11:3: TrainingLoop has no field 'max_step' (did you mean 'max_steps'?); allowed fields: model_op, …",
    ),
    (
        "validate type.yaml",
        "pipekit-train: error: type.yaml:9:16: unknown operator type 'MSEE' (did you mean 'MSE'…?); registered types: …; if a module of yours defines it, import it first with --import MODULE or $PIPEKIT_IMPORT",
    ),
    (
        "validate wrongtype.yaml",
        "pipekit-train: error: wrongtype.yaml:12:15: TrainingLoop.batch_size must be int, got 'eight'",
    ),
    (
        "validate lr.yaml",
        "pipekit-train: error: lr.yaml:10:21: unknown optimizer_config key 'learning_rate' (did you mean 'lr'?); allowed keys: name, lr, …",
    ),
    (
        "validate optname.yaml",
        "pipekit-train: error: optname.yaml:10:21: optimizer_config.name must be one of adamw, adam, sgd, lion, rmsprop, got 'adamm' (did you mean 'adam' or 'adamw'?)",
    ),
    (
        "validate nodata.yaml",
        "pipekit-train: error: nodata.yaml: NpzSource.path: file not found: 'nodata.npz' (relative paths are read from the working directory {cwd})",
    ),
    (
        "validate wrongkeys.yaml",
        "pipekit-train: error: wrongkeys.yaml: TrainingLoop.input_key is 'x' but the dataset's batches have keys ['features', 'labels']",
    ),
    (
        "validate objects.yaml",
        "pipekit-train: error: objects.yaml: NpzSource.path: 'objects.npz' holds object arrays (pickled Python objects), which are never loaded; save plain numeric arrays (np.asarray(x, dtype=...))",
    ),
    (
        "validate datadir.yaml",
        "pipekit-train: error: datadir.yaml: NpzSource.path: 'folder' is a directory, not a file",
    ),
    (
        "validate notnpz.yaml",
        "pipekit-train: error: notnpz.yaml: NpzSource.path: 'pipe.yaml' is not a .npz or .npy file (numpy cannot read it)",
    ),
    (
        "validate ragged.yaml",
        "pipekit-train: error: ragged.yaml: DataFile 'ragged.json': 'y' is not a rectangular array of numbers (nested lists of different lengths, or a number too large)",
    ),
    (
        "validate bigbatch.yaml",
        "pipekit-train: error: bigbatch.yaml: TrainingDataset: batch_size 100000 is larger than the 40 records, so drop_remainder=True leaves no batch at all; use a batch_size of at most 40 or drop_remainder=False",
    ),
    (
        "validate syntax.yaml",
        "pipekit-train: error: syntax.yaml:10:19: YAML syntax error: did not find expected ',' or '}'",
    ),
    (
        "validate losskind.yaml",
        "pipekit-train: error: losskind.yaml:9:9: TrainingLoop.loss must be Loss or null, got EarlyStopping()",
    ),
    (
        "validate warmup.yaml",
        "pipekit-train: error: warmup.yaml: optimizer_config.warmup_steps must be < 20 for schedule 'warmup_cosine' (decay_steps defaults to max_steps=20), got 100; lower warmup_steps or raise max_steps",
    ),
    (
        "validate factory.yaml",
        "pipekit-train: error: factory.yaml:6:43: EquinoxModel.factory 'mpl' is not a registered model factory (did you mean 'mlp'?); registered: autoencoder, classifier, cnn, mlp…",
    ),
    (
        "validate shape.yaml",
        "pipekit-train: error: shape.yaml: the data's per-example input has shape (4,) and dtype float32, but EquinoxModel(factory='mlp', kwargs={'in_size': 5, 'out_size': 1, 'width_size': 8, 'depth': 1}) expects (5,) (its first Linear has in_features=5); tracing one example failed with: …",
    ),
    (
        "validate kwarg.yaml",
        "pipekit-train: error: kwarg.yaml:6:56: EquinoxModel.kwargs: factory 'mlp' has no parameter 'width' (did you mean 'width_size' or 'depth'?); it accepts: in_size, out_size, width_size, depth, activation",
    ),
    (
        "validate tab.yaml",
        "pipekit-train: error: tab.yaml:11:1: YAML syntax error: found character that cannot start any token",
    ),
    ("validate dupkey.yaml", "pipekit-train: error: dupkey.yaml:13:3: duplicate key 'batch_size'"),
    (
        "validate pyobj.yaml",
        "pipekit-train: error: pyobj.yaml:9:9: YAML tag 'tag:yaml.org,2002:python/object:os.system' is not allowed on a mapping",
    ),
    (
        "validate dotted.yaml",
        "pipekit-train: error: dotted.yaml:9:16: operator type must be a registered name, got 'os.system'; pipekit never imports a module or attribute named in a file",
    ),
    (
        "validate notype.yaml",
        "pipekit-train: error: notype.yaml:9:9: TrainingLoop.loss must be Loss or null, got {'name': 'MSE'}",
    ),
    (
        "validate missing.yaml",
        "pipekit-train: error: missing.yaml:4:3: TrainingLoop is missing required field(s): dataset",
    ),
    (
        "validate negsteps.yaml",
        "pipekit-train: error: negsteps.yaml:11:14: TrainingLoop.max_steps must be a positive int, got -5",
    ),
    (
        "validate ckptsel.yaml",
        "pipekit-train: error: ckptsel.yaml:12:48: unknown operator type 'Lats' (did you mean 'Last'…?); registered types: …; if a module of yours defines it, import it first with --import MODULE or $PIPEKIT_IMPORT",
    ),
    (
        "validate writer.yaml",
        "pipekit-train: error: writer.yaml:12:25: unknown operator type 'TensorboardWriter' (did you mean 'TensorBoardWriter'…?); registered types: …; if a module of yours defines it, import it first with --import MODULE or $PIPEKIT_IMPORT",
    ),
    (
        "validate monitor.yaml",
        "pipekit-train: error: monitor.yaml:12:37: EarlyStopping has no field 'monitr' (did you mean 'monitor'?); allowed fields: order, monitor, mode, patience, min_delta",
    ),
    (
        "validate backend.yaml",
        "pipekit-train: error: backend.yaml:12:12: TrainingLoop.backend 'jaxx' is not a registered backend; installed backends: … (a plugin registers more through the 'pipekit_train.backends' entry-point group, or pipekit_train.register_backend in a module loaded with --import)",
    ),
    (
        "validate empty.yaml",
        "pipekit-train: error: empty.yaml: the document is empty; expected an operator mapping with a 'type:' key",
    ),
    (
        "validate scalar.yaml",
        "pipekit-train: error: scalar.yaml:1:1: the document must be a mapping with a 'type:' key",
    ),
    (
        "validate version.yaml",
        "pipekit-train: error: version.yaml:1:10: unsupported pipekit format version 2; this pipekit reads version 1",
    ),
    (
        "validate noseq.yaml",
        "pipekit-train: error: noseq.yaml:3:9: Sequential.stages must hold at least one operator, got ()",
    ),
    (
        "validate pipe.yaml --set max_steps=10",
        "pipekit-train: error: --set max_steps: Sequential has no field 'max_steps' (did you mean 'stages.0.max_steps'?); allowed fields: stages",
    ),
    (
        "validate pipe.yaml --set stages.0.max_step=10",
        "pipekit-train: error: --set stages.0.max_step: TrainingLoop has no field 'max_step' (did you mean 'max_steps'?); allowed fields: model_op, …",
    ),
    (
        "validate pipe.yaml --set stages.5.max_steps=10",
        "pipekit-train: error: --set stages.5: expected a list index from 0 to 1 (1 appends), got '5'",
    ),
    (
        "validate pipe.yaml --set stages.0.max_steps=ten",
        "pipekit-train: error: --set stages.0.max_steps: TrainingLoop.max_steps must be int, got 'ten'",
    ),
    (
        "validate pipe.yaml --set stages.0.max_steps",
        "pipekit-train: error: --set expects PATH=VALUE (for example stages.0.max_steps=100), got 'stages.0.max_steps'",
    ),
    ("validate pipe.yaml --set '=3'", "pipekit-train: error: --set '=3': the path before '=' is empty"),
    (
        "validate pipe.yaml --set stages.0.max_steps=5 --set 'stages.0.optimizer_config={name: adam, lr: 0.01, schedule: warmup_cosine, warmup_steps: 100}'",
        "pipekit-train: error: pipe.yaml: optimizer_config.warmup_steps must be < 5 for schedule 'warmup_cosine' (decay_steps defaults to max_steps=5), got 100; lower warmup_steps or raise max_steps",
    ),
    (
        "validate pipe.yaml --set 'stages.0.loss={type: MSE'",
        "pipekit-train: error: --set stages.0.loss:2:1: YAML syntax error: did not find expected ',' or '}'",
    ),
    (
        "validate pipe.yaml --set 'stages.0.loss=MSE'",
        "pipekit-train: error: --set stages.0.loss: TrainingLoop.loss must be Loss or null, got 'MSE'",
    ),
    (
        "validate pipe.yaml --set 'stages.0.loss={type: Foo}'",
        "pipekit-train: error: --set stages.0.loss:1:8: unknown operator type 'Foo'; registered types: …",
    ),
    (
        "validate pipe.yaml --set 'stages.0.metric_writer={type: TensorboardWriter}'",
        "pipekit-train: error: --set stages.0.metric_writer:1:8: unknown operator type 'TensorboardWriter' (did you mean 'TensorBoardWriter'…?); registered types: …",
    ),
    (
        "validate pipe.yaml --set 'stages.0.callbacks=[{type: Checkpoint, keep: [{type: Lats, n: 3}]}]'",
        "pipekit-train: error: --set stages.0.callbacks:1:35: unknown operator type 'Lats' (did you mean 'Last'…?); registered types: …",
    ),
    (
        "validate pipe.yaml --set stages.0.callbacks.0.patience=3",
        "pipekit-train: error: --set stages.0.callbacks.0: there is no item 0 yet; set the whole item first",
    ),
    (
        "validate pipe.yaml --set stages.0.optimizer_config.learning_rate=0.1",
        "pipekit-train: error: --set stages.0.optimizer_config.learning_rate: unknown optimizer_config key 'learning_rate' (did you mean 'lr'?); allowed keys: name, lr, …",
    ),
    (
        "validate pipe.yaml --set 'stages.0.optimizer_config={name: adam, weight_decay: 0.1}'",
        "pipekit-train: error: --set stages.0.optimizer_config: optimizer_config.weight_decay does not apply to name='adam' (use name: adamw for decoupled weight decay); adam takes b1, b2, eps; weight_decay applies to adamw, sgd, lion, rmsprop",
    ),
    (
        "validate pipe.yaml --set 'stages.0.optimizer_config.lora={rank: 0}'",
        "pipekit-train: error: --set stages.0.optimizer_config.lora: optimizer_config.lora.rank must be an int >= 1, got 0",
    ),
    (
        "validate pipe.yaml --set 'stages.0.optimizer_config.lora={rank: 4}'",
        "pipekit-train: error: pipe.yaml: stage 'fit': optimizer_config.lora.targets is not set, and its default (the attention and MLP projections: *.attention.*_proj, *.mlp.up, *.mlp.down) matches no linear layer of the 'mlp' model; its linear layers are layers[0], layers[1]: set optimizer_config.lora.targets, e.g. ['layers[*]']",
    ),
    (
        "validate pipe.yaml --set \"stages.0.optimizer_config.lora={targets: ['layer[1]']}\"",
        "pipekit-train: error: pipe.yaml: stage 'fit': optimizer_config.lora.targets[0] 'layer[1]' matches no linear layer of the 'mlp' model (did you mean 'layers[1]' or 'layers[0]' or 'layers'?); its linear layers are layers[0], layers[1]",
    ),
    (
        "validate pipe.yaml --set stages.0.input_key=inputs",
        "pipekit-train: error: pipe.yaml: stage 'fit': TrainingLoop.val_dataset has no 'inputs' (its batches have keys ['x', 'y']); evaluation runs the same model and loss as training",
    ),
    (
        "validate pipe.yaml --set stages.0.model_op.kwargs.in_size=4.5",
        "pipekit-train: error: pipe.yaml: EquinoxModel: factory 'mlp' failed with kwargs {'in_size': 4.5, 'out_size': 1, 'width_size': 8, 'depth': 1}: TypeError: …",
    ),
    (
        "validate pipe.yaml --set stages.0.resume=yes",
        "pipekit-train: error: --set stages.0.resume: TrainingLoop.resume must be one of 'never', 'auto', got True",
    ),
    (
        "validate pipe.yaml --set stages.0.seed=1.5",
        "pipekit-train: error: --set stages.0.seed: TrainingLoop.seed must be int, got 1.5",
    ),
    (
        "validate pipe.yaml --set 'stages.0.name=my stage'",
        "pipekit-train: error: --set stages.0.name: TrainingLoop.name must be a simple name (letters, digits, _ or -), got 'my stage'",
    ),
    (
        "validate pipe.yaml --import no_such_module_xyz",
        "pipekit-train: error: --import no_such_module_xyz: cannot import module 'no_such_module_xyz': no module named 'no_such_module_xyz' on PYTHONPATH, among the installed packages or in the working directory {cwd}",
    ),
    (
        "run pipe.yaml --resume sometimes",
        "pipekit-train run: error: unknown value for --resume 'sometimes'; choose from never, auto (see pipekit-train run --help)",
    ),
    ("run pipe.yaml --force-resume", "pipekit-train: error: --force-resume continues a run: use it with --resume auto"),
    (
        "run pipe.yaml --resume auto",
        "pipekit-train: error: --resume auto continues the run in --run-dir DIR: name that directory (without --run-dir every run starts in a new runs/<run id>)",
    ),
    ("run pipe.yaml --bogus", "pipekit-train: error: unrecognized arguments: --bogus (see pipekit-train --help)"),
    (
        "run pipe.yaml --store folder",
        "pipekit-train: error: --store folder: is a directory; --store names the SQLite file, e.g. --store folder/artifacts.sqlite",
    ),
    (
        "run bigbatch.yaml --run-dir runs/x",
        "pipekit-train: error: bigbatch.yaml: TrainingDataset: batch_size 100000 is larger than the 40 records, so drop_remainder=True leaves no batch at all; use a batch_size of at most 40 or drop_remainder=False",
    ),
    (
        "run warmup.yaml --run-dir runs/x --set stages.0.max_steps=20",
        "pipekit-train: error: warmup.yaml: optimizer_config.warmup_steps must be < 20 for schedule 'warmup_cosine' (decay_steps defaults to max_steps=20), got 100; lower warmup_steps or raise max_steps",
    ),
    (
        "run pipe.yaml --store pipe.yaml/s.sqlite --run-dir runs/x",
        "pipekit-train: error: the artifact store {cwd}/pipe.yaml/s.sqlite cannot be written ({cwd}/pipe.yaml is a file, not a folder); nothing was trained. Choose a writable store with --store PATH (or PIPEKIT_ARTIFACT_STORE), or record nothing with --no-store",
    ),
    ("run pipe.yaml --run-dir pipe.yaml", "pipekit-train: error: --run-dir pipe.yaml: is a file, not a directory"),
    (
        "artifacts show deadbeef --store store.sqlite",
        "pipekit-train artifacts: error: no artifact with id 'deadbeef' in {cwd}/store.sqlite (0 artifacts recorded)",
    ),
    (
        "artifacts show deadbeef --store nostore.sqlite",
        "pipekit-train artifacts: error: no artifact store at {cwd}/nostore.sqlite; pass --store PATH or set $PIPEKIT_ARTIFACT_STORE (runs record to ./runs/artifacts.sqlite by default)",
    ),
    (
        "artifacts query --metric 'acc>>1' --store store.sqlite",
        "pipekit-train artifacts: error: --metric must look like NAME OP NUMBER with OP one of < <= > >= == !=, e.g. 'validate/accuracy>=0.9'; got 'acc>>1'",
    ),
    (
        "artifacts query --since yesterday --store store.sqlite",
        "pipekit-train artifacts: error: --since must be an ISO-8601 time (2026-05-01, 2026-05-01T12:00:00Z) or an age (30m, 12h, 7d, 2w); got 'yesterday'",
    ),
    (
        "artifacts import nodir --store store.sqlite",
        "pipekit-train artifacts: error: artifacts import: nodir is not a directory (give a run directory)",
    ),
    (
        "reproduce abc --store store.sqlite",
        "pipekit-train: error: no artifact with id 'abc' in {cwd}/store.sqlite (0 artifacts recorded)",
    ),
    (
        "export deadbeef -o model.jaxexport --store store.sqlite",
        "pipekit-train export: error: no artifact with id 'deadbeef' in {cwd}/store.sqlite (0 artifacts recorded)",
    ),
    ("runs nodir", "pipekit-train runs: error: run directory not found: nodir"),
    ("average nodir --last 5 -o out", "pipekit-train average: error: nodir: no such directory"),
    ("average folder --last 0 -o out", "pipekit-train average: error: --last must be a positive int, got '0'"),
    (
        "average ckpts --last 5 -o out",
        "pipekit-train average: error: Last(n=5) asks for 5 checkpoints but {cwd}/ckpts holds only 3 it can pick (steps 10, 20, 30); ask for 3, or keep more when training (Checkpoint keep=...)",
    ),
    ("history nodir", "pipekit-train history: error: nodir: no such run directory"),
    (
        "history history.txt",
        "pipekit-train history: error: history.txt:1: not a JSON record (Expecting value): 'not json'",
    ),
    (
        "describe TrainingLop",
        "pipekit-train describe: error: unknown operator type 'TrainingLop' (did you mean 'TrainingLoop'…?); registered types: …",
    ),
    (
        "describe Los",
        "pipekit-train describe: error: unknown operator type 'Los' (did you mean 'Loss'…?); registered types: …",
    ),
    (
        "schema -o nodir/x.json",
        "pipekit-train schema: error: -o nodir/x.json: cannot write the schema: No such file or directory",
    ),
]


def _setup(root: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    np.savez(root / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    np.savez(root / "wrongkeys.npz", features=x, labels=x[:, :1])
    (root / "ragged.json").write_text('{"J": 2, "y": [[1, 2], [3]]}')
    np.savez(root / "objects.npz", x=np.array([{"a": 1}] * 40, dtype=object), y=x[:, :1])
    (root / "pipe.yaml").write_text(PIPE)
    for name, (old, new) in VARIANTS.items():
        assert old in PIPE, name
        (root / name).write_text(PIPE.replace(old, new, 1))
    (root / "empty.yaml").write_text("")
    (root / "scalar.yaml").write_text("just a string\n")
    (root / "version.yaml").write_text("pipekit: 2\ntype: MSE\n")
    (root / "noseq.yaml").write_text("pipekit: 1\ntype: Sequential\nstages: []\n")
    (root / "folder").mkdir()
    (root / "folder.yaml").mkdir()
    (root / "history.txt").write_text("not json\n")
    import jax.numpy as jnp

    from pipekit_train import Checkpointer, Last

    for name, steps in (("ckpts", (10, 20, 30)), ("spread", (10, 20, 30, 1000))):
        with Checkpointer(root / name, keep=(Last(n=len(steps)),)) as ckpt:
            for step in steps:
                ckpt.save(step, state={"w": jnp.full(3, float(step))}, data_iter={}, meta={"stage": "fit"})
    from pipekit_train.provenance import ArtifactStore

    with ArtifactStore(str(root / "store.sqlite")) as store:
        len(store)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mistakes")
    _setup(root)
    return root


@pytest.fixture
def in_corpus(corpus_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(corpus_dir)
    for var in ("PIPEKIT_ARTIFACT_STORE", "PIPEKIT_IMPORT", "PIPEKIT_DEBUG", "PIPEKIT_MODEL_REGISTRY"):
        monkeypatch.delenv(var, raising=False)
    return corpus_dir


def _matches(expected: str, line: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in expected.split("…"))
    return re.fullmatch(pattern, line) is not None


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 40 and len({argv for argv, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("argv,expected", CASES, ids=[argv for argv, _ in CASES])
def test_mistake_is_one_line_and_exit_code_2(
    argv: str, expected: str, in_corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(p.name for p in in_corpus.iterdir())
    code, _, err = _run(shlex.split(argv), capsys)
    lines = err.splitlines()
    assert code == 2, err
    assert lines and _matches(expected.replace("{cwd}", str(in_corpus)), lines[0]), lines[:1]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in in_corpus.iterdir()) == before  # a refused command claims nothing (no runs/)


def test_debug_adds_the_traceback(in_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expected = "pipekit-train: error: field.yaml:11:3: TrainingLoop has no field 'max_step' (did you mean 'max_steps'?)"
    for argv in (["--debug", "validate", "field.yaml"], ["validate", "field.yaml", "--debug"]):
        code, _, err = _run(argv, capsys)
        lines = err.splitlines()
        assert code == 2 and lines[0] == "Traceback (most recent call last):", err
        assert lines[-1].startswith(expected) and "ConfigError" in err
    # $PIPEKIT_DEBUG does the same; without either, one line.
    os.environ["PIPEKIT_DEBUG"] = "1"
    try:
        code, _, err = _run(["validate", "field.yaml"], capsys)
    finally:
        del os.environ["PIPEKIT_DEBUG"]
    assert code == 2 and err.startswith("Traceback") and err.splitlines()[-1].startswith(expected)
    code, _, err = _run(["validate", "field.yaml"], capsys)
    assert code == 2 and err.splitlines() == [err.strip()] and err.startswith(expected)


def test_debug_lasts_one_call(in_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `main` called in-process with --debug leaves nothing behind: the next command of this process, through any
    # entry point, prints its error as one line (it once printed tracebacks after an earlier test's --debug).
    from pipekit_train.cli._schema import main as schema_main

    code, _, err = _run(["validate", "field.yaml", "--debug"], capsys)
    assert code == 2 and err.startswith("Traceback")
    assert schema_main(["describe", "TrainingLop"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and "did you mean 'TrainingLoop'" in err


def test_an_internal_error_says_how_to_report_it(
    in_corpus: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipekit_train.cli import _main

    def broken(args: object) -> int:  # a bug: an exception that no user input explains
        return {}["missing"]  # type: ignore[no-any-return]

    monkeypatch.setattr(_main, "_cmd_validate", broken)
    code, _, err = _run(["validate", "pipe.yaml"], capsys)
    assert code == 1
    assert err.splitlines() == [
        "pipekit-train: internal error: KeyError: 'missing' (a bug in pipekit-train: please report it; "
        "rerun with --debug for the traceback)"
    ]
    code, _, err = _run(["validate", "pipe.yaml", "--debug"], capsys)
    assert code == 1 and err.startswith("Traceback") and "in broken" in err


def test_digits_without_scikit_learn(
    in_corpus: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)  # what Python does when the package is not installed
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    pipe = PIPE.replace(
        "source: {type: NpzSource, path: data.npz}}\n  val",
        "source: {type: RegisteredSource, name: digits, kwargs: {seed: 8231}}}\n  val",
    )
    Path("digits_pipe.yaml").write_text(pipe)
    try:
        code, _, err = _run(["validate", "digits_pipe.yaml"], capsys)
    finally:
        Path("digits_pipe.yaml").unlink()
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == [
        "pipekit-train: error: the 'digits' dataset needs scikit-learn: pip install 'pipekit-train[examples]'"
    ]


class _ClosedPipe(io.StringIO):
    """Standard output whose reader went away (``pipekit-train ... | head`` after head exits)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_pipe_is_not_an_error(in_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        saved_out, saved_err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _ClosedPipe(), io.StringIO()
        try:
            code = main(["describe", "TrainingLoop"])
            code_list = main(["artifacts", "list", "--store", "store.sqlite"])
            err = sys.stderr.getvalue()
        finally:
            sys.stdout, sys.stderr = saved_out, saved_err
    assert code in (0, 141) and code_list == 141 and err == ""


def test_averaging_far_apart_checkpoints_says_so(in_corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = in_corpus / "spread-avg"
    try:
        code, stdout, err = _run(["average", "spread", "--last", "4", "-o", str(out)], capsys)
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    assert code == 0 and "averaged 4 checkpoint(s)" in stdout and "(steps 10, 20, 30, 1000)" in stdout
    assert err.splitlines() == [
        "pipekit-train average: warning: the averaged checkpoints are unevenly spaced (10 to 970 steps apart): the "
        "average mixes weights from far-apart points of training; choose the steps with --steps to average only "
        "nearby ones"
    ]
