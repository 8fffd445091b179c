"""A short supervised warm start (an SFT cold start) of the builtin tiny models on the synthetic tasks.

A randomly initialised model cannot answer in the task's format, so RL from it has no reward to
learn from. ``builtin:tiny-qwen2.5-vl-synthetic`` is its base after a few supervised steps whose
targets are the true answer for ``answer_rate`` of the prompts and a random valid option for the
rest: it learns the format and only a weak link to the image, and RL does the rest (how the
recipe was found: docs/benchmarks.md). ``builtin:tiny-qwen2.5-vl-teacher`` trains on true answers
only, a teacher for on-policy distillation. Prompts come from the project's own data pipeline, so
the warm start sees exactly the tokens RL will see. Deterministic and cached like the other
builtin models.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from easyvlm.builtin.gui_warm_start import GUI_FORMAT_PROMPT, GuiWarmStartSpec
from easyvlm.builtin.sft_steps import start_training, train_step
from easyvlm.builtin.synthetic_gui import DATASETS as GUI_DATASETS

SYNTHETIC_FORMAT_PROMPT = "{{ content }} Answer with one word."
"""The demo's format prompt; format_prompts/synthetic.jinja holds the same text (a test checks)."""
ZOOM_FORMAT_PROMPT = "{{ content }} Zoom in first, then answer with one word."
"""The tools demo's format prompt; format_prompts/zoom.jinja holds the same text."""


@dataclass(frozen=True)
class WarmStartSpec:
    base: str
    dataset: str
    steps: int
    batch_size: int
    lr: float
    answer_rate: float
    """Share of targets that are the true answer; the rest are a random valid option."""
    seed: int = 0
    tools: tuple[str, ...] = ()
    """Multi-turn recipes (the zoom task): the tools the prompts show. Each target is a zoom call,
    the tool's real result, then the answer; the loss is on the model's two turns only."""
    box_rate: float = 1.0
    """Tools: share of zoom calls on the right quadrant (the rest: another quadrant, and then a
    random answer, since the model could not have read it)."""
    max_pixels: int | None = None
    """data.max_pixels of the prompts (the zoom task: 112 * 112, so the stripes blur)."""


_SYNTHETIC = dict(dataset="synthetic", steps=200, batch_size=32, lr=1e-3, answer_rate=0.6)
WARM_STARTS = {
    "tiny-qwen2.5-vl-synthetic": WarmStartSpec(base="tiny-qwen2.5-vl-words", **_SYNTHETIC),
    # The same recipe for the 2026 families (their bases have the answer words as single tokens):
    # the demo config with these model paths (docs/models.md).
    "tiny-qwen3.5-synthetic": WarmStartSpec(base="tiny-qwen3.5", **_SYNTHETIC),
    "tiny-qwen3.5-moe-synthetic": WarmStartSpec(base="tiny-qwen3.5-moe", **_SYNTHETIC),
    "tiny-qwen3-vl-moe-synthetic": WarmStartSpec(base="tiny-qwen3-vl-moe", **_SYNTHETIC),
    "tiny-qwen3-vl-synthetic": WarmStartSpec(base="tiny-qwen3-vl-words", **_SYNTHETIC),  # LoRA served unmerged
    # The demo's distillation teacher: the larger base (tiny-qwen2.5-vl-words-large: same tokenizer and
    # processor as the student) on true answers of the demo's own colour questions. Measured with
    # bench/teacher_accuracy.py on builtin:synthetic-colour@val (256 prompts; sampled: 4 per prompt at
    # temperature 1): greedy 1.000, sampled 0.986 (seed 1: 1.000 / 0.985; the student
    # tiny-qwen2.5-vl-synthetic: 0.207 / 0.196); 150 s to build, base included, on the 2-core CPU.
    # lr 1e-3 (the student's) stalled at chance (loss log(5)/2 per token, greedy 0.37 after 200
    # steps); at 3e-4 the colours separate by step ~80, and 200 steps gave 1.000 / 0.971. On the mixed
    # `synthetic` set (300 steps) colour was as good but shape and count stayed near chance (greedy
    # 0.35 / 0.16) and the build took longer, so the teacher learns the demo's task only.
    "tiny-qwen2.5-vl-teacher": WarmStartSpec(
        base="tiny-qwen2.5-vl-words-large", dataset="synthetic-colour", steps=300, batch_size=32, lr=3e-4,
        answer_rate=1.0,
    ),
    # The tools demo (examples/tools.yaml): half the zoom calls on the named quadrant, half the answers
    # after them true. Measured (64 val prompts): greedy, the box is right 1.0 and the colour after a
    # right zoom 1.0; sampled at temperature 1, p(right box) = 0.39, so RL has room. lr 1e-3 (the
    # colour demo's) learnt neither box nor colour in 150-200 steps; neither did an image-marked
    # quadrant (the tiny model does not find one grey square among 16 image tokens in 200 steps).
    "tiny-qwen2.5-vl-zoom": WarmStartSpec(
        base="tiny-qwen2.5-vl-tools", dataset="synthetic-zoom", steps=400, batch_size=32, lr=3e-4, answer_rate=0.5,
        tools=("image_zoom",), box_rate=0.5, max_pixels=112 * 112,
    ),
    # The GUI demo (examples/gui.yaml): screens, then whole episodes of the first-box expert through the
    # GUI environment (easyvlm.builtin.gui_warm_start), 8 in 10 of its episode actions right (the rest a
    # click on any widget) so that RL has room: with every action right the held-out success is 1.0
    # before RL; with 6 in 10 the episodes were still unlearnt after 200 steps (greedy 0.16). The
    # Qwen3-VL base: the Qwen2.5-VL one never reads which box to click (docs/benchmarks.md, "The GUI
    # demo's warm start").
    "tiny-qwen3-vl-gui": GuiWarmStartSpec(
        base="tiny-qwen3-vl-clicks", dataset="synthetic-gui-row-red", screen_steps=1800, screen_batch_size=32,
        episode_steps=300, batch_size=16, lr=3e-4, right_rate=0.8,
    ),
}


