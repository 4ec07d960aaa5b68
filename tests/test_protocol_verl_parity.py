"""verl parity for DataProto: cases ported from verl's tests/test_protocol_on_cpu.py and
tests/single_controller/test_auto_padding_on_cpu.py (the DataProto parts), with expected values by hand."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rlworkers.protocol import (
    DataProto,
    DataProtoConfig,
    ProtocolError,
    all_gather_data_proto,
    collate_fn,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    list_of_dict_to_dict_of_list,
    pad_dataproto_to_divisor,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)


@pytest.fixture(autouse=True)
def auto_padding_off(monkeypatch):
    """Every test starts and ends with the process-wide switch off."""
    monkeypatch.delenv("VERL_AUTO_PADDING", raising=False)
    DataProtoConfig.auto_padding = False
    yield
    DataProtoConfig.auto_padding = False


def abc(meta=None):
    return DataProto.from_dict(
        {"obs": torch.tensor([[1, 2], [3, 4], [5, 6]])},
        {"labels": ["a", "b", "c"]},
        meta_info=meta if meta is not None else {"info": "test_info"},
    )


def labels(data):
    return data.non_tensor_batch["labels"].tolist()


# ------------------------------------------------------------------------------------------------- imports/errors
def test_import_from_package_is_lazy():
    code = (
        "import sys, rlworkers; assert 'torch' not in sys.modules; "
        "from rlworkers import DataProto; from rlworkers.protocol import DataProto as P; assert DataProto is P"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_protocol_error_is_caught_as_value_error_and_assertion_error():
    with pytest.raises(ValueError, match="equal parts"):
        abc().chunk(2)
    with pytest.raises(AssertionError, match="equal parts"):
        abc().chunk(2)
    assert issubclass(ProtocolError, ValueError) and issubclass(ProtocolError, AssertionError)


# ------------------------------------------------------------------------------------------------------- union
def test_union_tensor_dict():
    obs = torch.randn(4, 2)
    data1 = TensorDict({"obs": obs, "act": torch.zeros(4)}, batch_size=[4])
    union_tensor_dict(data1, TensorDict({"obs": obs.clone(), "rew": torch.ones(4)}, batch_size=[4]))
    assert set(data1.keys()) == {"obs", "act", "rew"}
    with pytest.raises(AssertionError, match="'obs' differs"):
        union_tensor_dict(data1, TensorDict({"obs": obs + 1}, batch_size=[4]))
    with pytest.raises(AssertionError, match="batch size"):
        union_tensor_dict(data1, TensorDict({"x": torch.zeros(3)}, batch_size=[3]))


def test_union_numpy_dict_nan_dtype_shape_and_nesting():
    nan_and_string = np.array([float("nan")] * 3 + ["nan"], dtype=object)
    merged = union_numpy_dict({"b": nan_and_string}, {"b": nan_and_string.copy(), "c": np.arange(4)})
    assert list(merged) == ["b", "c"]
    union_numpy_dict({"a": np.array([1.0, np.nan, 3.0])}, {"a": np.array([1.0, np.nan, 3.0])})
    for different in (
        np.array([1.0, 2.0, 3.0]),
        np.array([np.nan, 1.0, 3.0]),
        np.array([1, 2, 3]),
        np.array([[1.0, np.nan, 3.0]]),
    ):
        with pytest.raises(AssertionError, match="'a' differs"):
            union_numpy_dict({"a": np.array([1.0, np.nan, 3.0])}, {"a": different})
    cube = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    union_numpy_dict({"nd": cube}, {"nd": cube.copy()})
    with pytest.raises(AssertionError):
        union_numpy_dict({"nd": cube}, {"nd": cube + 1})
    nested = np.array([[np.array([1, 2]), "text"], [np.array([3.0, 4.0]), None]], dtype=object)
    union_numpy_dict({"d": nested}, {"d": nested.copy()})
    changed = nested.copy()
    changed[1, 0] = np.array([3, 4])  # same values, int instead of float: a different array
    with pytest.raises(AssertionError):
        union_numpy_dict({"d": nested}, {"d": changed})


def test_union_numpy_dict_reference_cycles():
    cycle1, cycle2, plain = (np.array([None], dtype=object) for _ in range(3))
    cycle1[0], cycle2[0] = cycle1, cycle2
    union_numpy_dict({"c": cycle1}, {"c": cycle2})
    with pytest.raises(AssertionError):
        union_numpy_dict({"c": cycle1}, {"c": plain})


def test_dataproto_union_accepts_equal_nan_columns():
    data = DataProto.from_dict({"x": torch.zeros(2)}, {"score": np.array([np.nan, 1.0])})
    data.union(DataProto.from_dict(non_tensors={"score": np.array([np.nan, 1.0]), "uid": ["u0", "u1"]}))
    assert data.non_tensor_batch["uid"].tolist() == ["u0", "u1"]


# ------------------------------------------------------------------------------------------ construction/len
def test_only_one_batch_dimension():
    obs, act = torch.randn(4, 10), torch.randn(4, 10, 3)
    assert DataProto.from_dict({"obs": obs, "act": act}).batch.batch_size == torch.Size([4])
    for dims in (2, 3):
        with pytest.raises(AssertionError, match="num_batch_dims must be 1"):
            DataProto.from_dict({"obs": obs, "act": act}, num_batch_dims=dims)
    with pytest.raises(AssertionError, match="exactly one batch dimension"):
        DataProto(batch=TensorDict({"obs": obs}, batch_size=[4, 10]))


def test_len_including_empty_and_none_non_tensor_batch():
    column = np.array(["a", "b", "c"], dtype=object)
    assert len(DataProto(batch=None, non_tensor_batch={"labels": column})) == 3
    assert len(DataProto(batch=None, non_tensor_batch={}, meta_info={"info": 1})) == 0
    assert len(DataProto(batch=None, non_tensor_batch=None, meta_info={"info": 1})) == 0
    assert len(DataProto()) == 0


def test_lists_become_one_object_per_row_and_arrays_are_kept():
    data = DataProto.from_dict(
        non_tensors={"msgs": [[{"role": "user"}], [{"role": "user"}]], "grid": np.arange(6).reshape(2, 3)}
    )
    assert data.non_tensor_batch["msgs"].shape == (2,) and data.non_tensor_batch["msgs"][0] == [{"role": "user"}]
    assert data.non_tensor_batch["grid"].shape == (2, 3) and data.non_tensor_batch["grid"].dtype == np.int64


def test_indexing_keeps_an_int_batch_size():
    data = DataProto.from_dict({"obs": torch.randn(4, 4)}, {"labels": [f"l{i}" for i in range(4)]})
    for index in (
        np.array([True, False, True, False]),
        np.array([0, 2]),
        [True, False, True, False],
        [0, 2],
        torch.tensor([True, False, True, False]),
        torch.tensor([0, 2]),
    ):
        selected = data[index]
        assert selected.batch.batch_size == torch.Size([2]) and labels(selected) == ["l0", "l2"]


# ------------------------------------------------------------------------------------------ padding and chunk
def test_padding_is_in_place_and_repeats_the_last_or_first_row():
    data = abc()
    assert data.padding(2) is data
    assert labels(data) == ["a", "b", "c", "c", "c"]
    assert data.batch["obs"][3:].tolist() == [[5, 6], [5, 6]]
    data.padding(1, padding_candidate="first")
    assert labels(data) == ["a", "b", "c", "c", "c", "a"]
    assert data.padding(0) is data and len(data) == 6
    with pytest.raises(AssertionError, match="empty"):
        DataProto().padding(1)


@pytest.mark.parametrize("size", range(4, 20))
def test_padding_then_chunk_gives_equal_parts(size):
    # verl's test_auto_padding, local part: pad to a multiple of 4 in place, then chunk(4).
    DataProtoConfig.auto_padding = True
    data = DataProto.from_dict({"a": torch.zeros(size)}, {"na": np.zeros(size, dtype=object)})
    data.padding((-size) % 4)
    assert [len(part) for part in data.chunk(4)] == [math.ceil(size / 4)] * 4


@pytest.mark.parametrize("size,expected", [(10, [3, 3, 3, 1]), (7, [2, 2, 2, 1]), (5, [2, 2, 1, 0]), (0, [0] * 4)])
def test_uneven_chunk_sizes_when_padding_is_enabled(size, expected):
    data = DataProto.from_dict({"a": torch.arange(size)}, {"na": list(range(size))}, auto_padding=True)
    assert data.meta_info == {"_verl_auto_padding": True} and data.is_padding_enabled()
    parts = data.chunk(4)
    assert [len(part) for part in parts] == expected
    assert torch.cat([part.batch["a"] for part in parts]).tolist() == list(range(size))
    assert sum((part.non_tensor_batch["na"].tolist() for part in parts), []) == list(range(size))


def test_auto_padding_switch_env_and_per_dataproto_flag(monkeypatch):
    data = DataProto.from_dict({"a": torch.arange(5)})
    assert not data.is_padding_enabled()
    with pytest.raises(AssertionError, match="pad first"):
        data.chunk(2)
    DataProtoConfig.auto_padding = True
    assert data.is_padding_enabled() and [len(p) for p in data.chunk(2)] == [3, 2]
    DataProtoConfig.auto_padding = False
    monkeypatch.setenv("VERL_AUTO_PADDING", "true")
    assert DataProtoConfig.auto_padding and data.is_padding_enabled()
    monkeypatch.setenv("VERL_AUTO_PADDING", "0")
    assert not data.is_padding_enabled()
    assert DataProto.from_single_dict({"a": torch.zeros(1)}, auto_padding=True).is_padding_enabled()
    with pytest.raises(AssertionError, match="bool"):
        DataProtoConfig.auto_padding = "yes"


@pytest.mark.parametrize("divisor,pad,expected", [(2, 1, "abca"), (3, 0, "abc"), (7, 4, "abcabca")])
def test_pad_to_divisor_repeats_leading_rows(divisor, pad, expected):
    padded, pad_size = pad_dataproto_to_divisor(abc(), divisor)
    assert pad_size == pad and labels(padded) == list(expected) and padded.meta_info == {"info": "test_info"}
    assert padded.batch["obs"][:, 0].tolist() == [{"a": 1, "b": 3, "c": 5}[c] for c in expected]
    assert labels(unpad_dataproto(padded, pad_size)) == ["a", "b", "c"]


def test_chunk_concat_round_trip():
    data = DataProto.from_dict(
        {"obs": torch.tensor([1, 2, 3, 4, 5, 6])}, {"labels": list("abcdef")}, meta_info={"name": "abdce"}
    )
    with pytest.raises(AssertionError):
        data.chunk(5)
    first, second = data.chunk(2)
    assert first.batch["obs"].tolist() == [1, 2, 3] and labels(second) == ["d", "e", "f"]
    assert first.meta_info == second.meta_info == {"name": "abdce"}
    joined = DataProto.concat([first, second])
    assert joined.batch["obs"].tolist() == [1, 2, 3, 4, 5, 6] and labels(joined) == list("abcdef")
    assert joined.meta_info == {"name": "abdce"}


# ---------------------------------------------------------------------------------------------- concat meta
def two(meta1, meta2):
    return [
        DataProto.from_dict({"obs": torch.tensor([1, 2])}, meta_info=meta1),
        DataProto.from_dict({"obs": torch.tensor([3, 4])}, meta_info=meta2),
    ]


def test_concat_gathers_metrics_into_a_dict_of_lists():
    parts = two({"metrics": [{"loss": 0.5, "acc": 0.9}], "flag": True}, {"metrics": {"loss": 0.6, "acc": 0.85}})
    joined = DataProto.concat(parts)
    assert joined.batch["obs"].tolist() == [1, 2, 3, 4]
    assert joined.meta_info == {"metrics": {"loss": [0.5, 0.6], "acc": [0.9, 0.85]}, "flag": True}


def test_concat_metrics_edge_cases():
    # the first part has no metrics, None is skipped, a list value stays one element
    parts = two({"config_flag": True}, {"metrics": {"loss": [0.6, 0.7]}, "config_flag": True})
    parts.append(DataProto.from_dict({"obs": torch.tensor([5])}, meta_info={"metrics": None}))
    assert DataProto.concat(parts).meta_info == {"metrics": {"loss": [[0.6, 0.7]]}, "config_flag": True}
    assert "metrics" not in DataProto.concat(two({"metrics": None}, {})).meta_info


def test_concat_merges_other_meta_and_rejects_conflicts():
    joined = DataProto.concat(two({"config": "A", "shared": "X"}, {"extra": "B", "shared": "X"}))
    assert joined.meta_info == {"config": "A", "shared": "X", "extra": "B"}
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'config'"):
        DataProto.concat(two({"config": "A"}, {"config": "B"}))


def test_concat_rejects_parts_with_different_columns():
    first = DataProto.from_dict({"obs": torch.tensor([1])}, {"uid": ["u0"]})
    second = DataProto.from_dict({"obs": torch.tensor([2])}, {"uid": ["u1"], "extra": ["x"]})
    with pytest.raises(AssertionError, match="part 1 .*'extra'"):
        DataProto.concat([first, second])


def test_list_of_dict_to_dict_of_list():
    assert list_of_dict_to_dict_of_list([{"a": 1, "b": 2}, {"a": 3}]) == {"a": [1, 3], "b": [2]}
    assert list_of_dict_to_dict_of_list([]) == {}
    with pytest.raises(AssertionError, match="'c'"):
        list_of_dict_to_dict_of_list([{"a": 1}, {"c": 2}])


# ------------------------------------------------------------------------------------------------ row ops
def test_reorder_pop_repeat():
    data = DataProto.from_dict(
        {"obs": torch.tensor([1, 2, 3, 4, 5, 6])}, {"labels": list("abcdef")}, meta_info={"name": "abdce", "2": 2}
    )
    data.reorder(torch.tensor([3, 4, 2, 0, 1, 5]))
    assert data.batch["obs"].tolist() == [4, 5, 3, 1, 2, 6] and labels(data) == list("decabf")
    popped = data.pop(batch_keys=["obs"], meta_info_keys=["2"])
    assert popped.batch.keys() == {"obs"} and popped.meta_info == {"2": 2} and data.meta_info == {"name": "abdce"}
    assert labels(abc().repeat(2, interleave=True)) == list("aabbcc")
    assert abc().repeat(2, interleave=False).batch["obs"][:, 0].tolist() == [1, 3, 5, 1, 3, 5]


def test_sample_level_repeat():
    data = abc()
    for counts, expected in (
        ([3, 1, 2], "aaabcc"),
        ((1, 2, 3), "abbccc"),
        (torch.tensor([0, 2, 1]), "bbc"),
        (np.array([1, 0, 0]), "a"),
    ):
        repeated = data.sample_level_repeat(counts)
        assert labels(repeated) == list(expected) and repeated.meta_info == {"info": "test_info"}
        assert repeated.batch["obs"][:, 0].tolist() == [{"a": 1, "b": 3, "c": 5}[c] for c in expected]
    with pytest.raises(AssertionError, match="one count per row"):
        data.sample_level_repeat([1, 2])


def test_fold_unfold_batch_dim():
    folded = fold_batch_dim(abc().repeat(2, interleave=True), new_batch_size=3)
    assert folded.batch["obs"].tolist() == [[[1, 2], [1, 2]], [[3, 4], [3, 4]], [[5, 6], [5, 6]]]
    assert labels(folded) == [["a", "a"], ["b", "b"], ["c", "c"]]
    folded.reorder(torch.tensor([1, 2, 0]))
    unfolded = unfold_batch_dim(folded, batch_dims=2)
    assert unfolded.batch["obs"].tolist() == [[3, 4], [3, 4], [5, 6], [5, 6], [1, 2], [1, 2]]
    assert labels(unfolded) == list("bbccaa") and unfolded.meta_info == {"info": "test_info"}
    with pytest.raises(AssertionError, match="fold 3 rows into 2"):
        fold_batch_dim(abc(), 2)


def test_unfold_column_chunks():
    obs1 = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    obs2 = torch.tensor([[1, 2], [5, 6], [9, 10]])
    data = DataProto.from_dict({"obs1": obs1, "obs2": obs2}, {"labels": list("abc")}, meta_info={"name": "abc"})
    ret = data.unfold_column_chunks(2, split_keys=["obs1"])
    assert ret.batch["obs1"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    assert ret.batch["obs2"].tolist() == [[1, 2], [1, 2], [5, 6], [5, 6], [9, 10], [9, 10]]
    assert labels(ret) == list("aabbcc") and ret.meta_info == {"name": "abc"}

    # an N-D non-tensor column is split like a tensor (verl builds it from nested lists; here pass the array)
    grid = np.array([["a1", "a2"], ["b1", "b2"], ["c1", "c2"]], dtype=object)
    ret = DataProto.from_dict({"obs1": obs1}, {"labels": grid}).unfold_column_chunks(2, ["obs1", "labels"])
    assert labels(ret) == [["a1"], ["a2"], ["b1"], ["b2"], ["c1"], ["c2"]]

    pairs = torch.arange(1, 13).repeat_interleave(2).reshape(3, 4, 2)  # row r: [[4r+1]*2, ..., [4r+4]*2]
    ret = DataProto.from_dict({"obs1": pairs}).unfold_column_chunks(2, split_keys=["obs1"])
    assert ret.batch["obs1"].shape == (6, 2, 2) and ret.batch["obs1"][:, :, 0].tolist() == [
        [1, 2],
        [3, 4],
        [5, 6],
        [7, 8],
        [9, 10],
        [11, 12],
    ]
    assert labels(DataProto.from_dict(non_tensors={"labels": list("ab")}).unfold_column_chunks(3)) == list("aaabbb")


# ---------------------------------------------------------------------------------------------- iteration
def test_make_iterator_batches_epochs_and_seed():
    data = DataProto.from_dict({"obs": torch.arange(8)}, {"labels": [f"l{i}" for i in range(8)]}, meta_info={"m": 1})
    batches = list(data.make_iterator(mini_batch_size=4, epochs=2))
    assert [b.batch["obs"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert labels(batches[1]) == ["l4", "l5", "l6", "l7"] and all(b.meta_info == {"m": 1} for b in batches)

    def shuffled(seed):
        iterator = data.make_iterator(2, 2, seed=seed, dataloader_kwargs={"shuffle": True})
        return [b.batch["obs"].tolist() for b in iterator]

    order = shuffled(seed=1)
    assert order == shuffled(seed=1) and len(order) == 8
    assert sorted(sum(order[:4], [])) == list(range(8)) and order[:4] != order[4:]  # each epoch reshuffles
    with pytest.raises(AssertionError, match="multiple of mini_batch_size"):
        data.make_iterator(3, 1)


def test_collate_fn_stacks_rows():
    data = DataProto.from_dict({"obs": torch.tensor([[1, 2], [3, 4]])}, {"msgs": [["hi"], ["yo"]]})
    batch = collate_fn([data[1], data[0]])
    assert batch.batch["obs"].tolist() == [[3, 4], [1, 2]]
    assert batch.non_tensor_batch["msgs"].tolist() == [["yo"], ["hi"]] and batch.meta_info == {}


# ------------------------------------------------------------------------------------------------ tensordict
def test_to_tensordict_and_back_with_nested_data():
    turn_scores = [[], [0.5], [0.8, 0.9], [0.7]]
    extra = [{"acc": 1.0}, {"acc": 0.5}, {"acc": 1.0}, {"acc": 0.0}]
    prompts = [
        [{"content": "Q1", "role": "user"}],
        [{"content": "Q2", "role": "user"}],
        [{"content": "Q3", "role": "user"}, {"content": "A3", "role": "assistant"}],
        [{"content": "Q4"}],
    ]
    data = DataProto.from_dict(
        {"obs": torch.tensor([1, 2, 3, 4])},
        {"labels": list("abcd"), "turn_scores": turn_scores, "extra": extra, "raw": prompts},
        meta_info={"experiment": "nested", "steps": [1, 2]},
    )
    td = data.to_tensordict()
    assert td["obs"].tolist() == [1, 2, 3, 4] and td["labels"] == list("abcd") and td["experiment"] == "nested"
    assert list(td["turn_scores"][2]) == [0.8, 0.9] and dict(td["extra"][1]) == {"acc": 0.5}
    back = DataProto.from_tensordict(td)
    assert back.batch["obs"].tolist() == [1, 2, 3, 4] and labels(back) == list("abcd")
    assert back.non_tensor_batch["turn_scores"].tolist() == turn_scores
    assert back.non_tensor_batch["extra"].tolist() == extra and back.non_tensor_batch["raw"].tolist() == prompts
    assert back.meta_info == {"experiment": "nested", "steps": [1, 2]}


def test_to_tensordict_rejects_a_key_in_two_places():
    data = DataProto.from_dict({"x": torch.zeros(1)}, {"y": ["a"]}, meta_info={"x": 1})
    with pytest.raises(AssertionError, match=r"\['x'\]"):
        data.to_tensordict()


def test_serialize_single_tensor_round_trip():
    for tensor in (torch.randn(3, 4, 5), torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(0, 2)):
        dtype, shape, raw = serialize_single_tensor(tensor)
        assert dtype == str(tensor.dtype).removeprefix("torch.") and shape == tuple(tensor.shape)
        assert raw.nbytes == tensor.numel() * tensor.element_size()
        restored = deserialize_single_tensor((dtype, shape, bytes(raw)))
        assert restored.dtype == tensor.dtype and torch.equal(restored, tensor)


def jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def test_serialize_tensordict_keeps_jagged_tensors_and_dtypes():
    batch = TensorDict(
        {
            "ids": jagged([torch.tensor([1, 2, 3]), torch.tensor([4])]),
            "positions": jagged([torch.arange(6.0).reshape(3, 2), torch.arange(2.0).reshape(1, 2)]),  # 3-D
            "reward": torch.tensor([0.5, -1.0], dtype=torch.bfloat16),
        },
        batch_size=[2],
    )
    batch_size, device, items = serialize_tensordict(batch)
    assert batch_size == (2,) and device is None
    assert items["ids"][0] == "jagged" and len(items["ids"][1]) == 2  # (layout, one serialized tensor per row)
    assert items["reward"][:2] == ("bfloat16", (2,))
    restored = deserialize_tensordict((batch_size, device, items))
    assert restored["ids"].is_nested and [r.tolist() for r in restored["ids"].unbind()] == [[1, 2, 3], [4]]
    assert [r.shape for r in restored["positions"].unbind()] == [(3, 2), (1, 2)]
    assert torch.equal(restored["positions"].unbind()[0], torch.arange(6.0).reshape(3, 2))
    assert restored["reward"].dtype == torch.bfloat16 and restored["reward"].tolist() == [0.5, -1.0]


def test_a_jagged_tensor_keeps_its_ragged_dim_when_its_rows_share_one_length():
    # Qwen-VL's position_ids [B, 4, j], ragged along dim 2: guessing from two rows of length 3 would give [2, j, 3]
    rows = [torch.arange(12).reshape(4, 3), torch.arange(12, 24).reshape(4, 3)]
    positions = torch.nested.nested_tensor_from_jagged(
        torch.cat(rows, dim=1), offsets=torch.tensor([0, 3, 6]), jagged_dim=2
    )
    restored = deserialize_tensordict(serialize_tensordict(TensorDict({"p": positions}, batch_size=[2])))["p"]
    assert restored._ragged_idx == 2 and [r.shape for r in restored.unbind()] == [(4, 3), (4, 3)]
    assert all(torch.equal(a, b) for a, b in zip(restored.unbind(), rows))
    # verl's format (no ragged dim) is read as ragged along dim 1
    verl_items = {
        "ids": ("jagged", [serialize_single_tensor(torch.tensor([1, 2])), serialize_single_tensor(torch.tensor([3]))])
    }
    assert [r.tolist() for r in deserialize_tensordict(((2,), None, verl_items))["ids"].unbind()] == [[1, 2], [3]]


def test_a_dataproto_with_a_jagged_column_pickles_chunks_and_concatenates():
    import pickle

    data = DataProto.from_dict({"ids": jagged([torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([5, 6])])})
    data = DataProto.concat([data, data.slice(0, 1)])  # 4 rows: [1,2,3], [4], [5,6], [1,2,3]
    restored = pickle.loads(pickle.dumps(data, protocol=5))
    assert [r.tolist() for r in restored.batch["ids"].unbind()] == [[1, 2, 3], [4], [5, 6], [1, 2, 3]]
    assert [[r.tolist() for r in c.batch["ids"].unbind()] for c in restored.chunk(2)] == [
        [[1, 2, 3], [4]],
        [[5, 6], [1, 2, 3]],
    ]


# ------------------------------------------------------------------------------------------------- reporting
def test_get_data_info_and_print_size():
    data = DataProto.from_dict(
        {"obs": torch.zeros(2, 3)},
        {"uid": ["a", "b"]},
        meta_info={"steps": [1, 2], "cfg": {"lr": 0.1}, "pair": (1, "x")},
    )
    assert data.get_data_info() == "\n".join(
        [
            "batch",
            "  obs: (2, 3) (torch.float32) cpu",
            "non_tensor_batch",
            "  uid: ndarray(2,) (object)",
            "meta_info",
            "  steps: list[int]",
            "  cfg: dict[str: float]",
            "  pair: tuple(int, str)",
        ]
    )
    assert data.print_size("step 1") == (
        f"step 1, Size of tensordict: {24 / 1024**3} GB, size of non_tensor_batch: {16 / 1024**3} GB"
    )


# ------------------------------------------------------------------------------------------------ collectives
def _gather_on_rank(rank: int, world_size: int, init_file: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    data = DataProto.from_dict({"x": torch.full((2, 3), float(rank))}, {"who": [f"r{rank}a", f"r{rank}b"]})
    all_gather_data_proto(data)
    results[rank] = (data.batch["x"][:, 0].tolist(), data.non_tensor_batch["who"].tolist(), len(data))
    dist.destroy_process_group()


def test_all_gather_data_proto_gives_every_rank_all_rows_in_rank_order(tmp_path):
    context = torch.multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        procs = [
            context.Process(target=_gather_on_rank, args=(rank, 2, str(tmp_path / "init"), results))
            for rank in range(2)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=120)
        assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
        expected = ([0.0, 0.0, 1.0, 1.0], ["r0a", "r0b", "r1a", "r1b"], 4)
        assert dict(results) == {0: expected, 1: expected}
