"""`TextSource` and the byte tokenizer: packed records with their boundaries, labelled snippets, the split by
file, the data hash of the files, resuming through Grain, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train.data import TextSource, TrainingDataset
from pipekit_train.data._tokenizer import BOS, EOS, PAD, decode, encode


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for folder, names in {"cats": ["a", "b", "c", "d"], "dogs": ["e", "f", "g", "h"]}.items():
        (tmp_path / folder).mkdir()
        for i, name in enumerate(names):
            (tmp_path / folder / f"{name}.txt").write_text(f"{folder} {name} " * (i + 1))
    return tmp_path


def test_the_byte_tokenizer_round_trips_any_text():
    ids = encode("π=3")
    assert ids[0] == BOS and ids[-1] == EOS and ids.dtype == np.int32 and len(ids) == 2 + len("π=3".encode())
    assert decode(ids) == "π=3" and decode([PAD, 104, 105]) == "hi"


def test_documents_are_packed_with_their_boundaries_marked(tmp_path: Path):
    (tmp_path / "a.txt").write_bytes(b"abc")
    (tmp_path / "b.txt").write_bytes(b"de")
    arrays = TextSource(paths=(str(tmp_path / "*.txt"),), seq_len=4).load()
    assert sorted(arrays) == ["segments", "x"]
    tokens = [BOS, 97, 98, 99, EOS, BOS, 100, 101, EOS]
    np.testing.assert_array_equal(arrays["x"].ravel(), tokens + [PAD] * 3)
    np.testing.assert_array_equal(arrays["segments"], [[1, 1, 1, 1], [1, 2, 2, 2], [1, 0, 0, 0]])


def test_labels_from_the_parent_folder_are_fitted_and_recorded_like_csv_classes(tree: Path):
    pattern = (str(tree / "*" / "*.txt"),)
    train = TextSource(paths=pattern, seq_len=8, labels="folder", fractions={"train": 0.5, "val": 0.5}, split="train")
    fitted = train.fit()
    assert fitted.fitted_statistics() == {"classes": ["cats", "dogs"]}
    val = train.replace(split="val").with_fitted(fitted.fitted_statistics(), "val_dataset")
    a, b = fitted.load(), val.load()
    assert a["x"].shape[1] == 8 and a["y"].dtype == np.int32 and set(a["y"]) == set(b["y"]) == {0, 1}
    # the split is by file: each file's first record (it starts with BOS) is in exactly one split
    firsts = lambda arr: {decode(r) for r in arr["x"] if r[0] == BOS}
    assert len(firsts(a)) == len(firsts(b)) == 4 and not firsts(a) & firsts(b)
    assert pipekit.loads(pipekit.dumps(val)) == val
    with pytest.raises(ConfigError, match=r"class 'cats' was not in the training split"):
        val.replace(statistics={"classes": ["dogs"]}).load()


def test_labels_from_a_csv_column(tree: Path):
    table = tree / "labels.csv"
    rows = [f"cats/{n}.txt,{'early' if n < 'c' else 'late'}" for n in "abcd"]
    table.write_text("file,label\n" + "\n".join(rows) + "\n")
    src = TextSource(paths=(str(tree / "cats" / "*.txt"),), seq_len=64, labels="csv", label_file=str(table))
    assert src.fit().statistics == {"classes": ["early", "late"]} and src.load()["y"].tolist() == [0, 0, 1, 1]
    with pytest.raises(ConfigError, match=r"has no row for '.*dogs/e.txt'"):
        src.replace(paths=(str(tree / "*" / "*.txt"),)).load()


def test_the_data_hash_covers_file_names_and_contents(tree: Path):
    src = TextSource(paths=(str(tree / "cats" / "*.txt"),), seq_len=16)
    before = TrainingDataset(source=src).content_hash()
    assert TrainingDataset(source=src).content_hash() == before
    (tree / "cats" / "a.txt").write_text("changed")
    assert TrainingDataset(source=src).content_hash() != before
    assert src.content_digest() != src.replace(seq_len=8).content_digest()


def test_resume_through_grain_gives_the_same_batches(tree: Path):
    ds = TrainingDataset(source=TextSource(paths=(str(tree / "*" / "*.txt"),), seq_len=8))
    it = ds.iterator(batch_size=2, seed=3)
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it)["x"] for _ in range(4)]
    again = ds.iterator(batch_size=2, seed=3)
    again.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(again)["x"], want)


def test_max_records_keeps_a_seeded_subset_in_order(tree: Path):
    src = TextSource(paths=(str(tree / "*" / "*.txt"),), seq_len=8)
    full, few = src.load()["x"], src.replace(max_records=3).load()["x"]
    rows = [int(np.flatnonzero((full == r).all(axis=1))[0]) for r in few]
    assert len(few) == 3 and rows == sorted(rows)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"paths": ("nowhere/*.txt",)}, r"TextSource.paths: no file matches 'nowhere/\*.txt'"),
        ({"seq_len": 1}, r"TextSource.seq_len must be an int >= 2 .*got 1"),
        ({"tokenizer": "byte"}, r"TextSource.tokenizer must be bytes or a mapping .*got 'byte'.*did you mean 'bytes'"),
        ({"fractions": {"train": 0.5, "val": 0.4}, "split": "train"}, r"fractions must sum to 1, got 0.9"),
        ({"fractions": {"train": 0.5, "val": 0.5}, "split": "trian"}, r"split 'trian' is not one.*'train'"),
        ({"labels": "csv"}, r"TextSource.label_file must name a CSV file"),
    ],
)
def test_errors_name_the_field_the_rule_and_the_value(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TextSource(**{"paths": ("*.txt",), "seq_len": 8, **kwargs}).load()
