"""DataProto: construction, indexing, split/join, padding, save/load and Ray round trips."""

import pickle

import numpy as np
import pytest
import torch

from rlworkers.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from rlworkers.single_controller.futures import plan_shard


def make(n=6, meta=None):
    return DataProto.from_dict(
        tensors={"ids": torch.arange(n * 3).reshape(n, 3), "score": torch.linspace(0, 1, n, dtype=torch.bfloat16)},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "info": [{"i": i} for i in range(n)]},
        meta_info=meta or {"temperature": 1.0},
    )


def assert_same(a: DataProto, b: DataProto):
    assert len(a) == len(b)
    assert set(a.batch.keys()) == set(b.batch.keys())
    for key in a.batch.keys():
        assert a.batch[key].dtype == b.batch[key].dtype
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for key in a.non_tensor_batch:
        assert list(a.non_tensor_batch[key]) == list(b.non_tensor_batch[key]), key
    assert a.meta_info == b.meta_info


def test_from_dict_checks_batch_sizes():
    with pytest.raises(ValueError, match="tensors\\['b'\\]"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match="non_tensor_batch\\['s'\\] has 2 rows"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"s": ["x", "y"]})


def test_from_single_dict_sorts_columns():
    data = DataProto.from_single_dict({"a": torch.ones(2, 2), "s": ["x", "y"]})
    assert list(data.batch.keys()) == ["a"] and list(data.non_tensor_batch) == ["s"]
    assert data.non_tensor_batch["s"].dtype == object


def test_indexing_int_slice_array_mask():
    data = make()
    item = data[2]
    assert torch.equal(item.batch["ids"], torch.tensor([6, 7, 8])) and item.non_tensor_batch["uid"] == "u2"
    assert list(data[1:3].non_tensor_batch["uid"]) == ["u1", "u2"]
    assert list(data[[4, 0]].non_tensor_batch["uid"]) == ["u4", "u0"]
    assert torch.equal(data[np.array([5])].batch["ids"], torch.tensor([[15, 16, 17]]))
    mask = torch.tensor([True, False, False, True, False, True])
    assert list(data[mask].non_tensor_batch["uid"]) == ["u0", "u3", "u5"]
    with pytest.raises(IndexError):
        data[np.array([True, False])]


def test_select_pop_union():
    data = make()
    sel = data.select(batch_keys=["ids"], non_tensor_batch_keys=["uid"])
    assert list(sel.batch.keys()) == ["ids"] and list(sel.non_tensor_batch) == ["uid"]
    popped = data.pop(batch_keys=["score"], non_tensor_batch_keys=["info"])
    assert "score" not in data.batch.keys() and "info" not in data.non_tensor_batch
    assert len(popped) == 6 and "score" in popped.batch.keys()
    data.union(popped)
    assert "score" in data.batch.keys() and "info" in data.non_tensor_batch
    other = make()
    other.batch["ids"] = other.batch["ids"] + 1
    with pytest.raises(ValueError, match="'ids' differs"):
        data.union(other)
    with pytest.raises(ValueError, match="meta_info|temperature"):
        data.union(make(meta={"temperature": 0.5}))


def test_chunk_split_concat_and_metrics_merge():
    data = make()
    chunks = data.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    with pytest.raises(ValueError, match="pad first"):
        data.chunk(4)
    assert [len(p) for p in data.split(4)] == [4, 2]
    chunks[0].meta_info["metrics"] = {"loss": 1.0}
    chunks[1].meta_info["metrics"] = [{"loss": 2.0}, {"loss": 3.0}]  # a list of dicts: one per worker, as in verl
    merged = DataProto.concat(chunks)
    assert merged.meta_info["metrics"] == {"loss": [1.0, 2.0, 3.0]}
    merged.meta_info.pop("metrics")
    assert_same(merged, data)


def test_repeat_and_reorder():
    data = make(3)
    assert list(data.repeat(2, interleave=True).non_tensor_batch["uid"]) == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert list(data.repeat(2, interleave=False).non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u0", "u1", "u2"]
    data.reorder(torch.tensor([2, 0, 1]))
    assert list(data.non_tensor_batch["uid"]) == ["u2", "u0", "u1"]
    assert torch.equal(data.batch["ids"][:, 0], torch.tensor([6, 0, 3]))


@pytest.mark.parametrize("n,divisor", [(5, 4), (8, 4), (1, 3), (7, 2)])
def test_pad_to_divisor_and_unpad(n, divisor):
    data = make(n)
    padded, pad = pad_dataproto_to_divisor(data, divisor)
    assert len(padded) % divisor == 0 and pad == (-n) % divisor
    # padding repeats leading rows
    assert list(padded.non_tensor_batch["uid"][n:]) == [f"u{i % n}" for i in range(pad)]
    assert_same(unpad_dataproto(padded, pad), data)


def test_save_load_round_trip_without_pickle(tmp_path):
    data = make()
    path = tmp_path / "batch.safetensors"
    data.save_to_disk(str(path))
    assert b"pickle" not in path.read_bytes()[:64]
    assert_same(DataProto.load_from_disk(str(path)), data)


def test_save_rejects_non_json_values(tmp_path):
    data = DataProto.from_dict({"a": torch.zeros(1)}, {"obj": [object()]})
    with pytest.raises(TypeError, match="non_tensor_batch\\['obj'\\]"):
        data.save_to_disk(str(tmp_path / "x.safetensors"))


def test_load_rejects_foreign_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="not a DataProto file"):
        DataProto.load_from_disk(str(tmp_path / "model.safetensors"))


def test_pickle_moves_tensors_out_of_band():
    data = DataProto.from_dict(
        {"x": torch.randn(1000, 256), "m": torch.ones(1000, 256, dtype=torch.bfloat16)}, {"uid": ["a"] * 1000}
    )
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2  # one out-of-band buffer per tensor
    assert len(payload) < 20_000 < data.nbytes()  # 1.5 MB of tensors travel out of band, not in the pickle
    restored = pickle.loads(payload, buffers=buffers)
    assert_same(restored, data)


def test_ray_round_trip(ray_cluster):
    data = make(64)
    assert_same(ray_cluster.get(ray_cluster.put(data)), data)


@pytest.mark.parametrize("lengths,world", [([4, 4], 2), ([3, 3, 2], 4), ([5], 3), ([2, 0, 3], 2), ([1], 4)])
def test_plan_shard_covers_every_row_once(lengths, world):
    total = sum(lengths)
    rows = []
    pads = 0
    for rank in range(world):
        plan, pad = plan_shard(lengths, rank, world, auto_padding=True)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        rows += [int(offsets[c]) + i for c, lo, hi in plan for i in range(lo, hi)]
        pads += pad
    padded_total = total + (-total) % world
    assert len(rows) == padded_total and pads == padded_total - total
    assert rows[:total] == list(range(total))  # real rows in order, then the padding copies
    assert rows[total:] == [i % total for i in range(padded_total - total)]


def test_plan_shard_fetches_each_chunk_once_for_matching_groups():
    fetched = [c for rank in range(4) for c, _, _ in plan_shard([8, 8, 8, 8], rank, 4, True)[0]]
    assert sorted(fetched) == [0, 1, 2, 3]
