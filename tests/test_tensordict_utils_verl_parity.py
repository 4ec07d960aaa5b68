"""verl parity for ``rlworkers.tensordict_utils``: the ``tu`` cases of verl's tests/test_protocol_v2_on_cpu.py with
expected values by hand, then chunk/concat round trips of jagged batches and the errors.

Two of verl's cases assert tensordict <= 0.10 behaviour that tensordict 0.15 changed, and are adapted where marked:
``torch.cat`` now stacks NonTensorData that differ (``tu.concat_tensordict`` keeps the first, as verl expects), and
``consolidate`` now accepts non-contiguous tensors."""

import copy
import pickle

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from rlworkers import tensordict_utils as tu
from rlworkers.protocol import ProtocolError


def jagged(*rows) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.as_tensor(row) for row in rows], layout=torch.jagged)


def rows_of(tensor: torch.Tensor) -> list:
    return [row.tolist() for row in tensor.unbind()]


# ------------------------------------------------------------------------------------------ verl's cases, ported
def test_union_tensor_dict():
    obs = torch.arange(12.0).reshape(4, 3)
    data1 = tu.get_tensordict({"obs": obs, "act": torch.zeros(4, 2), "data_sources": ["gsm8k"] * 4})
    data2 = tu.get_tensordict({"obs": obs, "rew": torch.ones(4), "data_sources": ["gsm8k"] * 4})
    changed_obs = tu.get_tensordict({"obs": obs + 1, "rew": torch.ones(4)})

    tu.union_tensor_dict(data1, data2)
    assert set(data1.keys()) == {"obs", "act", "rew", "data_sources"}
    assert data1["rew"].tolist() == [1.0, 1.0, 1.0, 1.0]
    with pytest.raises(AssertionError, match="'obs'"):  # conflict in tensor values
        tu.union_tensor_dict(data1, changed_obs)

    data1 = tu.assign_non_tensor(data1, top_p=0.8)
    tu.union_tensor_dict(data1, data2)  # a key only in data1 is fine
    data2 = tu.assign_non_tensor(data2, top_p=0.9)
    with pytest.raises(AssertionError, match="'top_p'.*0.8 vs 0.9"):  # conflict in NonTensorData
        tu.union_tensor_dict(data1, data2)

    data1.pop("top_p")
    data2.pop("top_p")
    data2["data_sources"][0] = "math"
    with pytest.raises(AssertionError, match="'data_sources'"):  # conflict in a NonTensorStack
        tu.union_tensor_dict(data1, data2)


def test_union_tensor_dict_adds_entries_with_their_wrapping_and_checks_batch_sizes():
    data1 = tu.get_tensordict({"obs": torch.zeros(2)})
    data2 = tu.get_tensordict({"ids": jagged([1, 2], [3]), "labels": ["a", "b"]}, non_tensor_dict={"temp": 0.5})
    out = tu.union_tensor_dict(data1, data2)
    assert out is data1
    assert isinstance(out.get("labels"), NonTensorStack) and isinstance(out.get("temp"), NonTensorData)
    assert rows_of(out["ids"]) == [[1, 2], [3]]
    tu.union_tensor_dict(data1, data2)  # equal jagged tensors, stacks and metadata: no conflict
    with pytest.raises(ProtocolError, match=r"\[2\] and \[3\]"):
        tu.union_tensor_dict(data1, tu.get_tensordict({"obs": torch.zeros(3)}))


def test_tensor_dict_constructor():
    data = tu.get_tensordict(
        tensor_dict={"obs": torch.ones(100, 10), "act": torch.zeros(100, 10, 3), "data_source": ["gsm8k"] * 100},
        non_tensor_dict={"name": "abdce"},
    )
    assert data.batch_size == torch.Size([100])
    assert torch.equal(data[0]["obs"], torch.ones(10))
    assert torch.equal(data[0]["act"], torch.zeros(10, 3))
    assert data[0]["data_source"] == "gsm8k"
    assert torch.equal(data[0:2]["obs"], torch.ones(2, 10))
    assert torch.equal(data[0:2]["act"], torch.zeros(2, 10, 3))
    assert data[0:2]["data_source"] == ["gsm8k"] * 2
    assert data["name"] == "abdce"


def test_index_select_tensor_dict():
    input_ids = jagged(torch.arange(11), torch.arange(13), torch.arange(12), torch.arange(15))
    padded = torch.arange(40.0).reshape(4, 10)
    data = tu.get_tensordict({"input_ids": input_ids, "padded_tensor": padded}, {"global_batch_size": "4"})
    assert data.batch_size == torch.Size([4])

    selected = tu.index_select_tensor_dict(data, torch.tensor([1, 3]))
    assert selected.batch_size == torch.Size([2])
    expected = tu.get_tensordict(
        {"input_ids": jagged(torch.arange(13), torch.arange(15)), "padded_tensor": padded[[1, 3]]},
        {"global_batch_size": "4"},
    )
    tu.assert_tensordict_eq(selected, expected)
    assert tu.index_select_tensor_dict(None, [0]) is None


