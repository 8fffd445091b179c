"""Reading rows: every file type, directories, path@split, save_to_disk, hub names, builtin."""

from __future__ import annotations

import csv
import json

import pytest
from data_testing import write_jsonl

from easyvlm.data.loading import DataError, load_sources, split_spec

ROWS = [
    {"problem": "<image> What colour?", "answer": "red", "images": ["a.png"], "difficulty": 2},
    {"problem": "2 + 2 =", "answer": "4", "images": [], "difficulty": 1},
]


def rows_of(spec, **kwargs):
    return [dict(s.rows[i]) for s in load_sources(spec, **kwargs) for i in range(len(s))]


def test_jsonl_rows_keep_every_column_and_line_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")  # a blank line between
    (source,) = load_sources(str(path))
    assert [source.rows[i] for i in range(2)] == ROWS
    assert source.where(1) == f"{path} row 1 (line 3)"
    assert source.base_dir == tmp_path


def test_json_parquet_arrow_csv(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "hf.parquet"))
    arrow_dir = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(arrow_dir))
    (arrow_file,) = arrow_dir.glob("*.arrow")
    for name in ("d.json", "d.parquet", "hf.parquet"):
        assert rows_of(str(tmp_path / name)) == ROWS, name
    assert rows_of(str(arrow_file)) == ROWS
    assert rows_of(str(arrow_dir)) == ROWS  # the save_to_disk directory itself

    with open(tmp_path / "d.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        for row in ROWS:
            writer.writerow({**row, "images": json.dumps(row["images"])})
    # CSV cells stay strings (the dataset parses a JSON list in the image column)
    assert rows_of(str(tmp_path / "d.csv"))[1] == {"problem": "2 + 2 =", "answer": "4", "images": "[]", "difficulty": "1"}


def test_directory_and_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [ROWS[0]])
    write_jsonl(tmp_path / "test.jsonl", [ROWS[1]])
    write_jsonl(tmp_path / "data" / "train-00001.jsonl", [ROWS[1]])
    write_jsonl(tmp_path / "test" / "part.jsonl", [ROWS[0]])
    write_jsonl(tmp_path / "trainer_notes.jsonl", [ROWS[0]])  # "trainer" is not split "train"
    labels = lambda spec: [s.label.removeprefix(str(tmp_path) + "/") for s in load_sources(spec)]  # noqa: E731
    assert labels(f"{tmp_path}@train") == ["data/train-00001.jsonl", "train.jsonl"]
    assert labels(f"{tmp_path}@test") == ["test/part.jsonl", "test.jsonl"]  # sorted by path parts
    assert len(labels(str(tmp_path))) == 5
    with pytest.raises(DataError, match=r"no data files for split 'validation'"):
        load_sources(f"{tmp_path}@validation")


def test_saved_dataset_dict_split(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert rows_of(f"{tmp_path / 'dd'}@test") == ROWS[:1]
    with pytest.raises(DataError, match=r"has splits \['test', 'train'\], not 'val'"):
        load_sources(f"{tmp_path / 'dd'}@val")


def test_split_spec():
    assert split_spec("org/name@test") == ("org/name", "test")
    assert split_spec("org/name") == ("org/name", None)
    assert split_spec("data/rows.jsonl@train") == ("data/rows.jsonl", "train")


def test_malformed_files_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl line 2: not valid JSON"):
        load_sources(str(bad))
    listy = tmp_path / "list.jsonl"
    listy.write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"list.jsonl line 1: expected a JSON object per line, got list"):
        load_sources(str(listy))
    obj = tmp_path / "obj.json"
    obj.write_text(json.dumps(ROWS[0]))
    with pytest.raises(DataError, match=r"obj.json: expected a JSON list of objects"):
        load_sources(str(obj))


def test_missing_path_and_empty_spec(tmp_path):
    with pytest.raises(DataError, match=r"data.val_files: '\./nope.jsonl' is neither an existing file"):
        load_sources("./nope.jsonl", key="data.val_files")
    with pytest.raises(DataError, match=r"data.train_files is empty"):
        load_sources("")


def test_hub_dataset_offline_names_it_and_suggests_a_local_path(monkeypatch, tmp_path):
    # an empty HF cache and offline mode (tests/conftest.py sets HF_HUB_OFFLINE=1 for all tests)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    with pytest.raises(DataError) as info:
        load_sources("some-org/some-dataset@test")
    message = str(info.value)
    assert "Hugging Face dataset 'some-org/some-dataset' (split 'test')" in message
    assert "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set and it is not in the local Hugging Face cache" in message
    assert "set data.train_files=path/to/train.parquet" in message


def test_builtin_synthetic(easyvlm_cache_dir):
    from easyvlm.builtin.synthetic import materialize_dataset

    (source,) = load_sources("builtin:synthetic@val")
    assert source.label == str(materialize_dataset("val"))
    assert set(source.rows[0]) == {"problem", "answer", "images", "task", "options"}
    with pytest.raises(DataError, match="unknown built-in data set"):
        load_sources("builtin:nonsense@train")
