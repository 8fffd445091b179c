"""``python -m easyvlm.rm``: bad preference rows, the pair batch layout, and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def rm_args(model_path: str, out: Path, *extra: str) -> list[str]:
    return [f"config={REPO / 'examples' / 'rm.yaml'}", f"model.model_path={model_path}",
            f"data.format_prompt={REPO / 'format_prompts' / 'synthetic.jinja'}",
            "data.train_files=builtin:synthetic-preference@val", "data.val_files=", "trainer.val_before_train=false",
            "trainer.val_freq=-1", "data.batch_size=8", "trainer.micro_batch_size_per_device=3",
            f"trainer.save_checkpoint_path={out}", *extra]


def test_a_row_without_its_rejected_response_is_named(tiny_model_path, tmp_path, capsys):
    from easyvlm.builtin.synthetic import resolve_builtin_dataset
    from easyvlm.rm.train import main

    source = resolve_builtin_dataset("builtin:synthetic-preference@val")
    rows = [json.loads(line) for line in source.read_text().splitlines()[:4]]
    del rows[2]["rejected"]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({**r, "images": [str(source.parent / r["images"][0])]}) + "\n" for r in rows))
    with pytest.raises(SystemExit) as exit_info:
        main(rm_args(tiny_model_path, tmp_path / "run", f"data.train_files={data}"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "data error" in err and "pairs.jsonl" in err and "line 3" in err
    assert "the response column 'rejected' is missing" in err


def test_config_problems_exit_before_anything_loads(tmp_path, capsys):
    from easyvlm.rm.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["data.batch_size=0", "model.lora.rank=4", "trainer.val_freq=0", "data.chosen_kye=x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "data.chosen_kye: unknown key in data; did you mean data.chosen_key?" in err
    # the rules run beside the unknown key (easyvlm.config.cli.parse_and_validate): every problem at once
    assert "model.lora.rank: LoRA reward-model training is not supported" in err and "data.batch_size" in err


def test_a_bad_cpu_linear_switch_exits_2_before_the_config(monkeypatch, capsys):
    from easyvlm.rm.train import main

    monkeypatch.setenv("EASYVLM_CPU_LINEAR", "fast")
    with pytest.raises(SystemExit) as exit_info:
        main(["data.chosen_kye=x"])  # a config problem too: the environment's is reported first, alone
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("easyvlm: environment error: ") and "EASYVLM_CPU_LINEAR='fast': use 'auto'" in err
    assert "chosen_kye" not in err


def test_pairs_are_consecutive_rows_with_their_margin(tiny_model_path):
    from easyvlm.plan.models import load_bundle
    from easyvlm.models.settings import ModelConfig
    from easyvlm.rm.config import PreferenceDataConfig
    from easyvlm.rm.data import PreferenceDataset, collate_pairs

    bundle = load_bundle(ModelConfig(model_path=tiny_model_path))
    config = PreferenceDataConfig(train_files="builtin:synthetic-preference@val", max_response_length=32, min_pixels=3136,
                                  max_pixels=50176)
    eot = bundle.tokenizer.eos_token_id
    data = PreferenceDataset(config.train_files, config, bundle.tokenizer, bundle.processor, bundle.policy.hf_config, eot)
    pairs = [data[0], data[1]]
    batch = collate_pairs(pairs, bundle.tokens.pad, 32)
    assert len(batch) == 4
    for i, pair in enumerate(pairs):
        for row, ids in ((2 * i, pair["chosen_ids"]), (2 * i + 1, pair["rejected_ids"])):
            assert ids[-1] == eot  # every response ends with the end-of-turn token, as a finished rollout
            assert batch["responses"][row][batch["response_mask"][row]].tolist() == ids
            assert torch.equal(batch["input_ids"][row][: batch["prompts"].shape[1]], batch["prompts"][2 * i])
    assert [bundle.tokenizer.decode(p["chosen_ids"][:-1]) for p in pairs] == [data.sources[0].rows[i]["chosen"] for i in (0, 1)]


def test_resume_gives_the_uninterrupted_weights(tiny_model_path, tmp_path):
    from safetensors.torch import load_file

    from easyvlm.rm.train import main

    main(rm_args(tiny_model_path, tmp_path / "whole", "trainer.max_steps=4"))
    main(rm_args(tiny_model_path, tmp_path / "cut", "trainer.max_steps=2"))
    main(rm_args(tiny_model_path, tmp_path / "cut", "trainer.max_steps=4"))  # resumes from global_step_2
    whole = load_file(tmp_path / "whole" / "global_step_4" / "huggingface" / "model.safetensors")
    resumed = load_file(tmp_path / "cut" / "global_step_4" / "huggingface" / "model.safetensors")
    assert whole.keys() == resumed.keys() and "score.weight" in whole
    for key in whole:
        torch.testing.assert_close(resumed[key], whole[key], rtol=0, atol=0)
    steps = [json.loads(line)["step"] for line in (tmp_path / "cut" / "experiment_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_print_config_shows_the_resolved_config(capsys):
    from easyvlm.rm.train import main

    with pytest.raises(SystemExit) as exit_info:
        main([f"config={REPO / 'examples' / 'rm.yaml'}", "data.margin_key=margin", "print_config=true"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "margin_key: margin" in out and "train_files: builtin:synthetic-colour-preference@train" in out
    assert "total_epochs: 24" in out


def test_margins_are_read_and_checked(tiny_model_path, tmp_path):
    from easyvlm.builtin.synthetic import resolve_builtin_dataset
    from easyvlm.models.settings import ModelConfig
    from easyvlm.data.loading import DataError
    from easyvlm.plan.models import load_bundle
    from easyvlm.rm.config import PreferenceDataConfig
    from easyvlm.rm.data import PreferenceDataset, collate_pairs

    source = resolve_builtin_dataset("builtin:synthetic-preference@val")
    rows = [json.loads(line) for line in source.read_text().splitlines()[:3]]
    rows = [{**r, "images": [str(source.parent / r["images"][0])], "gap": m} for r, m in zip(rows, (0.5, 2, 0.0))]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bundle = load_bundle(ModelConfig(model_path=tiny_model_path))
    config = PreferenceDataConfig(train_files=str(data), margin_key="gap", min_pixels=3136, max_pixels=50176)
    args = (bundle.tokenizer, bundle.processor, bundle.policy.hf_config, bundle.tokenizer.eos_token_id)
    dataset = PreferenceDataset(str(data), config, *args)
    batch = collate_pairs([dataset[i] for i in range(3)], bundle.tokens.pad, config.max_response_length)
    assert batch["margin"].tolist() == [0.5, 0.5, 2.0, 2.0, 0.0, 0.0]  # each pair's, on both of its rows
    rows[1]["gap"] = -1
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problem = r"pairs.jsonl row 1 \(line 2\): the margin column 'gap' \(data.margin_key\) must be a number >= 0, got -1"
    with pytest.raises(DataError, match=problem):
        PreferenceDataset(str(data), config, *args)