def test_tensordict_with_images():
    a, b = torch.arange(11), torch.arange(13)
    a_images = [np.full((3, 4, 4), 1, dtype=np.uint8), np.full((3, 2, 2), 2, dtype=np.uint8)]
    b_images = [np.full((3, 4, 4), 3, dtype=np.uint8), np.full((3, 2, 2), 4, dtype=np.uint8)]
    data = tu.get_tensordict({"input_ids": jagged(a, b), "images": [a_images, b_images]})
    assert np.array_equal(data[0]["images"][0], a_images[0])
    assert torch.equal(data[0]["input_ids"], a)


def test_tensordict_with_packing():
    a, b = torch.arange(11), torch.arange(100, 113)
    data = tu.get_tensordict({"input_ids": jagged(a, b)})
    assert data["input_ids"].offsets().tolist() == [0, 11, 24]  # cu_seqlens
    assert torch.equal(data["input_ids"][0], a) and torch.equal(data["input_ids"][1], b)
    assert torch.equal(data[0]["input_ids"], a) and torch.equal(data[1]["input_ids"], b)
    first, second = data.chunk(2)
    assert torch.equal(first["input_ids"][0], a) and torch.equal(second["input_ids"][0], b)


def test_tensordict_eq():
    def make(obs, sources=("abc", "def", "abc", "def", "pol", "klj")):
        meta = {"train_sample_kwargs": {"top_p": 1.0}, "val_sample_kwargs": {"top_p": 0.7}}
        return tu.get_tensordict({"obs": obs, "data_sources": list(sources)}, non_tensor_dict=meta)

    data = make(torch.tensor([1, 2, 3, 4, 5, 6]))
    tu.assert_tensordict_eq(data, make(torch.tensor([1, 2, 3, 4, 5, 6])))

    changed = copy.deepcopy(data)
    changed["obs"][0] += 1
    with pytest.raises(AssertionError, match="'obs'"):
        tu.assert_tensordict_eq(data, changed)
    changed = copy.deepcopy(data)
    changed["data_sources"][0] = "math"
    with pytest.raises(AssertionError, match="'data_sources'"):
        tu.assert_tensordict_eq(data, changed)
    changed = copy.deepcopy(data)
    changed["train_sample_kwargs"]["top_p"] = 0.9
    with pytest.raises(AssertionError, match="'train_sample_kwargs'"):
        tu.assert_tensordict_eq(data, changed)

    rows = [[1, 2, 3, 3, 2], [4, 5], [7, 8, 10, 14], [10, 11, 12], [13, 14, 15, 18], [16, 17]]
    nested = make(jagged(*rows))
    tu.assert_tensordict_eq(nested, make(jagged(*rows)))
    with pytest.raises(AssertionError, match="row 0"):
        tu.assert_tensordict_eq(nested, make(jagged([1, 2, 4], *rows[1:])))
    with pytest.raises(AssertionError, match="row 0"):  # the same rows, two of them swapped
        tu.assert_tensordict_eq(nested, make(jagged(rows[1], rows[0], *rows[2:])))
    with pytest.raises(AssertionError, match=r"only in the second \['extra'\]"):
        tu.assert_tensordict_eq(data, tu.assign_non_tensor(copy.deepcopy(data), extra=1))


def test_tensor_dict_make_iterator():
    meta = {"train_sample_kwargs": {"top_p": 1.0}, "val_sample_kwargs": {"top_p": 0.7}}
    dataset = tu.get_tensordict(
        {
            "obs": torch.tensor([1, 2, 3, 4, 5, 6]),
            "data_sources": ["abc", "def", "abc", "def", "pol", "klj"],
            "input_ids": jagged([0, 1], [2], [3, 4], [5], [6, 7, 8], [9]),
        },
        non_tensor_dict=meta,
    )
    batches = list(tu.make_iterator(dataset, 2, epochs=2, seed=0, dataloader_kwargs={"shuffle": False}))
    assert [b["obs"].tolist() for b in batches] == [[1, 2], [3, 4], [5, 6]] * 2
    assert [b["data_sources"] for b in batches] == [["abc", "def"], ["abc", "def"], ["pol", "klj"]] * 2
    assert [rows_of(b["input_ids"]) for b in batches] == [[[0, 1], [2]], [[3, 4], [5]], [[6, 7, 8], [9]]] * 2
    assert all(b["train_sample_kwargs"] == {"top_p": 1.0} for b in batches)

    def shuffled():
        return list(tu.make_iterator(dataset, 3, epochs=1, seed=1, dataloader_kwargs={"shuffle": True}))

    first, second = shuffled(), shuffled()
    for a, b in zip(first, second, strict=True):
        tu.assert_tensordict_eq(a, b)
    assert sorted(torch.cat([b["obs"] for b in first]).tolist()) == [1, 2, 3, 4, 5, 6]  # each row once

    with pytest.raises(AssertionError, match="6 % 4 != 0"):
        tu.make_iterator(dataset, 4, epochs=1)