def format_prompt_of(spec: WarmStartSpec | GuiWarmStartSpec) -> str:
    """The format prompt of the recipe's prompts: its RL run's."""
    if spec.dataset in GUI_DATASETS:
        return GUI_FORMAT_PROMPT
    return ZOOM_FORMAT_PROMPT if spec.tools else SYNTHETIC_FORMAT_PROMPT


def warm_start_key(spec: WarmStartSpec | GuiWarmStartSpec, base_key: str) -> str:
    """A short hash of the recipe, of its base model's build (``base_key``: easyvlm.builtin.models.spec_key)
    and of the prompt it trains on, for the cache directory name; a GUI recipe's also of the screens'
    version (it draws screens itself, so a changed screen must rebuild it)."""
    import hashlib

    from easyvlm.builtin.synthetic_gui import BUILD_VERSION as GUI_SCREENS

    prompt = format_prompt_of(spec)
    screens = f"|gui-v{GUI_SCREENS}" if isinstance(spec, GuiWarmStartSpec) else ""
    return hashlib.sha1(f"{spec}|{base_key}|{prompt}{screens}".encode()).hexdigest()[:8]


def build_warm_start(spec: WarmStartSpec | GuiWarmStartSpec, base: Path, out_dir: Path, log=print) -> None:
    """Train ``spec.base`` (built in directory ``base``) on targets of ``spec.dataset``'s train split (one turn, or the tools recipe's
    trajectories); save to ``out_dir``."""
    import json

    import torch
    from transformers import AutoConfig, AutoProcessor

    from easyvlm.data.settings import DataConfig
    from easyvlm.data.collate import concat_multi_modal_inputs
    from easyvlm.data.dataset import PromptEncoder
    from easyvlm.builtin.synthetic import materialize_dataset
    from easyvlm.models.position_ids import extend_position_ids, to_model_layout

    threads = torch._C.get_num_threads()
    # bit-identical builds: reductions in one fixed order. torch._C: an in-process vLLM engine makes
    # torch.set_num_threads a no-op for the rest of the process (vllm/v1/worker/cpu_worker.py)
    torch._C.set_num_threads(1)
    try:
        processor = AutoProcessor.from_pretrained(base)
        tokenizer = processor.tokenizer
        model_config = AutoConfig.from_pretrained(base)
        data_file = materialize_dataset("train", name=spec.dataset)
        out_dir.mkdir(parents=True, exist_ok=True)
        prompt_file = out_dir / "format_prompt.jinja"  # kept with the model: the prompt it was trained on
        prompt_file.write_text(format_prompt_of(spec) + "\n")
        if spec.dataset in GUI_DATASETS:  # whole episodes of the GUI environment (easyvlm.builtin.gui_warm_start)
            from easyvlm.builtin.gui_warm_start import train_gui_warm_start

            model = train_gui_warm_start(spec, base, processor, model_config, data_file, prompt_file, log)
            _save(model, processor, base, out_dir)
            return
        if spec.tools:
            model = _train_tool_warm_start(spec, base, processor, model_config, data_file, prompt_file, log)
            _save(model, processor, base, out_dir)
            return
        rows = [json.loads(line) for line in data_file.read_text().splitlines() if line.strip()]
        cfg = DataConfig(
            format_prompt=str(prompt_file),
            prompt_key="problem",
            min_pixels=None,  # no data limits: the processor's own apply (the synthetic images fit them)
            max_pixels=None,
        )
        encoder = PromptEncoder(cfg, tokenizer, processor, model_config)
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

        model, optimizer, rng = start_training(spec, base)
        for step in range(spec.steps):
            picked = rng.sample(rows, spec.batch_size)
            targets = [row["answer"] if rng.random() < spec.answer_rate else rng.choice(row["options"]) for row in picked]
            batch = _sft_batch(encoder, picked, targets, data_file.parent, eos, tokenizer, extend_position_ids)
            loss = train_step(
                model, optimizer, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=to_model_layout(batch["position_ids"]), labels=batch["labels"],
                **concat_multi_modal_inputs(batch["mm"]),
            )
            if step % 20 == 0 or step == spec.steps - 1:
                log(f"easyvlm: warm start {step + 1}/{spec.steps}: loss {loss:.3f}")
        _save(model, processor, base, out_dir)
    finally:
        torch._C.set_num_threads(threads)


