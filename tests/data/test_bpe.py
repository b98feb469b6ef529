"""The trained BPE tokenizer of `TextSource` (``tokenizer: {name: bpe, vocab_size: N}``): trained on the training
split only, deterministic (in one process and across processes), a round trip for any text with the byte
tokenizer's special ids, given to the other splits and recorded with the artifact, used by ``evaluate`` and by
``generate`` with no retraining, one-line errors, a model vocabulary checked at pre-flight, and a data hash (and a
resume fingerprint) that changes with the tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train.data import TextSource, TrainingDataset
from pipekit_train.data._bpe import BpeTokenizer, byte_symbols
from pipekit_train.data._text import _train
from pipekit_train.data._tokenizer import BOS, EOS, PAD, encode

pytest.importorskip("tokenizers")

#: One word per file, each repeated: a word of a training file becomes one token, a word of a validation file not.
WORDS = ["kappa", "lambda", "sigma", "omega", "theta", "delta", "gamma", "zeta"]
BPE = {"name": "bpe", "vocab_size": 400}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "corpus").mkdir()
    for i, word in enumerate(WORDS):
        text = f"def f{i}(x):\n    return x + {i}  # {word}\n" + f" {word}" * 20 + "\nπ≈3.14 — ünïcödé\n"
        (root / "corpus" / f"{word}.txt").write_text(text, encoding="utf-8")
    return root


def _source(corpus: Path, split: str = "train", **kw) -> TextSource:
    fields = {"tokenizer": BPE, "fractions": {"train": 0.5, "val": 0.5}, "split": split, **kw}
    return TextSource(paths=(str(corpus / "corpus" / "*.txt"),), seq_len=16, **fields)


def test_the_tokenizer_is_trained_on_the_training_split_only(corpus: Path):
    train = _source(corpus).fit()
    tok = train.text_tokenizer()
    words = {Path(p).stem for _, p, _ in train._split_files()}
    assert len(words) == 4
    for word in WORDS:
        n = len(tok.encode(f" {word}", bos=False, eos=False))
        assert (n == 1) == (word in words), (word, n)
    # the validation split reads with the training split's tokenizer, never one of its own
    val = _source(corpus, "val").with_fitted(train.fitted_statistics(), "val_dataset")
    assert val.statistics == {"tokenizer": train.statistics["tokenizer"]}
    assert val.text_tokenizer() is tok and val.fitted and pipekit.loads(pipekit.dumps(val)) == val


def test_training_is_deterministic_in_one_process_and_across_processes(corpus: Path):
    first = _source(corpus).fit().statistics["tokenizer"]
    _train.cache_clear()
    again = _source(corpus).fit().statistics["tokenizer"]
    assert again["json"] == first["json"] and again["sha256"] == first["sha256"]
    code = textwrap.dedent(f"""
        from pipekit_train.data import TextSource
        src = TextSource(paths=({str(corpus / "corpus" / "*.txt")!r},), seq_len=16, tokenizer={BPE!r},
                         fractions={{"train": 0.5, "val": 0.5}}, split="train")
        print(src.fit().statistics["tokenizer"]["sha256"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == first["sha256"]


def test_ids_keep_the_byte_tokenizers_bytes_and_special_ids_and_round_trip_any_text(corpus: Path):
    source = _source(corpus).fit()
    tok = source.text_tokenizer()
    spec = json.loads(source.statistics["tokenizer"]["json"])
    vocab = spec["model"]["vocab"]
    assert [vocab[byte_symbols()[b]] for b in range(256)] == list(range(256))
    assert sorted(vocab.values()) == list(range(len(vocab))) and 259 < tok.vocab_size == len(vocab) <= 400
    assert tok.encode("A\x00", bos=False, eos=False).tolist() == encode("A\x00", bos=False, eos=False).tolist()
    for text in ["π≈3.14 — ünïcödé 🤗\n\t  x", " kappa lambda", "<|eos|> <|pad|>", ""]:
        ids = tok.encode(text)
        assert ids[0] == BOS and ids[-1] == EOS and ids.dtype == np.int32
        assert not {BOS, EOS, PAD} & set(ids[1:-1].tolist())  # special-token text is text
        assert tok.decode(ids) == text and tok.decode([*ids, PAD, 10_000]) == text
    arrays = source.load()
    assert 259 <= arrays["x"][arrays["x"] != PAD].max() < tok.vocab_size  # merged tokens, all in the vocabulary
    assert len(arrays["x"].ravel()) < len(_source(corpus, tokenizer="bytes").load()["x"].ravel())


def test_the_data_hash_changes_with_the_tokenizer_setting(corpus: Path):
    digests = {
        str(t): _source(corpus, tokenizer=t).content_digest()
        for t in ("bytes", BPE, {**BPE, "vocab_size": 300}, {**BPE, "min_frequency": 3})
    }
    assert len(set(digests.values())) == 4
    hashes = {TrainingDataset(source=_source(corpus, tokenizer=t)).content_hash() for t in ("bytes", BPE)}
    assert len(hashes) == 2


@pytest.mark.parametrize(
    ("tokenizer", "message"),
    [
        ("bpe", r"TextSource.tokenizer must be bytes or a mapping \{name: bpe, vocab_size: N\}, got 'bpe'.*1024"),
        ("byte", r"got 'byte'.*did you mean 'bytes'"),
        ({"name": "bpe"}, r"TextSource.tokenizer: a bpe tokenizer needs vocab_size"),
        ({"name": "bpe", "vocab_size": 100}, r"TextSource.tokenizer.vocab_size must be an int from 260 .*got 100"),
        ({"name": "bpe", "vocab_size": 512, "min_freq": 2}, r"no setting 'min_freq'.*did you mean 'min_frequency'"),
        ({"name": "bpee", "vocab_size": 512}, r"TextSource.tokenizer.name must be one of bytes, bpe, got 'bpee'"),
        ({**BPE, "min_frequency": 0}, r"TextSource.tokenizer.min_frequency must be a positive int, got 0"),
    ],
)
def test_a_bad_setting_is_one_clear_error(tokenizer, message):
    with pytest.raises(ConfigError, match=message):
        TextSource(paths=("*.txt",), seq_len=8, tokenizer=tokenizer)


def test_another_split_refuses_a_tokenizer_of_another_setting_or_a_changed_record(corpus: Path):
    recorded = _source(corpus).fit().fitted_statistics()
    other = _source(corpus, "val", tokenizer={**BPE, "vocab_size": 300})
    with pytest.raises(ConfigError, match=r"val_dataset: TextSource.tokenizer is bpe vocab_size=300.*vocab_size=400"):
        other.with_fitted(recorded, "val_dataset")
    changed = {"tokenizer": {**recorded["tokenizer"], "json": recorded["tokenizer"]["json"] + " "}}
    with pytest.raises(ConfigError, match=r"the record was changed"):
        _source(corpus, "val").with_fitted(changed, "val_dataset")
    spec = json.loads(recorded["tokenizer"]["json"])
    vocab = spec["model"]["vocab"]
    vocab["A"], vocab["B"] = vocab["B"], vocab["A"]  # bytes no longer at their own ids
    with pytest.raises(ConfigError, match=r"does not hold the bytes at 0..255"):
        BpeTokenizer(json.dumps(spec))


PIPELINE = """\
pipekit: 1
type: TrainingLoop
name: lm
model_op:
  type: EquinoxModel
  factory: transformer
  kwargs: {vocab_size: VOCAB, d_model: 16, num_heads: 2, num_layers: 1, max_len: 16}
dataset:
  type: TrainingDataset
  source: {type: TextSource, paths: [corpus/*.txt], seq_len: 16, tokenizer: {name: bpe, vocab_size: 400},
           split: train, fractions: {train: 0.5, val: 0.5}}
val_dataset:
  type: TrainingDataset
  source: {type: TextSource, paths: [corpus/*.txt], seq_len: 16, tokenizer: {name: bpe, vocab_size: 400},
           split: val, fractions: {train: 0.5, val: 0.5}}
loss: {type: NextTokenCrossEntropy}
target_key: x
metrics: [{type: Perplexity}]
optimizer_config: {name: adam, lr: 0.01}
max_steps: 4
batch_size: 4
eval_every_n_steps: 4
progress: false
"""


def test_a_model_smaller_than_the_tokenizer_is_refused_before_training(corpus: Path):
    from pipekit_train.stage.preflight import check_without_jax

    loop = pipekit.loads(PIPELINE.replace("VOCAB", "399"))
    with pytest.raises(ConfigError, match=r"stage 'lm': the model's vocab_size 399 is smaller than the tokenizer's "):
        check_without_jax(loop, "lm")


def test_the_resume_fingerprint_hashes_the_validation_data_with_the_training_splits_tokenizer(corpus, monkeypatch):
    from pipekit_train.engine._fingerprint import fingerprint

    monkeypatch.chdir(corpus)
    loop = pipekit.loads(PIPELINE.replace("VOCAB", "400"))
    statistics = loop.dataset.source.fit().fitted_statistics()
    as_read = loop.val_dataset.with_source_statistics(statistics).content_hash()
    assert fingerprint(loop)["val_dataset_hash"] == as_read != loop.val_dataset.content_hash()  # not its own BPE


@pytest.mark.slow
def test_the_recorded_tokenizer_is_what_evaluate_and_generate_read(corpus: Path, tmp_path, monkeypatch, capsys):
    import shutil

    from pipekit_train import ArtifactStore
    from pipekit_train.cli import main
    from pipekit_train.inference import evaluate
    from pipekit_train.inference._generate import generate

    shutil.copytree(corpus / "corpus", tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lm.yaml").write_text(PIPELINE.replace("VOCAB", "400"))
    store = tmp_path / "store.sqlite"
    assert main(["run", "lm.yaml", "--run-dir", "run", "--store", str(store)]) == 0
    (artifact,) = ArtifactStore(store).query()
    recorded = artifact.source_statistics["tokenizer"]
    assert recorded["json"] == _source(corpus).fit().statistics["tokenizer"]["json"]
    capsys.readouterr()
    assert main(["artifacts", "show", artifact.artifact_id, "--store", str(store)]) == 0
    assert f"tokenizer  bpe vocab_size=400 min_frequency=2, sha256 {recorded['sha256'][:12]}" in capsys.readouterr().out
    # evaluate reads new data with the recorded tokenizer, not one trained on that data (in batches of the stage's
    # size: its validation's programs serve again, where evaluate's default 256 would compile them once more)
    val = TrainingDataset(source=_source(tmp_path, "val"), shuffle=False)
    pipekit.dump(val, tmp_path / "val.yaml")
    done = evaluate(artifact.artifact_id, tmp_path / "val.yaml", batch_size=4, store=store, record=False)
    assert done.dataset_hash == val.with_source_statistics(artifact.source_statistics).content_hash()
    assert done.dataset_hash != val.content_hash() and np.isfinite(done.metrics["perplexity"])
    shutil.rmtree(tmp_path / "corpus")  # generate cannot retrain: it reads the recorded tokenizer
    text = generate(artifact.artifact_id, " kappa", max_new_tokens=4, temperature=0, store=store)
    assert text == generate(artifact.artifact_id, " kappa", max_new_tokens=4, temperature=0, store=store)
    assert isinstance(text, str)