def test_reorder():
    data = tu.get_tensordict({"obs": torch.tensor([1, 2, 3, 4, 5, 6]), "labels": list("abcdef")}, {"name": "abdce"})
    data = data[torch.tensor([3, 4, 2, 0, 1, 5])]
    assert data["obs"].tolist() == [4, 5, 3, 1, 2, 6]
    assert data["labels"] == ["d", "e", "c", "a", "b", "f"]
    assert data["name"] == "abdce"


def test_chunk_concat():
    obs, labels = torch.tensor([1, 2, 3, 4, 5, 6]), list("abcdef")
    data = tu.get_tensordict({"obs": obs, "labels": labels}, non_tensor_dict={"name": "abcde"})
    for part, idx in zip(data.tensor_split(5, dim=0), [[0, 1], [2], [3], [4], [5]], strict=True):
        tu.assert_tensordict_eq(part, data[idx])

    first, second = data.chunk(2)
    assert first["obs"].tolist() == [1, 2, 3] and first["labels"] == ["a", "b", "c"] and first["name"] == "abcde"
    assert second["obs"].tolist() == [4, 5, 6] and second["labels"] == ["d", "e", "f"] and second["name"] == "abcde"
    joined = torch.cat([first, second], dim=0)
    assert joined["obs"].tolist() == [1, 2, 3, 4, 5, 6] and joined["labels"] == labels and joined["name"] == "abcde"

    # Adapted: verl calls torch.cat here, which on tensordict <= 0.10 kept the first NonTensorData; 0.15 stacks
    # values that differ. tu.concat_tensordict keeps the first.
    parts = [tu.get_tensordict({"obs": obs, "labels": labels}, {"name": name}) for name in ("abcde", "def", "cfg")]
    output = tu.concat_tensordict(parts)
    assert output["name"] == "abcde"
    assert output["obs"].tolist() == [1, 2, 3, 4, 5, 6] * 3


def test_pop():
    obs, act = torch.arange(30.0).reshape(3, 10), torch.arange(9.0).reshape(3, 3)
    dataset = tu.get_tensordict({"obs": obs, "act": act, "labels": ["a", ["b"], []]}, {"2": 2, "1": 1})
    dataset1 = copy.deepcopy(dataset)

    popped = tu.pop_keys(dataset, keys=["obs", "2"])
    assert popped.batch_size[0] == 3
    assert set(popped.keys()) == {"obs", "2"}
    assert torch.equal(popped["obs"], obs) and popped["2"] == 2
    assert set(dataset.keys()) == {"act", "1", "labels"}
    with pytest.raises(KeyError):
        tu.pop_keys(dataset, keys=["obs", "2"])

    assert tu.pop(dataset1, key="2") == 2  # NonTensorData
    assert tu.pop(dataset1, key="labels") == ["a", ["b"], []]  # NonTensorStack
    assert torch.equal(tu.pop(dataset1, key="obs"), obs)  # tensor
    assert tu.pop(dataset1, key="obs", default="gone") == "gone"
    assert set(dataset1.keys()) == {"act", "1"}


def test_pop_keys_removes_nothing_when_a_key_is_missing():
    dataset = tu.get_tensordict({"obs": torch.zeros(2)}, {"1": 1})
    with pytest.raises(KeyError, match="'3'"):
        tu.pop_keys(dataset, keys=["obs", "3"])
    assert set(dataset.keys()) == {"obs", "1"}


def test_get():
    obs, act = torch.arange(30.0).reshape(3, 10), torch.arange(9.0).reshape(3, 3)
    dataset = tu.get_tensordict({"obs": obs, "act": act, "labels": ["a", ["b"], []]}, {"2": 2, "1": 1})

    subset = tu.get_keys(dataset, keys=["obs", "2"])
    assert subset.batch_size[0] == 3
    assert torch.equal(subset["obs"], obs) and subset["2"] == 2
    assert set(dataset.keys()) == {"obs", "act", "labels", "2", "1"}  # get_keys removes nothing
    with pytest.raises(KeyError):
        tu.get_keys(dataset, keys=["obs", "3"])

    assert tu.get(dataset, key="2") == 2
    assert tu.get(dataset, key="labels") == ["a", ["b"], []]
    assert torch.equal(tu.get(dataset, key="obs"), obs)
    assert tu.get(dataset, key="3", default=3) == 3


def test_non_tensor_data_helpers_unwrap():
    data = tu.get_tensordict({"obs": torch.zeros(2)})
    tu.assign_non_tensor_data(data, "config", {"lr": 0.01})
    assert isinstance(data.get("config"), NonTensorData)
    assert tu.get_non_tensor_data(data, "config", None) == {"lr": 0.01}
    assert tu.get_non_tensor_data(data, "missing", "default_value") == "default_value"
    assert tu.unwrap_non_tensor_data(NonTensorData("hello")) == "hello"
    assert tu.unwrap_non_tensor_data(42) == 42
    with pytest.raises(AssertionError, match="takes a TensorDict, got dict"):
        tu.assign_non_tensor_data({}, "config", 1)


