import pickle

import pytest
import torch

from easyvlm.data.batch import Batch


def make(n: int = 4) -> Batch:
    # rows i = 0..n-1: x = [i, 10 i], name = "s{i}"
    x = torch.stack([torch.arange(n), 10 * torch.arange(n)], dim=1)
    return Batch({"x": x}, {"name": [f"s{i}" for i in range(n)]}, {"step": 3})


def test_getitem_missing_key_names_present_keys():
    b = make()
    with pytest.raises(KeyError) as err:
        b["y"]
    assert "'y'" in str(err.value) and "'name'" in str(err.value) and "'x'" in str(err.value)
    with pytest.raises(KeyError, match=r"\['a', 'b'\]"):
        b.require("x", "a", "b")


def test_inconsistent_sizes_rejected():
    with pytest.raises(ValueError, match="inconsistent batch sizes"):
        Batch({"x": torch.zeros(3)}, {"name": ["a", "b"]})
    b = make()
    with pytest.raises(ValueError, match="batch size 2"):
        b["z"] = torch.zeros(2)


def test_select_and_pop():
    b = make()
    s = b.select("x")
    assert s.keys() == ["x"] and s.meta == {"step": 3}
    popped = b.pop("name")
    assert popped["name"] == ["s0", "s1", "s2", "s3"]
    assert "name" not in b and "x" in b
    with pytest.raises(KeyError):
        b.select("name")


def test_union_merges_and_detects_conflicts():
    a = make()
    other = Batch({"x": a["x"].clone(), "y": torch.ones(4)}, meta={"step": 3})
    u = a.union(other)
    assert sorted(u.keys()) == ["name", "x", "y"]
    conflict = Batch({"x": a["x"] + 1})
    with pytest.raises(ValueError, match="'x' is in both batches with different values"):
        a.union(conflict)
    with pytest.raises(ValueError, match="meta key 'step'"):
        a.union(Batch({"y": torch.ones(4)}, meta={"step": 4}))
    with pytest.raises(ValueError, match="batch sizes differ"):
        a.union(Batch({"y": torch.ones(3)}))


def test_split_chunk_concat_roundtrip():
    b = make(5)
    parts = b.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert parts[2]["name"] == ["s4"] and parts[2]["x"].tolist() == [[4, 40]]
    back = Batch.concat(parts)
    assert torch.equal(back["x"], b["x"]) and back["name"] == b["name"]
    with pytest.raises(ValueError, match="pad_to_divisor"):
        b.chunk(2)
    assert [p["name"] for p in make(4).chunk(2)] == [["s0", "s1"], ["s2", "s3"]]
    with pytest.raises(ValueError, match="keys"):
        Batch.concat([make(2), make(2).select("x")])


def test_repeat_interleaved_and_tiled():
    b = make(2)
    assert b.repeat(3)["name"] == ["s0", "s0", "s0", "s1", "s1", "s1"]
    assert b.repeat(2, interleave=False)["name"] == ["s0", "s1", "s0", "s1"]
    assert b.repeat(2)["x"][:, 1].tolist() == [0, 0, 10, 10]


def test_repeat_copies_mutable_objects():
    b = Batch(objects={"extra": [{"k": 1}]})
    r = b.repeat(2)
    r["extra"][0]["k"] = 99
    assert r["extra"][1]["k"] == 1 and b["extra"][0]["k"] == 1


def test_reorder_is_a_permutation():
    b = make(3)
    r = b.reorder([2, 0, 1])
    assert r["name"] == ["s2", "s0", "s1"] and r["x"][:, 0].tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="permutation"):
        b.reorder([0, 0, 1])


def test_pad_to_divisor_and_unpad():
    b = make(5)
    padded, pad = b.pad_to_divisor(4)
    # 5 rows -> 8: pads with rows 0, 1, 2
    assert pad == 3 and len(padded) == 8
    assert padded["name"][5:] == ["s0", "s1", "s2"]
    assert len(padded.chunk(4)) == 4
    restored = padded.unpad(pad)
    assert restored["name"] == b["name"] and torch.equal(restored["x"], b["x"])
    same, zero = make(4).pad_to_divisor(2)
    assert zero == 0 and len(same) == 4


def test_pickle_roundtrip():
    b = make()
    b2 = pickle.loads(pickle.dumps(b))
    assert torch.equal(b2["x"], b["x"]) and b2["name"] == b["name"] and b2.meta == {"step": 3}
