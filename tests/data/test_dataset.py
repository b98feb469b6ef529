"""Datasets: sources, transforms, the batch order, checkpointed iteration, content hashes and `digits`."""

from __future__ import annotations

import collections
import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

import pipekit
from pipekit import ConfigError
from pipekit_train.data import (
    ArraySource,
    BatchIterator,
    Cast,
    Flatten,
    Normalize,
    NpySource,
    NpzSource,
    OneHot,
    RegisteredSource,
    Rename,
    Reshape,
    Select,
    TrainingDataset,
    Transform,
    register_dataset,
)

OPERATORS = [
    ArraySource,
    NpzSource,
    NpySource,
    RegisteredSource,
    Normalize,
    Cast,
    OneHot,
    Select,
    Rename,
    Flatten,
    Reshape,
    TrainingDataset,
]


def _records(n: int = 10) -> dict[str, np.ndarray]:
    return {
        "x": np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3),
        "y": (np.arange(n) % 3).astype(np.int32),
        "id": np.arange(n, dtype=np.int64),
    }


def _dataset(n: int = 10, **kwargs) -> TrainingDataset:
    return TrainingDataset(source=ArraySource(arrays=_records(n)), **kwargs)


def _take(it: BatchIterator, k: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(k)]


def _assert_same_batches(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert list(x) == list(y)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


# Order --------------------------------------------------------------------------------------------------------
def test_order_is_the_documented_permutation_and_deterministic_given_seed():
    ds = _dataset(10)
    batches = _take(ds.iterator(batch_size=3, seed=7), 6)
    for step, batch in enumerate(batches):
        epoch, b = divmod(step, 3)
        perm = np.random.default_rng([7, epoch]).permutation(10)
        np.testing.assert_array_equal(batch["id"], perm[b * 3 : (b + 1) * 3])
        np.testing.assert_array_equal(batch["x"], _records()["x"][perm[b * 3 : (b + 1) * 3]])
    _assert_same_batches(batches, _take(ds.iterator(batch_size=3, seed=7), 6))
    other = _take(ds.iterator(batch_size=3, seed=8), 6)
    assert any(not np.array_equal(a["id"], b["id"]) for a, b in zip(batches, other))


def test_every_record_once_per_epoch_and_epochs_differ():
    ds = _dataset(12)
    it = ds.iterator(batch_size=4, seed=0)
    epochs = []
    for _ in range(4):
        assert it.epoch == len(epochs)
        ids = np.concatenate([next(it)["id"] for _ in range(3)])
        assert sorted(ids.tolist()) == list(range(12))
        epochs.append(ids.tolist())
    assert len({tuple(e) for e in epochs}) == 4


def test_drop_remainder_drops_the_short_batch_and_num_batches_agrees():
    ds = _dataset(10)
    assert ds.num_batches(3) == 3
    batches = _take(ds.iterator(batch_size=3, seed=0), 3)
    assert [len(b["id"]) for b in batches] == [3, 3, 3]
    kept = ds.replace(drop_remainder=False)
    assert kept.num_batches(3) == 4
    it = kept.iterator(batch_size=3, seed=0)
    assert [len(b["id"]) for b in _take(it, 5)] == [3, 3, 3, 1, 3]
    assert it.get_state() == {"epoch": 1, "batch": 1}


def test_no_shuffle_visits_records_in_order_every_epoch():
    ds = _dataset(6, shuffle=False)
    it = ds.iterator(batch_size=2, seed=3)
    ids = [next(it)["id"].tolist() for _ in range(6)]
    assert ids == [[0, 1], [2, 3], [4, 5]] * 2


def test_prefetch_gives_the_same_batches_and_closes():
    ds = _dataset(10, transforms=(OneHot(key="y", num_classes=3),))
    plain = _take(ds.iterator(batch_size=3, seed=5), 7)
    with ds.replace(prefetch=3).iterator(batch_size=3, seed=5) as it:
        _assert_same_batches(plain, _take(it, 7))
        assert it.get_state() == {"epoch": 2, "batch": 1}


def test_batches_are_copies_and_cached_arrays_read_only():
    ds = _dataset(4, shuffle=False)
    batch = next(ds.iterator(batch_size=2, seed=0))
    batch["id"][:] = -1
    assert ds.arrays()["id"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="read-only"):
        ds.arrays()["id"][0] = 5


def test_arrays_are_loaded_once_per_process_for_equal_datasets(tmp_path: Path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.ones((4, 2), np.float32))
    first = TrainingDataset(source=NpzSource(path=str(path))).arrays()["x"]
    second = TrainingDataset(source=NpzSource(path=str(path)), shuffle=False).arrays()["x"]
    assert first is second


def test_in_memory_arrays_are_not_kept_alive_by_the_caches():
    x = np.arange(8.0)
    ref = weakref.ref(x)
    ds = TrainingDataset(source=ArraySource(arrays={"x": x}))
    assert ds.arrays()["x"].base is x
    assert ds.content_hash() == ds.content_hash()
    del ds, x
    gc.collect()
    assert ref() is None


# Checkpointing ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_at_every_step_gives_the_same_remaining_batches(prefetch: int):
    """grain's assert_equal_output_after_checkpoint: save at every step, restore into a fresh iterator."""
    ds = _dataset(10, transforms=(Normalize(key="x", mean=1.0, std=2.0),), prefetch=prefetch)
    total = 8  # three batches per epoch, so this crosses two epoch boundaries
    reference = _take(ds.iterator(batch_size=3, seed=11), total)
    for step in range(total + 1):
        it = ds.iterator(batch_size=3, seed=11)
        _take(it, step)
        state = json.loads(json.dumps(it.get_state()))
        assert state == {"epoch": step // 3, "batch": step % 3}
        assert it.epoch == step // 3
        restored = ds.iterator(batch_size=3, seed=11)
        restored.set_state(state)
        _assert_same_batches(reference[step:], _take(restored, total - step))
        # Setting the state of a used iterator (backwards too) also resumes exactly.
        _take(it, 2)
        it.set_state(state)
        _assert_same_batches(reference[step:], _take(it, total - step))
        it.close()
        restored.close()


def test_set_state_errors_name_the_rule_and_value():
    it = _dataset(10).iterator(batch_size=3, seed=0)
    with pytest.raises(ConfigError, match=r"set_state expects \{'epoch': int, 'batch': int\}, got \{'next_index': 3\}"):
        it.set_state({"next_index": 3})
    with pytest.raises(ConfigError, match="batch must be a non-negative int, got -1"):
        it.set_state({"epoch": 0, "batch": -1})
    with pytest.raises(ConfigError, match="epoch must be a non-negative int, got '1'"):
        it.set_state({"epoch": "1", "batch": 0})
    with pytest.raises(ConfigError, match="batch must be below the 3 batches per epoch, got 3"):
        it.set_state({"epoch": 0, "batch": 3})


# Argument checks --------------------------------------------------------------------------------------------
def test_batch_size_and_seed_errors():
    ds = _dataset(10)
    with pytest.raises(ConfigError, match=r"TrainingDataset.iterator: batch_size must be a positive int, got 0"):
        ds.iterator(batch_size=0, seed=0)
    with pytest.raises(ConfigError, match=r"batch_size must be a positive int, got True"):
        ds.num_batches(True)
    with pytest.raises(ConfigError, match=r"epoch_batches: batch_size must be a positive int, got 2.0"):
        ds.epoch_batches(2.0)
    with pytest.raises(ConfigError, match=r"batch_size 11 is larger than the 10 records.*drop_remainder=False"):
        ds.iterator(batch_size=11, seed=0)
    assert ds.replace(drop_remainder=False).num_batches(11) == 1
    with pytest.raises(ConfigError, match=r"seed must be a non-negative int, got -1"):
        ds.iterator(batch_size=2, seed=-1)
    with pytest.raises(ConfigError, match=r"TrainingDataset.prefetch must be a non-negative int, got -1"):
        _dataset(prefetch=-1)
    with pytest.raises(ConfigError, match=r"TrainingDataset.source must be Source, got 'data.npz'"):
        TrainingDataset(source="data.npz")
    empty = TrainingDataset(source=ArraySource(arrays={"x": np.zeros((0, 2))}), drop_remainder=False)
    with pytest.raises(ConfigError, match="the source has no records"):
        empty.iterator(batch_size=2, seed=0)
    assert list(empty.epoch_batches(2)) == []


# Evaluation pass --------------------------------------------------------------------------------------------
def test_epoch_batches_is_one_ordered_pass_with_the_remainder():
    ds = _dataset(10, transforms=(Select(keys=("id", "y")),))
    batches = list(ds.epoch_batches(4))
    assert [b["id"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(list(b) == ["id", "y"] for b in batches)
    assert list(ds.epoch_batches(4))[2]["y"].tolist() == [2, 0]


# Content hash -----------------------------------------------------------------------------------------------
_HASH_SCRIPT = """
import sys
from pipekit_train.data import Normalize, NpzSource, OneHot, TrainingDataset
ds = TrainingDataset(
    source=NpzSource(path=sys.argv[1]),
    transforms=(Normalize(key="x", mean=0.5, std=2.0), OneHot(key="y", num_classes=3)),
)
print(ds.content_hash())
"""


def test_content_hash_is_stable_across_processes(tmp_path: Path):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.linspace(0, 1, 12, dtype=np.float32).reshape(6, 2), y=np.arange(6, dtype=np.int32) % 3)
    ds = TrainingDataset(
        source=NpzSource(path=str(path)),
        transforms=(Normalize(key="x", mean=0.5, std=2.0), OneHot(key="y", num_classes=3)),
    )
    here = ds.content_hash()
    assert here.startswith("sha256:") and len(here) == len("sha256:") + 64
    out = subprocess.run(
        [sys.executable, "-c", _HASH_SCRIPT, str(path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == here
    in_memory = TrainingDataset(source=ArraySource(arrays=dict(np.load(path))), transforms=ds.transforms)
    assert in_memory.content_hash() == here  # the data, not where it came from


def test_content_hash_changes_with_data_and_transforms_only():
    base = _dataset(10)
    h = base.content_hash()
    assert base.replace(shuffle=False, prefetch=2, drop_remainder=False).content_hash() == h
    changed = _records(10)
    changed["x"][3, 0, 0] += 1
    assert TrainingDataset(source=ArraySource(arrays=changed)).content_hash() != h
    assert _dataset(9).content_hash() != h
    retyped = _records(10)
    retyped["y"] = retyped["y"].astype(np.int64)
    assert TrainingDataset(source=ArraySource(arrays=retyped)).content_hash() != h
    renamed = _records(10)
    renamed["z"] = renamed.pop("y")
    assert TrainingDataset(source=ArraySource(arrays=renamed)).content_hash() != h
    with_t = base.replace(transforms=(Cast(key="y", dtype="float32"),))
    assert with_t.content_hash() != h
    assert base.replace(transforms=(Cast(key="y", dtype="float16"),)).content_hash() != with_t.content_hash()


# Sources ------------------------------------------------------------------------------------------------------
def test_npz_source_reads_all_or_chosen_keys_and_names_missing_ones(tmp_path: Path):
    path = tmp_path / "d.npz"
    np.savez(path, image=np.zeros((3, 4)), label=np.arange(3))
    assert list(NpzSource(path=str(path)).load()) == ["image", "label"]
    assert list(NpzSource(path=str(path), keys=("label",)).load()) == ["label"]
    with pytest.raises(ConfigError, match=r"NpzSource.keys: 'labels' is not in .*d.npz' \(did you mean 'label'\?\)"):
        NpzSource(path=str(path), keys=("labels",)).load()
    with pytest.raises(ConfigError, match=r"NpzSource.path: file not found: '.*missing.npz'"):
        NpzSource(path=str(tmp_path / "missing.npz")).load()
    with pytest.raises(ConfigError, match=r"NpzSource.path must be a non-empty path"):
        NpzSource(path="")
    np.savez(path, a=np.zeros(3), b=np.zeros(4))
    with pytest.raises(ConfigError, match=r"same number of records, got lengths \{'a': 3, 'b': 4\}"):
        NpzSource(path=str(path)).load()


def test_npy_source_memory_maps_refuses_pickles_and_names_missing_files(tmp_path: Path):
    np.save(tmp_path / "x.npy", np.arange(12, dtype=np.float32).reshape(4, 3))
    np.save(tmp_path / "y.npy", np.arange(4))
    paths = {"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")}
    mapped = NpySource(paths=paths).load()
    assert isinstance(mapped["x"], np.memmap)
    read = NpySource(paths=paths, mmap=False).load()
    assert not isinstance(read["x"], np.memmap)
    np.testing.assert_array_equal(mapped["x"], read["x"])
    batch = next(TrainingDataset(source=NpySource(paths=paths)).iterator(batch_size=2, seed=0))
    assert batch["x"].shape == (2, 3)
    with pytest.raises(ConfigError, match=r"NpySource.paths\['z'\]: file not found: '.*z.npy'"):
        NpySource(paths={**paths, "z": str(tmp_path / "z.npy")}).load()
    np.save(tmp_path / "o.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="holds object arrays \\(pickled Python objects\\), which are never loaded"):
        NpySource(paths={"o": str(tmp_path / "o.npy")}, mmap=False).load()
    with pytest.raises(ConfigError, match=r"NpySource.paths must map at least one key"):
        NpySource(paths={})


def test_array_source_checks_lengths_and_cannot_be_written_to_yaml():
    with pytest.raises(ConfigError, match=r"same number of records, got lengths \{'x': 3, 'y': 2\}"):
        ArraySource(arrays={"x": np.zeros(3), "y": np.zeros(2)})
    with pytest.raises(ConfigError, match=r"ArraySource.arrays\['x'\] must have a leading record axis"):
        ArraySource(arrays={"x": 1.0})
    with pytest.raises(ConfigError, match="ArraySource.arrays produced no arrays"):
        ArraySource(arrays={})
    source = ArraySource(arrays={"x": [[1, 2], [3, 4]]})
    assert isinstance(source.arrays["x"], np.ndarray)
    with pytest.raises(ConfigError, match="cannot be written to YAML"):
        pipekit.dumps(TrainingDataset(source=source))


def test_registered_source_names_unknown_datasets_and_arguments():
    with pytest.raises(ConfigError, match=r"'digit' is not a registered dataset \(did you mean 'digits'\?\).*digits"):
        RegisteredSource(name="digit")
    with pytest.raises(ConfigError, match=r"dataset 'digits' has no argument 'splt' \(did you mean 'split'\?\)"):
        RegisteredSource(name="digits", kwargs={"splt": "test"})
    loaded = pipekit.loads("type: RegisteredSource\nname: digits\nkwargs: {split: test}\n")
    assert loaded == RegisteredSource(name="digits", kwargs={"split": "test"})


def test_register_dataset_adds_a_source_and_refuses_a_second_function_under_its_name():
    @register_dataset("test_data_ramp")
    def ramp(n: int = 5) -> dict[str, np.ndarray]:
        return {"x": np.arange(n, dtype=np.float32)}

    ds = TrainingDataset(source=RegisteredSource(name="test_data_ramp", kwargs={"n": 7}))
    assert ds.num_records() == 7
    assert register_dataset("test_data_ramp")(ramp) is ramp  # the same function again is fine

    def other() -> dict[str, np.ndarray]:
        return {}

    with pytest.raises(ConfigError, match=r"'test_data_ramp' is already registered by .*ramp"):
        register_dataset("test_data_ramp")(other)


# Transforms ---------------------------------------------------------------------------------------------------
TRANSFORMS = [
    Normalize(key="x", mean=1.0, std=4.0),
    Normalize(key="x", mean=(0.0, 1.0, 2.0), std=(1.0, 2.0, 4.0)),
    Normalize(key="y", mean=1.0, std=2.0),
    Cast(key="y", dtype="float16"),
    OneHot(key="y", num_classes=3),
    OneHot(key="y", num_classes=4, dtype="int8"),
    Select(keys=("y", "x")),
    Rename(mapping={"x": "image", "y": "label"}),
    Rename(mapping={"x": "y", "y": "x"}),
    Flatten(key="x"),
    Flatten(key="y"),
    Reshape(key="x", shape=(3, 2)),
    Reshape(key="x", shape=(-1, 1)),
]


@pytest.mark.parametrize("transform", TRANSFORMS, ids=repr)
def test_transform_spec_agrees_with_apply_on_a_real_batch(transform: Transform):
    batch = {k: v[:4] for k, v in _records().items()}
    original = {k: v.copy() for k, v in batch.items()}
    out = transform.apply(batch)
    assert transform(batch).keys() == out.keys()
    spec = {k: (v.shape[1:], v.dtype) for k, v in batch.items()}
    assert transform.spec(spec) == {k: (v.shape[1:], v.dtype) for k, v in out.items()}
    assert all(len(v) == 4 for v in out.values())
    for key in original:  # the input batch is never written
        np.testing.assert_array_equal(batch[key], original[key])


def test_transform_values():
    batch = {"x": np.array([[0.0, 2.0], [4.0, 6.0]], np.float32), "y": np.array([2, 0], np.int32)}
    normalized = Normalize(key="x", mean=(0.0, 2.0), std=(2.0, 4.0)).apply(batch)["x"]
    np.testing.assert_allclose(normalized, [[0.0, 0.0], [2.0, 1.0]])
    assert normalized.dtype == np.float32
    np.testing.assert_array_equal(OneHot(key="y", num_classes=3).apply(batch)["y"], [[0, 0, 1], [1, 0, 0]])
    assert list(Select(keys=("y",)).apply(batch)) == ["y"]
    assert list(Rename(mapping={"y": "label"}).apply(batch)) == ["x", "label"]
    np.testing.assert_array_equal(Reshape(key="x", shape=(2, 1)).apply(batch)["x"][1], [[4.0], [6.0]])


def test_transforms_name_the_transform_the_missing_key_and_the_available_keys():
    batch = {"image": np.zeros((2, 3)), "label": np.zeros(2, np.int32)}
    message = r"Normalize\(key='imag', mean=0.0, std=1.0\): key 'imag' is not in the batch \(did you mean 'image'\?\)"
    with pytest.raises(ConfigError, match=message + "; available keys: image, label"):
        Normalize(key="imag", mean=0.0, std=1.0).apply(batch)
    for transform in [
        Cast(key="lable", dtype="int32"),
        OneHot(key="lable", num_classes=2),
        Select(keys=("image", "lable")),
        Rename(mapping={"lable": "y"}),
        Flatten(key="lable"),
        Reshape(key="lable", shape=(1,)),
    ]:
        pattern = rf"{type(transform).__name__}\(.*\): key 'lable' is not in the batch \(did you mean 'label'\?\)"
        with pytest.raises(ConfigError, match=pattern):
            transform.apply(batch)
        with pytest.raises(ConfigError, match=pattern):
            transform.spec({k: (v.shape[1:], v.dtype) for k, v in batch.items()})


def test_transform_field_and_data_errors():
    with pytest.raises(ConfigError, match=r"Normalize.std must be positive \(every channel\), got \(1.0, 0.0\)"):
        Normalize(key="x", mean=0.0, std=(1.0, 0.0))
    with pytest.raises(ConfigError, match="Normalize.mean and Normalize.std must have the same number of channels"):
        Normalize(key="x", mean=(0.0, 1.0), std=(1.0, 1.0, 1.0))
    with pytest.raises(ConfigError, match=r"per-channel mean/std has 2 channels but 'x' has per-example shape \(3,\)"):
        Normalize(key="x", mean=(0.0, 1.0), std=1.0).apply({"x": np.zeros((4, 3))})
    with pytest.raises(ConfigError, match="Cast.dtype must be a numpy dtype name such as 'float32'.*got 'floaty'"):
        Cast(key="x", dtype="floaty")
    with pytest.raises(ConfigError, match="OneHot.num_classes must be a positive int, got 0"):
        OneHot(key="y", num_classes=0)
    with pytest.raises(ConfigError, match=r"'y' must hold integer labels, got dtype float64"):
        OneHot(key="y", num_classes=3).apply({"y": np.zeros(2)})
    with pytest.raises(ConfigError, match=r"labels must be in \[0, 3\), got values from -1 to 3"):
        OneHot(key="y", num_classes=3).apply({"y": np.array([-1, 3])})
    with pytest.raises(ConfigError, match=r"Select.keys must not repeat a key, got \['x', 'x'\]"):
        Select(keys=("x", "x"))
    with pytest.raises(ConfigError, match="Select.keys must name at least one key"):
        Select(keys=())
    with pytest.raises(ConfigError, match=r"would overwrite existing key\(s\) \['y'\]"):
        Rename(mapping={"x": "y"}).apply({"x": np.zeros(1), "y": np.zeros(1)})
    with pytest.raises(ConfigError, match="Rename.mapping must not send two keys to the same name"):
        Rename(mapping={"a": "c", "b": "c"})
    with pytest.raises(ConfigError, match=r"Reshape.shape must hold positive sizes and at most one -1, got \[-1, -1\]"):
        Reshape(key="x", shape=(-1, -1))
    with pytest.raises(ConfigError, match=r"cannot reshape 'x' with per-example shape \(2, 3\) \(6 values\) to \[4\]"):
        Reshape(key="x", shape=(4,)).apply({"x": np.zeros((5, 2, 3))})


def test_element_spec_follows_the_transforms_and_reports_errors_before_any_batch():
    ds = _dataset(10, transforms=(Flatten(key="x"), OneHot(key="y", num_classes=3), Select(keys=("x", "y"))))
    assert ds.element_spec() == {"x": ((6,), np.dtype(np.float32)), "y": ((3,), np.dtype(np.float32))}
    batch = next(ds.iterator(batch_size=4, seed=0))
    assert {k: (v.shape[1:], v.dtype) for k, v in batch.items()} == ds.element_spec()
    bad = _dataset(10, transforms=(Reshape(key="x", shape=(4, 4)),))
    with pytest.raises(ConfigError, match=r"cannot reshape 'x' with per-example shape \(2, 3\)"):
        bad.element_spec()


# YAML ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", OPERATORS, ids=lambda c: c.__name__)
def test_examples_round_trip_through_yaml(cls):
    op = cls.example()
    assert pipekit.lookup(cls.__name__) is cls
    if not cls._yaml_serializable:
        with pytest.raises(ConfigError, match="cannot be written to YAML"):
            pipekit.dumps(op)
        return
    assert pipekit.loads(pipekit.dumps(op)) == op


def test_file_based_dataset_round_trips_and_iterates_after_loading(tmp_path: Path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.arange(8, dtype=np.float32).reshape(4, 2), y=np.arange(4, dtype=np.int32))
    ds = TrainingDataset(
        source=NpzSource(path=str(path), keys=("x", "y")),
        transforms=(Normalize(key="x", mean=(1.0, 2.0), std=2.0), OneHot(key="y", num_classes=4), Flatten(key="x")),
        shuffle=False,
        prefetch=1,
    )
    back = pipekit.loads(pipekit.dumps(ds))
    assert back == ds and hash(back) == hash(ds)
    assert back.content_hash() == ds.content_hash()
    _assert_same_batches(list(back.epoch_batches(3)), list(ds.epoch_batches(3)))


# digits -------------------------------------------------------------------------------------------------------
def _digits(**kwargs) -> dict[str, np.ndarray]:
    return TrainingDataset(source=RegisteredSource(name="digits", kwargs=kwargs)).arrays()


def _rows(arrays: dict[str, np.ndarray]) -> collections.Counter[bytes]:
    return collections.Counter(x.tobytes() + y.tobytes() for x, y in zip(arrays["x"], arrays["y"]))


def test_digits_shapes_and_a_disjoint_stratified_split():
    everything = _digits(split="all")
    assert everything["x"].shape == (1797, 64) and everything["x"].dtype == np.float32
    assert everything["y"].shape == (1797,) and everything["y"].dtype == np.int32
    assert everything["x"].min() == 0.0 and everything["x"].max() == 1.0
    train, test = _digits(), _digits(split="test")
    assert len(train["y"]) + len(test["y"]) == 1797
    assert abs(len(test["y"]) - 0.2 * 1797) <= 10
    assert _rows(train) + _rows(test) == _rows(everything)  # a partition: disjoint, nothing lost
    assert np.bincount(test["y"]).min() >= 30  # stratified: every class held out in proportion
    assert _rows(_digits(seed=1)) != _rows(train)


def test_digits_label_fraction_keeps_a_nested_stratified_subset():
    train = _digits()
    tenth = _digits(label_fraction=0.1)
    half = _digits(label_fraction=0.5)
    assert abs(len(tenth["y"]) - 0.1 * len(train["y"])) <= 10
    assert sorted(set(tenth["y"].tolist())) == list(range(10))
    assert not _rows(tenth) - _rows(half) and not _rows(half) - _rows(train)
    assert _rows(_digits(label_fraction=0.1)) == _rows(tenth)
    assert _rows(_digits(split="test", label_fraction=0.1)) - _rows(_digits(split="test")) == collections.Counter()


def test_digits_argument_errors_and_the_missing_extra(monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ConfigError, match=r"digits: split must be one of 'train', 'val', 'test', 'all', got 'valid'"):
        RegisteredSource(name="digits", kwargs={"split": "valid"}).load()
    with pytest.raises(ConfigError, match=r"digits: label_fraction must be a number in \(0, 1\], got 0"):
        RegisteredSource(name="digits", kwargs={"label_fraction": 0}).load()
    with pytest.raises(ConfigError, match=r"digits: test_fraction must be a number in \(0, 1\), got 1.0"):
        RegisteredSource(name="digits", kwargs={"test_fraction": 1.0}).load()
    with pytest.raises(ConfigError, match=r"digits: seed must be a non-negative int, got -3"):
        RegisteredSource(name="digits", kwargs={"seed": -3}).load()
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ImportError, match=r"needs scikit-learn: pip install 'pipekit-train\[examples\]'"):
        RegisteredSource(name="digits").load()


def test_digits_validation_split_is_disjoint_and_needs_a_fraction():
    def load(split):
        return RegisteredSource(name="digits", kwargs={"split": split, "val_fraction": 0.1}).load()

    train, val, test = load("train"), load("val"), load("test")
    assert len(train["x"]) + len(val["x"]) + len(test["x"]) == 1797
    rows = {split: {r.tobytes() for r in d["x"]} for split, d in (("train", train), ("val", val), ("test", test))}
    assert not rows["train"] & rows["val"] and not rows["val"] & rows["test"]
    assert sorted(np.unique(val["y"]).tolist()) == list(range(10))  # stratified: every class is there
    with pytest.raises(ConfigError, match=r"split 'val' needs val_fraction > 0"):
        RegisteredSource(name="digits", kwargs={"split": "val"}).load()
    with pytest.raises(ConfigError, match=r"test_fraction \+ val_fraction must be below 1"):
        RegisteredSource(name="digits", kwargs={"test_fraction": 0.5, "val_fraction": 0.5}).load()