def test_repeat():
    data = tu.get_tensordict({"obs": torch.tensor([[1, 2], [3, 4], [5, 6]]), "labels": ["a", "b", "c"]}, {"info": "i"})
    interleaved = data.repeat_interleave(repeats=2)
    assert interleaved["obs"].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]]
    assert interleaved["labels"] == ["a", "a", "b", "b", "c", "c"] and interleaved["info"] == "i"
    tiled = data.repeat(2)
    assert tiled["obs"].tolist() == [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6]]
    assert tiled["labels"] == ["a", "b", "c", "a", "b", "c"] and tiled["info"] == "i"


def test_pad_unpad():
    obs, labels = torch.tensor([[1, 2], [3, 4], [5, 6]]), ["a", "b", "c"]
    data = tu.get_tensordict({"obs": obs, "labels": labels}, non_tensor_dict={"info": "test_info"})
    cases = [
        (2, 1, [[1, 2], [3, 4], [5, 6], [1, 2]], ["a", "b", "c", "a"]),
        (3, 0, [[1, 2], [3, 4], [5, 6]], ["a", "b", "c"]),
        (7, 4, [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6], [1, 2]], ["a", "b", "c", "a", "b", "c", "a"]),
    ]
    for divisor, expected_pad, expected_obs, expected_labels in cases:
        padded, pad_size = tu.pad_to_divisor(data, size_divisor=divisor)
        assert pad_size == expected_pad
        assert padded["obs"].tolist() == expected_obs and padded["labels"] == expected_labels
        assert padded["info"] == "test_info"
        unpadded = tu.unpad(padded, pad_size=pad_size)
        assert unpadded["obs"].tolist() == obs.tolist() and unpadded["labels"] == labels
        assert unpadded["info"] == "test_info"
    assert tu.pad_to_divisor(data, 3)[0] is data and tu.unpad(data, 0) is data


def test_pad_to_divisor_repeats_rows_of_jagged_tensors():
    data = tu.get_tensordict(
        {"ids": jagged([1, 2], [3], [4, 5, 6]), "pos": jagged(torch.ones(2, 2), torch.zeros(2, 1), torch.ones(2, 3))}
    )
    padded, pad_size = tu.pad_to_divisor(data, 4)
    assert pad_size == 1
    assert rows_of(padded["ids"]) == [[1, 2], [3], [4, 5, 6], [1, 2]]
    assert [list(row.shape) for row in padded["pos"].unbind()] == [[2, 2], [2, 1], [2, 3], [2, 2]]
    assert rows_of(tu.unpad(padded, pad_size)["ids"]) == [[1, 2], [3], [4, 5, 6]]
    with pytest.raises(AssertionError, match="between 0 and the 4 rows, got 5"):
        tu.unpad(padded, 5)
    with pytest.raises(AssertionError, match="positive int, got 0"):
        tu.pad_to_divisor(data, 0)


def test_torch_save(tmp_path):
    data = tu.get_tensordict({"obs": torch.tensor([[1, 2], [3, 4], [5, 6]]), "labels": ["a", "b", "c"]}, {"info": "i"})
    torch.save(data, tmp_path / "data.pt")
    loaded = torch.load(tmp_path / "data.pt", weights_only=False)
    assert loaded["obs"].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert loaded["labels"] == ["a", "b", "c"] and loaded["info"] == "i"


def test_len():
    labels = ["a", "b", "c"]
    assert len(tu.get_tensordict({"obs": torch.zeros(3, 2), "labels": labels}, {"info": "i"})) == 3
    data = tu.get_tensordict({"labels": labels}, non_tensor_dict={"info": "i"})
    assert len(data) == 3
    assert len(data[0]) == 0
    assert len(tu.get_tensordict({}, non_tensor_dict={"info": "i"})) == 0


def test_index():
    obs = torch.arange(20.0).reshape(10, 2)
    labels = ["abc", "cde"] * 5
    data = tu.get_tensordict({"obs": obs, "labels": labels})
    for idx in (np.array([9, 0, 3, 3]), torch.tensor([9, 0, 3, 3]), [9, 0, 3, 3]):
        selected = data[idx]
        assert set(selected.keys()) == {"obs", "labels"}
        assert selected["obs"].tolist() == [[18.0, 19.0], [0.0, 1.0], [6.0, 7.0], [6.0, 7.0]]
        assert selected["labels"] == ["cde", "abc", "cde", "cde"]
    mask = torch.tensor([True, False] * 5)
    assert data[mask]["obs"][:, 0].tolist() == [0.0, 4.0, 8.0, 12.0, 16.0]
    assert data[mask]["labels"] == ["abc"] * 5


def test_select():
    dataset = tu.get_tensordict({"obs": torch.zeros(4, 2), "act": torch.ones(4, 3)}, non_tensor_dict={"2": 2, "1": 1})
    subset = dataset.select("obs", "2")
    assert torch.equal(subset["obs"], dataset["obs"]) and subset["2"] == 2
    assert "act" not in subset.keys() and "1" not in subset.keys()


