"""`RandomAccessSource`: a user's Grain random-access source (or a ``grain.MapDataset``, or ArrayRecord files) as a
dataset's records, read per batch, with the batches, data position and exact resume of every other source."""

from __future__ import annotations

import grain
import numpy as np
import pytest

from pipekit import ConfigError
from pipekit_train import MSE, EquinoxModel, TrainingLoop
from pipekit_train.checkpoint import Checkpoint
from pipekit_train.data import ArraySource, RandomAccessSource, Standardize, TrainingDataset

_X = np.random.default_rng(0).normal(size=(48, 3)).astype(np.float32)
_Y = (_X @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]


class Rows(grain.sources.RandomAccessDataSource):  # type: ignore[misc,name-defined]
    """What a user writes around their own storage: Grain's protocol, one record per index."""

    def __len__(self) -> int:
        return len(_X)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {"x": _X[index], "y": _Y[index]}


def _map_dataset() -> grain.MapDataset:
    return grain.MapDataset.source(Rows()).map(lambda r: {"x": r["x"] * 2, "y": r["y"]})


class Counted(Rows):
    """Counts the records read."""

    def __init__(self) -> None:
        self.read: list[int] = []

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        self.read.append(index)
        return super().__getitem__(index)


@pytest.mark.parametrize("in_memory", [False, True])
def test_a_grain_source_and_a_map_dataset_give_the_batches_of_the_same_arrays(in_memory):
    reference = TrainingDataset(source=ArraySource(arrays={"x": _X, "y": _Y}))
    for records, scale in ((Rows(), 1), (_map_dataset(), 2)):
        ds = TrainingDataset(source=RandomAccessSource(records=records, in_memory=in_memory))
        it, ref = ds.iterator(batch_size=16, seed=3), reference.iterator(batch_size=16, seed=3)
        for _ in range(5):  # across an epoch boundary (3 batches per epoch)
            got, want = next(it), next(ref)
            np.testing.assert_array_equal(got["x"], want["x"] * scale)
            np.testing.assert_array_equal(got["y"], want["y"])
        assert it.get_state() == ref.get_state() == {"epoch": 1, "batch": 2}


def test_batches_read_only_their_own_records_and_the_hash_is_the_in_memory_one():
    records = Counted()
    ds = TrainingDataset(source=RandomAccessSource(records=records))
    assert ds.lazy and ds.num_records() == 48 and ds.element_spec()["x"] == ((3,), np.dtype(np.float32))
    assert records.read == [0]  # the shapes and dtypes come from record 0 alone
    it = ds.iterator(batch_size=4, seed=1)
    first = next(it)
    # one block of batches is gathered at once (`_BLOCK`), each record once for both keys
    assert len(records.read) == 1 + 8 * 4 and len(set(records.read[1:])) == 32
    perm = np.random.default_rng([1, 0]).permutation(48)
    np.testing.assert_array_equal(first["x"], _X[perm[:4]])
    in_memory = TrainingDataset(source=RandomAccessSource(records=Rows(), in_memory=True))
    assert not in_memory.lazy
    assert ds.content_hash() == in_memory.content_hash()  # streamed, the same bytes as the stacked arrays
    standardize = (Standardize(keys=("x",)),)
    fitted = TrainingDataset(source=RandomAccessSource(records=Rows()), transforms=standardize).fitted()
    expected = TrainingDataset(source=ArraySource(arrays={"x": _X, "y": _Y}), transforms=standardize).fitted()
    assert fitted.transforms == expected.transforms


def test_arrayrecord_files_train_through_a_parsing_map(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "rows.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for x, y in zip(_X, _Y):
        writer.write(x.tobytes() + y.tobytes())
    writer.close()

    def parse(raw: bytes) -> dict[str, np.ndarray]:
        row = np.frombuffer(raw, np.float32)
        return {"x": row[:3], "y": row[3:]}

    records = grain.MapDataset.source(grain.sources.ArrayRecordDataSource([path])).map(parse)
    ds = TrainingDataset(source=RandomAccessSource(records=records), shuffle=False)
    batch = next(ds.epoch_batches(16))
    np.testing.assert_array_equal(batch["x"], _X[:16])
    np.testing.assert_array_equal(batch["y"], _Y[:16])


def test_something_without_the_protocol_is_one_line_naming_it():
    with pytest.raises(ConfigError, match=r"RandomAccessSource\.records must follow Grain's random-access protocol.*"
                       r"int has no __len__ and no __getitem__"):  # fmt: skip
        RandomAccessSource(records=3)
    with pytest.raises(ConfigError, match=r"records\[0\] must be a mapping \{key: array\}"):
        RandomAccessSource(records=[1, 2]).load()
    with pytest.raises(ConfigError, match=r"records\[1\] must have the keys \['x'\] of records\[0\], got \['z'\]"):
        RandomAccessSource(records=[{"x": 1.0}, {"z": 2.0}], in_memory=True).load()
    lazy = RandomAccessSource(records=[{"x": np.zeros(2)}, {"x": np.zeros(3)}]).load()["x"]
    with pytest.raises(ConfigError, match=r"'x' must have one shape in every record: records\[0\] has \(2,\), "
                       r"records\[1\] has \(3,\)"):  # fmt: skip
        lazy[np.array([0, 1])]


def test_a_stage_on_a_grain_map_dataset_resumes_bitwise(interrupted_and_resumed):
    loop = TrainingLoop(
        model_op=EquinoxModel(factory="mlp", kwargs={"in_size": 3, "out_size": 1, "width_size": 8, "depth": 1}),
        dataset=TrainingDataset(source=RandomAccessSource(records=_map_dataset())),
        loss=MSE(),
        optimizer_config={"name": "adam", "lr": 0.01},
        max_steps=10,
        batch_size=16,
        progress=False,
        callbacks=(Checkpoint(every_n_steps=4, async_save=False),),
    )
    reference, resumed = interrupted_and_resumed(loop, crash_at=7)  # 3 batches per epoch: crosses two epochs
    assert resumed.weights_hash() == reference.weights_hash()