def _save(model, processor, base: str, out_dir: Path) -> None:
    """The trained model (in its family's checkpoint layout, which transformers and vLLM load) with the
    base's processor and generation config."""
    from easyvlm.models.checkpoint_layout import rewrite_in_checkpoint_layout

    model.save_pretrained(out_dir)
    if not (out_dir / "config.json").is_file():  # transformers saves only on rank 0 of a torch.distributed group
        raise RuntimeError(f"warm start into {out_dir}: save_pretrained wrote no model files (a torch.distributed rank "
                           "other than 0); build it in a process without a process group (python -m easyvlm.builtin.models)")
    rewrite_in_checkpoint_layout(model.config, out_dir)
    processor.save_pretrained(out_dir)
    for extra in ("generation_config.json",):
        if (Path(base) / extra).exists():
            (out_dir / extra).write_bytes((Path(base) / extra).read_bytes())


def _sft_batch(encoder, rows, targets, base_dir, eos, tokenizer, extend_position_ids):
    """Right-padded prompt + target + EOS sequences; labels only on target and EOS."""
    import torch

    seqs, positions, labels, mm = [], [], [], []
    for row, target in zip(rows, targets):
        enc = encoder.encode(row, base_dir)
        answer = tokenizer(target, add_special_tokens=False)["input_ids"] + [eos]
        prompt_pos = encoder.position_ids(enc)  # (4, P) or (P,)
        pos = extend_position_ids(prompt_pos.unsqueeze(0), len(answer))[0]
        seqs.append(enc.input_ids + answer)
        positions.append(pos)
        labels.append([-100] * len(enc.input_ids) + answer)
        mm.append(enc.multi_modal_inputs)
    width = max(map(len, seqs))
    pad = encoder.pad_token_id
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    position_ids = torch.stack(
        [torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in positions]
    )
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": label_ids, "position_ids": position_ids, "mm": mm}


def _train_tool_warm_start(spec: WarmStartSpec, base: str, processor, model_config, data_file: Path, prompt_file: Path, log):
    """The zoom task's multi-turn warm start (prompt, zoom call, the tool's real result, answer);
    returns the trained model. The trajectories come from the RL rollout loop (easyvlm.agents.loop)
    with the model's turns given, so it trains on exactly RL's tokens, positions and images."""
    from easyvlm.agents.tools import load_tools
    from easyvlm.builtin.sft_steps import episodes_of, train_on_episodes
    from easyvlm.builtin.synthetic_zoom import quadrant_box, zoom_call

    tools = load_tools(list(spec.tools))
    episodes = episodes_of(spec, processor, model_config, data_file, prompt_file, length=256, max_turns=2, tools=tools)
    model, optimizer, rng = start_training(spec, base)
    for step in range(spec.steps):
        picked, rows = episodes.sample(rng, spec.batch_size)
        turns = []
        for row in rows:
            right = rng.random() < spec.box_rate
            quadrant = row["quadrant"] if right else rng.choice([q for q in range(4) if q != row["quadrant"]])
            answer = row["answer"] if right and rng.random() < spec.answer_rate else rng.choice(row["options"])
            turns.append([zoom_call(quadrant_box(quadrant)), answer])
        out = episodes.play_scripts(picked, turns)
        assert all(t["finish"] == "answer" and t["tool_calls"][0]["ok"] for t in out["trajectory"])
        loss = train_on_episodes(model, optimizer, out)
        if step % 20 == 0 or step == spec.steps - 1:
            log(f"easyvlm: warm start {step + 1}/{spec.steps}: loss {loss:.3f}")
    return model