def test_no_batch_tensor():
    labels = ["a", "b", "c"]
    data = tu.get_tensordict(tensor_dict={"labels": labels}, non_tensor_dict={"info": "test_info"})
    assert data.select("labels")["labels"] == labels
    assert tu.pop_keys(data, keys=["labels"])["labels"] == labels
    assert "labels" not in data


def test_sample_level_repeat():
    data = tu.get_tensordict({"obs": torch.tensor([[1, 2], [3, 4], [5, 6]]), "labels": ["a", "b", "c"]}, {"info": "i"})
    repeated = data.repeat_interleave(repeats=torch.tensor([3, 1, 2]))
    assert repeated["obs"].tolist() == [[1, 2], [1, 2], [1, 2], [3, 4], [5, 6], [5, 6]]
    assert repeated["labels"] == ["a", "a", "a", "b", "c", "c"] and repeated["info"] == "i"
    repeated = data.repeat_interleave(repeats=torch.tensor([1, 2, 3]))
    assert repeated["obs"].tolist() == [[1, 2], [3, 4], [3, 4], [5, 6], [5, 6], [5, 6]]
    assert repeated["labels"] == ["a", "b", "b", "c", "c", "c"]


def test_chunk_after_index():
    data = tu.get_tensordict({"obs": torch.zeros(4, 4), "labels": [f"label_{i}" for i in range(4)]}, {"name": "abc"})
    for index in (torch.tensor([True, False, True, False]), torch.tensor([0, 2]), [True, False, True, False], [0, 2]):
        selected = data[index]
        assert isinstance(selected.batch_size, torch.Size) and selected.batch_size == torch.Size([2])
        assert selected["labels"] == ["label_0", "label_2"]


def test_concat_nested_tensor():
    output = tu.concat_nested_tensors([jagged([1, 2, 3], [4]), jagged([5, 6], [7, 8, 9])])
    assert output.values().tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert output.offsets().tolist() == [0, 3, 4, 6, 9]

    a, b, c, d = (torch.arange(4 * n).reshape(4, n) for n in (4, 5, 6, 7))  # 3-D: [4, j]
    output_3d = tu.concat_nested_tensors([jagged(a, b), jagged(c, d)])
    assert output_3d.shape[0] == 4
    assert [torch.equal(x, y) for x, y in zip(output_3d.unbind(0), (a, b, c, d))] == [True] * 4

    a, b, c, d = (torch.arange(6 * n).reshape(2, 3, n) for n in (4, 5, 3, 6))  # 4-D: [2, 3, j]
    output_4d = tu.concat_nested_tensors([jagged(a, b), jagged(c, d)])
    assert output_4d.shape[0] == 4
    assert [torch.equal(x, y) for x, y in zip(output_4d.unbind(0), (a, b, c, d))] == [True] * 4

    with pytest.raises(AssertionError, match="tensor 1 is not a contiguous nested tensor"):
        tu.concat_nested_tensors([jagged([1]), torch.tensor([[1]])])


def test_concat_tensordict():
    td1 = tu.get_tensordict({"input_ids": jagged([1, 2], [3, 4, 5]), "labels": ["a", "b"]}, {"temp": 1.0})
    td2 = tu.get_tensordict({"input_ids": jagged([6], [7, 8]), "labels": ["c", "d"]}, {"temp": 2.0})
    td1_copy, td2_copy = copy.deepcopy(td1), copy.deepcopy(td2)
    output = tu.concat_tensordict([td1, td2])
    assert output["input_ids"].values().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert output["labels"] == ["a", "b", "c", "d"]
    assert output["temp"] == 1.0
    tu.assert_tensordict_eq(td1, td1_copy)  # the inputs are untouched
    tu.assert_tensordict_eq(td2, td2_copy)

    # only NonTensorStack and NonTensorData
    td1 = tu.get_tensordict(tensor_dict={"labels": ["a", "b"]}, non_tensor_dict={"temp": 1.0})
    td2 = tu.get_tensordict(tensor_dict={"labels": ["c", "d"]}, non_tensor_dict={"temp": 2.0})
    output = tu.concat_tensordict([td1, td2])
    assert output["labels"] == ["a", "b", "c", "d"] and output["temp"] == 1.0 and output.batch_size[0] == 4

    # only NonTensorData: the first one
    td1 = tu.get_tensordict(tensor_dict={}, non_tensor_dict={"temp": 1.0})
    td2 = tu.get_tensordict(tensor_dict={}, non_tensor_dict={"temp": 2.0})
    output = tu.concat_tensordict([td1, td2])
    assert len(output.batch_size) == 0 and output["temp"] == 1.0


def test_concat_tensordict_errors_name_the_keys():
    td1 = tu.get_tensordict({"ids": jagged([1], [2])})
    with pytest.raises(AssertionError, match=r"TensorDict 1 has keys \['obs'\], TensorDict 0 has \['ids'\]"):
        tu.concat_tensordict([td1, tu.get_tensordict({"obs": torch.zeros(2)})])
    with pytest.raises(AssertionError, match=r"nested tensors \[\], TensorDict 0 has \['ids'\]"):
        tu.concat_tensordict([td1, tu.get_tensordict({"ids": torch.zeros(2, 1)})])
    with pytest.raises(AssertionError, match="at least one"):
        tu.concat_tensordict([])
    with pytest.raises(AssertionError, match=r"TensorDict 1 has batch size \[2\]"):
        tu.concat_tensordict_with_none_bsz([tu.get_tensordict({}, {"t": 1}), td1])


def test_chunk_tensordict():
    position_ids = jagged(*(torch.arange(n).expand(4, n) for n in (4, 5, 6, 7)))  # Qwen-VL 3-D: [B, 4, j]
    input_ids = jagged(*(torch.arange(n) for n in (4, 5, 6, 7)))
    attention_mask = jagged(*(torch.ones(3, n, dtype=torch.long) for n in (4, 5, 6, 7)))
    pixels = [{"pixel_values": torch.full((3, 2, 2), 1.0)}, None, {"pixel_values": torch.full((3, 1, 1), 2.0)}]
    pixels.append({"pixel_values": torch.full((3, 1, 1), 3.0)})
    multi_modal_inputs = torch.stack([NonTensorData(p) for p in pixels])
    td = tu.get_tensordict(
        {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "attention_mask": attention_mask,
            "multi_modal_inputs": multi_modal_inputs,
        }
    )
    assert len(td) == 4
    first, second = tu.chunk_tensordict(td, chunks=2)
    assert len(first) == 2 and len(second) == 2
    assert rows_of(first["input_ids"]) == [[0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert rows_of(second["input_ids"]) == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]]
    assert rows_of(second["position_ids"]) == [[list(range(6))] * 4, [list(range(7))] * 4]
    assert [list(row.shape) for row in first["attention_mask"].unbind()] == [[3, 4], [3, 5]]
    assert first["multi_modal_inputs"][1] is None
    assert first["multi_modal_inputs"][0]["pixel_values"].sum().item() == 12.0  # 3 * 2 * 2 ones
    assert [p["pixel_values"].sum().item() for p in second["multi_modal_inputs"]] == [6.0, 9.0]


def test_assign_non_tensor_stack_with_nested_lists():
    td = tu.get_tensordict({"obs": torch.zeros(3, 4)}, non_tensor_dict={})
    tu.assign_non_tensor_stack(td, "turn_scores", [[], [0.5, 0.8], [0.9]])
    assert len(td["turn_scores"]) == 3
    assert list(td["turn_scores"][0]) == [] and list(td["turn_scores"][1]) == [0.5, 0.8]
    assert list(td["turn_scores"][2]) == [0.9]


def test_assign_non_tensor_stack_with_nested_dicts():
    td = tu.get_tensordict({"obs": torch.zeros(3, 4)}, non_tensor_dict={})
    info = [{"acc": 1.0, "loss": 0.1}, {"acc": 0.0, "loss": 0.9}, {"acc": 1.0, "loss": 0.05}]
    tu.assign_non_tensor_stack(td, "reward_extra_info", info)
    assert len(td["reward_extra_info"]) == 3
    assert [dict(entry) for entry in td["reward_extra_info"]] == info


def test_assign_non_tensor_stack_with_complex_nested():
    td = tu.get_tensordict({"obs": torch.zeros(2, 4)}, non_tensor_dict={})
    raw_prompt = [
        [{"content": "Question 1", "role": "user"}],
        [{"content": "Question 2", "role": "user"}, {"content": "Answer 2", "role": "assistant"}],
    ]
    tu.assign_non_tensor_stack(td, "raw_prompt", raw_prompt)
    assert len(td["raw_prompt"]) == 2
    assert len(td["raw_prompt"][0]) == 1 and dict(td["raw_prompt"][0][0]) == {"content": "Question 1", "role": "user"}
    assert len(td["raw_prompt"][1]) == 2 and dict(td["raw_prompt"][1][0]) == {"content": "Question 2", "role": "user"}


def test_assign_non_tensor_handles_wrappers():
    td = tu.get_tensordict({"obs": torch.zeros(3, 4)}, non_tensor_dict={})
    tu.assign_non_tensor(td, top_p=0.8)
    assert td["top_p"] == 0.8
    stack = NonTensorStack.from_list([NonTensorData(1.0), NonTensorData(2.0), NonTensorData(3.0)])
    tu.assign_non_tensor(td, wrapped=NonTensorData(0.3), stack=stack)
    assert td["wrapped"] == 0.3
    assert td["stack"] == [1.0, 2.0, 3.0]


def test_assign_non_tensor_stack_batch_size_check():
    td = tu.get_tensordict({"obs": torch.zeros(3, 4)}, non_tensor_dict={})
    stack = NonTensorStack.from_list([NonTensorData(1.0), NonTensorData(2.0)])
    with pytest.raises(RuntimeError, match="'stack' has 2 entries but the TensorDict has 3 rows"):
        tu.assign_non_tensor(td, stack=stack)
    with pytest.raises(RuntimeError, match="'scores' has 2 entries"):
        tu.assign_non_tensor_stack(td, "scores", [1.0, 2.0])


def test_assign_non_tensor_with_auto_detection():
    td = tu.get_tensordict({"obs": torch.zeros(3, 4)}, non_tensor_dict={})
    out = tu.assign_non_tensor(
        td,
        metadata="experiment_1",
        turn_scores=[[], [0.5, 0.8], [0.9]],
        reward_extra_info=[{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0}],
        simple_list=["a", "b", "c"],
    )
    assert out is td
    assert td["metadata"] == "experiment_1"
    assert len(td["turn_scores"]) == 3 and list(td["turn_scores"][1]) == [0.5, 0.8]
    assert len(td["reward_extra_info"]) == 3 and dict(td["reward_extra_info"][0]) == {"acc": 1.0}
    assert len(td["simple_list"]) == 3 and td["simple_list"][0] == "a"


def test_get_tensordict_with_nested_lists_and_dicts():
    obs = torch.arange(12.0).reshape(3, 4)
    td = tu.get_tensordict({"obs": obs, "turn_scores": [[], [0.5, 0.8], [0.9]]})
    assert torch.equal(td["obs"], obs)
    assert len(td["turn_scores"]) == 3 and list(td["turn_scores"][0]) == [] and list(td["turn_scores"][1]) == [0.5, 0.8]

    td = tu.get_tensordict({"obs": obs, "reward_extra_info": [{"acc": 1.0}, {"acc": 0.0}, {"acc": 1.0}]})
    assert len(td["reward_extra_info"]) == 3 and dict(td["reward_extra_info"][0]) == {"acc": 1.0}

    raw_prompt = [[{"content": "Q1", "role": "user"}], [{"content": "Q2", "role": "user"}, {"content": "A2"}]]
    td = tu.get_tensordict({"obs": obs[:2], "raw_prompt": raw_prompt})
    assert len(td["raw_prompt"]) == 2 and dict(td["raw_prompt"][0][0]) == {"content": "Q1", "role": "user"}


def test_get_tensordict_agent_loop_scenario():
    prompts, responses = torch.arange(20.0).reshape(2, 10), torch.arange(10.0).reshape(2, 5)
    td = tu.get_tensordict(
        tensor_dict={
            "prompts": prompts,
            "responses": responses,
            "data_source": ["lighteval/MATH", "lighteval/MATH"],
            "uid": ["uuid-1", "uuid-2"],
            "turn_scores": [[], [0.5, 0.8]],
            "reward_extra_info": [{"acc": 1.0, "loss": 0.1}, {"acc": 0.0, "loss": 0.9}],
            "raw_prompt": [
                [{"content": "Compute 4 @ 2", "role": "user"}],
                [{"content": "Compute 8 @ 7", "role": "user"}],
            ],
            "tool_rewards": [[0.0], []],
        },
        non_tensor_dict={"global_steps": 42},
    )
    assert torch.equal(td["prompts"], prompts) and torch.equal(td["responses"], responses)
    assert td["data_source"] == ["lighteval/MATH", "lighteval/MATH"] and td["uid"] == ["uuid-1", "uuid-2"]
    assert list(td["turn_scores"][0]) == [] and list(td["turn_scores"][1]) == [0.5, 0.8]
    assert dict(td["reward_extra_info"][0]) == {"acc": 1.0, "loss": 0.1}
    assert dict(td["raw_prompt"][0][0]) == {"content": "Compute 4 @ 2", "role": "user"}
    assert list(td["tool_rewards"][0]) == [0.0] and list(td["tool_rewards"][1]) == []
    assert td["global_steps"] == 42


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_get_tensordict_errors_name_the_column():
    with pytest.raises(AssertionError, match="column 'b' has 3 rows, the columns before it have 2"):
        tu.get_tensordict({"a": torch.zeros(2), "b": ["x", "y", "z"]})
    with pytest.raises(AssertionError, match="column 'imgs' is a list holding torch.Tensors"):
        tu.get_tensordict({"imgs": [torch.zeros(2)]})
    with pytest.raises(AssertionError, match="column 'arr' is a ndarray"):
        tu.get_tensordict({"arr": np.zeros(2)})
    with pytest.raises(AssertionError, match="key 'a' is in both"):
        tu.get_tensordict({"a": torch.zeros(2)}, {"a": 1})
    strided = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(AssertionError, match="nested tensor 'n' must be contiguous with layout=torch.jagged"):
        tu.get_tensordict({"n": strided})


def test_contiguous():
    a = torch.arange(12.0).reshape(3, 4)
    b = torch.arange(12.0).reshape(3, 4)[:, :-1]  # not contiguous
    c = jagged(torch.arange(3.0), torch.arange(4.0), torch.arange(5.0))
    pixels = [{"pixel": torch.full((2, 3), float(i))} for i in range(3)]
    data = tu.get_tensordict({"a": a, "b": b, "c": c, "nt": pixels}, non_tensor_dict={"ntd": a.clone()})
    # Adapted: verl also checks that data.consolidate() raises on `b`; tensordict 0.15 consolidates it anyway.
    assert not data["b"].is_contiguous()
    data_cont = tu.contiguous(copy.deepcopy(data))
    assert data_cont["b"].is_contiguous() and data_cont["b"].tolist() == [[0, 1, 2], [4, 5, 6], [8, 9, 10]]
    assert data_cont.batch_size == torch.Size([3])
    tu.assert_tensordict_eq(data_cont, data)
    tu.assert_tensordict_eq(data_cont.consolidate(), data)


# ------------------------------------------------------------------------------ jagged round trips and errors
def mixed_batch() -> TensorDict:
    """Four rows: 2-D jagged ids, 3-D jagged position ids [B, 3, j], a dense tensor, a NonTensorStack, metadata.
    Rows 2 and 3 share a length, so the second half's position ids have no length that varies."""
    lengths = (2, 4, 3, 3)
    ids = jagged(*(torch.arange(10 * i, 10 * i + n) for i, n in enumerate(lengths)))
    positions = jagged(*(torch.arange(3 * n).reshape(3, n) + 100 * i for i, n in enumerate(lengths)))
    dense = torch.arange(8.0).reshape(4, 2)
    messages = [[{"role": "user", "content": "q0"}], [], [{"role": "user", "content": "q2"}], [{"k": [1, 2]}]]
    return tu.get_tensordict({"ids": ids, "pos": positions, "dense": dense, "msgs": messages}, {"step": 7})


def test_chunk_then_concat_round_trips_a_jagged_batch_exactly():
    td = mixed_batch()
    assert td["pos"].shape[:2] == torch.Size([4, 3]) and td["pos"]._ragged_idx == 2
    for chunks in (1, 2, 4):
        parts = tu.chunk_tensordict(td, chunks)
        assert [len(p) for p in parts] == [4 // chunks] * chunks
        for part in parts:  # each part keeps the ragged dim, even when its rows share one length
            assert part["pos"].shape[1] == 3 and part["pos"]._ragged_idx == 2
            assert part["step"] == 7
        tu.assert_tensordict_eq(tu.concat_tensordict(parts), td)

    first, second = tu.chunk_tensordict(td, 2)
    assert rows_of(first["ids"]) == [[0, 1], [10, 11, 12, 13]]
    assert rows_of(second["ids"]) == [[20, 21, 22], [30, 31, 32]]
    assert rows_of(second["pos"])[0] == [[200, 201, 202], [203, 204, 205], [206, 207, 208]]
    assert second["dense"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert second["msgs"] == [[{"role": "user", "content": "q2"}], [{"k": [1, 2]}]]

    merged = tu.concat_tensordict([first, second])
    assert merged["pos"].shape[:2] == torch.Size([4, 3]) and merged["pos"]._ragged_idx == 2
    assert merged["pos"].offsets().tolist() == [0, 2, 6, 9, 12]


def test_index_select_keeps_the_ragged_dim_of_rows_that_share_a_length():
    selected = tu.index_select_tensor_dict(mixed_batch(), [3, 2, 3])
    assert selected["pos"].shape[:2] == torch.Size([3, 3]) and selected["pos"]._ragged_idx == 2
    assert rows_of(selected["ids"]) == [[30, 31, 32], [20, 21, 22], [30, 31, 32]]
    assert selected["msgs"] == [[{"k": [1, 2]}], [{"role": "user", "content": "q2"}], [{"k": [1, 2]}]]
    assert selected["step"] == 7
    with pytest.raises(AssertionError, match=r"1D tensor, got shape \[1, 2\]"):
        tu.index_select_tensor_dict(mixed_batch(), torch.tensor([[0, 1]]))
    with pytest.raises(AssertionError, match="must be integers, got torch.bool"):
        tu.index_select_tensor_dict(mixed_batch(), torch.tensor([True, False, True, False]))


def test_uneven_chunk_raises_naming_the_sizes():
    with pytest.raises(ProtocolError, match="got 4 and 3.*pad_to_divisor"):
        tu.chunk_tensordict(mixed_batch(), 3)
    with pytest.raises(ProtocolError, match="takes a TensorDict, got list"):
        tu.chunk_tensordict([1, 2], 2)
    with pytest.raises(ProtocolError, match=r"batch size \[\]"):
        tu.chunk_tensordict(tu.get_tensordict({}, {"t": 1}), 1)


def test_consolidated_pickled_batch_keeps_the_3d_ragged_dim_and_the_fix_is_idempotent():
    data = tu.contiguous(mixed_batch()).consolidate()
    restored = pickle.loads(pickle.dumps(data))
    tu.maybe_fix_3d_position_ids(restored)  # verl's key is position_ids; this batch calls it pos: untouched
    assert restored["pos"]._ragged_idx == 2
    restored["position_ids"] = restored.pop("pos")
    tu.maybe_fix_3d_position_ids(restored)
    assert restored["position_ids"]._ragged_idx == 2
    assert rows_of(restored["position_ids"])[1] == (torch.arange(12).reshape(3, 4) + 100).tolist()
    assert rows_of(restored["ids"]) == [[0, 1], [10, 11, 12, 13], [20, 21, 22], [30, 31, 32]]
