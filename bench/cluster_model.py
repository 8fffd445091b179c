"""A discrete-event model of asynchronous RL on a cluster: seconds per training step of synchronous
generate-then-train (staleness k = 0) against bounded staleness k = 1, 2, 4, with and without
partial rollouts, for a cluster split between inference engines and trainer GPUs.

    python bench/cluster_model.py --gpus 8 16 32 64 --staleness 0 1 2 4 [--partial] [--json out.json] \
        [--admission demand eager]
    python bench/cluster_model.py --from-log checkpoints/easyvlm/demo/experiment_log.jsonl --cpu-check

The model (docs/cluster_model.md has the equations of the simple cases and an example table):
- Engines decode continuous batches. One decode step of an engine running b sequences takes
  t_step(b) = a + c*b seconds (``step_floor_s``, ``step_per_seq_s``), at most ``max_batch``
  sequences at once. Events are per finished sequence: between two events an engine's batch is
  fixed, so all its sequences advance in lockstep (fractional steps at interruptions). Admitting a
  group prefills its prompt once (prefix cache) and pauses that engine's decoding meanwhile.
- Admission (easyvlm's GroupStream): the trainer at version p (p updates done) has at most
  (p + 1 + k) * B prompt groups admitted in all. ``admission="demand"`` (easyvlm's, the default)
  admits a batch of B groups, at version p, only while fewer than B admitted groups are generating
  and fewer than B complete ones wait for the trainer; they queue until an engine on the newest
  weights has room. ``"eager"`` (easyvlm's earlier rule) admits every group the bound allows as
  soon as an engine has room, at the version it starts at. A group goes to the current-weights
  engine with the fewest running sequences.
- Selection (easyvlm's ``GroupStream._choose``): step p + 1 takes every group admitted at version
  <= p - k (waiting for them if unfinished), the rest by completion order, B in all. For k >= 2 that
  alone can leave more than B such groups for a later step (fast new groups are trained ahead of
  slow old ones), so ``lookahead`` also takes old groups early enough (``_Sim.try_train``).
- Trainer: a batch trains in (prompt + response tokens) / (train_tok_s * trainer GPUs) seconds,
  then pushes the weights (``sync_s``, serial); the new version is published at the push's end.
- Engines load a new version in ``load_s``. Without partial rollouts an engine with sequences in
  flight stops admitting, finishes them on the old weights, then loads the newest. With partial
  rollouts it switches at once; with ``recompute_kv`` it re-prefills prompt + tokens so far.
Not modelled: network contention, stragglers and failures, memory limits (KV cache size beyond
``max_batch``), chunked prefill overlapping decode, trainer scaling losses.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from easyvlm.rollout.staleness import StalenessBound

NO_LIMIT = 2**62  # no checkpoint pauses the model's admission

ADMISSIONS = ("demand", "eager")


@dataclass(frozen=True)
class Setup:
    engines: int = 4  # inference engines
    trainer_gpus: int = 4
    staleness: int = 0  # k
    partial: bool = False  # partial rollouts
    prompts: int = 64  # B prompt groups per step
    n: int = 8  # samples per group
    prompt_len: int = 512
    step_floor_s: float = 0.012  # a in t_step(b) = a + c*b
    step_per_seq_s: float = 0.00015  # c
    max_batch: int = 256  # sequences an engine decodes at once
    prefill_s_per_token: float = 2e-5
    recompute_kv: bool = True  # partial: in-flight sequences re-prefill on the new weights
    lookahead: bool = True  # k >= 2: take old groups early enough (the rule alone can exceed k)
    admission: str = "demand"  # "demand": B groups when < B generate and < B wait; "eager": all the bound allows
    train_tok_s: float = 2500.0  # per trainer GPU, every trainer pass together
    sync_s: float = 2.0  # trainer side, after each update
    load_s: float = 0.5  # engine side, per new version
    warmup: int | None = None  # steps left out of the figures; None: 2k + 3
    measure: int = 12  # steps measured after the warm-up
    seed: int = 0


@dataclass
class Result:
    s_per_step: float  # median step time (publish to publish) after the warm-up
    s_per_step_mean: float  # the measured window / its steps (throughput; steps can alternate long/short)
    trainer_idle: float  # share of the window the trainer neither trains nor pushes weights
    engine_idle: float  # share of engine-time not decoding (empty, loading weights, prefilling)
    mean_batch: float  # sequences per engine while decoding (time-weighted)
    staleness_mean: float  # per trained sample: trainer version - version its group started at
    staleness_max: int  # after the warm-up
    staleness_max_all: int  # every step, warm-up included
    partial_frac: float  # share of trained samples whose tokens span more than one version
    overflows: int  # steps whose must-take groups exceeded B (only with lookahead off)
    step_times: list[float] = field(repr=False)


@dataclass
class _Engine:
    version: int = 0
    steps: float = 0.0  # decode steps done (fractional between events)
    t: float = 0.0  # the time `steps` refers to
    busy_until: float = 0.0  # prefill or weight load: no decoding before this
    draining: bool = False  # newer weights wait for the running sequences (no partial rollouts)
    running: list = field(default_factory=list)  # heap of (finish step, sequence id)
    decode_time: float = 0.0
    slot_time: float = 0.0


def long_tail_lengths(length: int, tail_share: float = 0.05, tail_factor: float = 8.0,
                      spread: float = 0.5, size: int = 200) -> np.ndarray:
    """A pool to sample response lengths from: most spread evenly over length * (1 -+ spread),
    ``tail_share`` of them at tail_factor * length."""
    tail = round(size * tail_share)
    body = np.linspace(length * (1 - spread), length * (1 + spread), size - tail)
    return np.maximum(1, np.round(np.concatenate([body, np.full(tail, tail_factor * length)]))).astype(int)


class _Sim:
    def __init__(self, s: Setup, lengths):
        if s.max_batch < s.n:
            raise ValueError("max_batch must hold a group of n samples")
        if s.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, not {s.admission!r}")
        self.s, self.pool = s, np.asarray(lengths, dtype=int)
        self.rng = np.random.default_rng(s.seed)
        self.warmup = 2 * s.staleness + 3 if s.warmup is None else s.warmup
        self.engines = [_Engine() for _ in range(s.engines)]
        self.next_finish = np.full(s.engines, np.inf)
        self.version = self.admitted = 0
        self.g_version, self.g_left, self.g_tokens, self.g_seqs, self.g_lengths = [], [], [], [], []
        self.queued: deque[int] = deque()  # admitted on demand, not yet on an engine
        self.seq_group, self.seq_start, self.seq_spans = [], [], []
        self.in_flight: dict[int, int] = {}  # admission version -> admitted groups not yet complete
        self.done: list[int] = []  # complete, untrained groups in completion order
        self.train_end: float | None = None
        self.step_ends: list[float] = []
        self.trained: list[tuple[float, list[int], int]] = []  # (busy seconds, groups, trainer version)
        self.snapshot = (0.0, 0.0)
        self.overflows = 0  # steps where the rule alone had more than B groups to take
        self.bound = StalenessBound(s.staleness, s.prompts)  # easyvlm's admission and selection rules

    def step_time(self, b: int) -> float:
        return self.s.step_floor_s + self.s.step_per_seq_s * b

    def advance(self, e: _Engine, t: float) -> None:
        start = max(e.t, e.busy_until)
        if e.running and t > start:
            e.steps += (t - start) / self.step_time(len(e.running))
            e.decode_time += t - start
            e.slot_time += (t - start) * len(e.running)
        e.t = max(e.t, t)

    def reschedule(self, i: int) -> None:
        e = self.engines[i]
        self.next_finish[i] = np.inf if not e.running else (
            max(e.t, e.busy_until) + max(0.0, e.running[0][0] - e.steps) * self.step_time(len(e.running)))

    def load(self, e: _Engine, t: float, extra: float = 0.0) -> None:
        e.version, e.draining = self.version, False
        e.busy_until = max(e.busy_until, t) + self.s.load_s + extra

    def new_group(self) -> int:
        """A group admitted at the current version: its n response lengths drawn."""
        s, g = self.s, len(self.g_version)
        lengths = self.rng.choice(self.pool, s.n)
        self.g_version.append(self.version)
        self.g_left.append(s.n)
        self.g_tokens.append(int(lengths.sum()) + s.n * s.prompt_len)
        self.g_lengths.append(lengths)
        self.g_seqs.append([])
        self.in_flight[self.version] = self.in_flight.get(self.version, 0) + 1
        self.admitted += 1
        return g

    def admit(self, t: float) -> None:
        """Admit groups (``Setup.admission``) and start them on engines with room."""
        s, touched = self.s, set()
        cap = self.bound.admission_cap(self.version, NO_LIMIT)
        demand = s.admission == "demand"
        # easyvlm's rule itself (GroupStream._may_admit): a batch when the engines (< B generating)
        # and the trainer (< B complete, untrained) are both short of groups, within the bound
        while demand and self.bound.may_admit(self.version, NO_LIMIT, self.admitted, sum(self.in_flight.values()),
                                              len(self.done)):
            self.queued.extend(self.new_group() for _ in range(s.prompts))
        while self.queued if demand else self.admitted < cap:
            free = [i for i, e in enumerate(self.engines)
                    if e.version == self.version and not e.draining and len(e.running) + s.n <= s.max_batch]
            if not free:
                break
            i = min(free, key=lambda j: len(self.engines[j].running))
            e = self.engines[i]
            self.advance(e, t)
            g = self.queued.popleft() if demand else self.new_group()
            self.g_seqs[g] = list(range(len(self.seq_group), len(self.seq_group) + s.n))
            for length in self.g_lengths[g]:
                heapq.heappush(e.running, (e.steps + int(length), len(self.seq_group)))
                self.seq_group.append(g)
                self.seq_start.append(e.steps)
                self.seq_spans.append(False)
            e.busy_until = max(e.busy_until, t) + s.prefill_s_per_token * s.prompt_len
            touched.add(i)
        for i in touched:
            self.reschedule(i)

    def finish(self, i: int, t: float) -> None:
        e = self.engines[i]
        self.advance(e, t)
        e.steps = max(e.steps, e.running[0][0])  # no rounding drift
        while e.running and e.running[0][0] <= e.steps + 1e-9:
            g = self.seq_group[heapq.heappop(e.running)[1]]
            self.g_left[g] -= 1
            if self.g_left[g] == 0:
                self.in_flight[self.g_version[g]] -= 1
                self.done.append(g)
        if not e.running and e.draining:
            self.load(e, t)
        self.reschedule(i)
        self.admit(t)
        self.try_train(t)

    def try_train(self, t: float) -> None:
        """Step p + 1's batch, or wait: easyvlm's rule itself (``StalenessBound.choose``, which
        GroupStream._choose calls), with ``lookahead``. Without it, the earlier rule, modelled here:
        level m = 0 only (every group admitted at version <= p - k), then the first completed up to
        B; where more groups must go than fit, the oldest B train and the step counts an overflow."""
        s, p, B, k = self.s, self.version, self.s.prompts, self.s.staleness
        if self.train_end is not None or len(self.done) < B:
            return
        untrained = dict(self.in_flight)
        for g in self.done:
            untrained[self.g_version[g]] = untrained.get(self.g_version[g], 0) + 1
        if s.lookahead:
            batch = self.bound.choose(p, untrained, [(g, self.g_version[g]) for g in self.done])
            if batch is None:
                return  # a group that cannot wait longer is still generating
        else:
            due = sum(c for v, c in untrained.items() if v <= p - k)
            pool = [g for g in self.done if self.g_version[g] <= p - k]
            if due > len(pool):
                return
            if due > B:  # more groups must go than fit: the oldest B; the rest goes stale
                pool.sort(key=lambda g: self.g_version[g])
                self.overflows += 1
            batch = pool[: min(due, B)]
            batch += [g for g in self.done if g not in batch][: B - len(batch)]
        taken = set(batch)
        self.done = [g for g in self.done if g not in taken]
        busy = sum(self.g_tokens[g] for g in batch) / (s.train_tok_s * s.trainer_gpus) + s.sync_s
        self.trained.append((busy, batch, p))
        self.train_end = t + busy
        self.admit(t)  # on demand: fewer groups wait now

    def publish(self, t: float) -> None:
        self.train_end, self.version = None, self.version + 1
        self.step_ends.append(t)
        for i, e in enumerate(self.engines):
            self.advance(e, t)
            if not e.running:
                self.load(e, t)
            elif self.s.partial:
                recompute = 0.0
                for _, q in e.running:
                    done = e.steps - self.seq_start[q]
                    self.seq_spans[q] |= done > 0
                    recompute += done
                groups = {self.seq_group[q] for _, q in e.running}
                recompute += len(groups) * self.s.prompt_len
                self.load(e, t, self.s.prefill_s_per_token * recompute if self.s.recompute_kv else 0.0)
            else:
                e.draining = True
            self.reschedule(i)
        if len(self.step_ends) == self.warmup:
            self.snapshot = (sum(e.decode_time for e in self.engines), sum(e.slot_time for e in self.engines))
        self.admit(t)
        self.try_train(t)

    def run(self) -> Result:
        s = self.s
        self.admit(0.0)
        while len(self.step_ends) < self.warmup + s.measure:
            i = int(np.argmin(self.next_finish))
            t_engine, t_train = self.next_finish[i], self.train_end if self.train_end is not None else np.inf
            if t_engine == np.inf and t_train == np.inf:
                raise RuntimeError("deadlock: nothing left to happen")
            if t_train <= t_engine:
                self.publish(t_train)
            else:
                self.finish(i, t_engine)
        end, start = self.step_ends[-1], self.step_ends[self.warmup - 1] if self.warmup else 0.0
        for e in self.engines:
            self.advance(e, end)
        window = end - start
        decode = sum(e.decode_time for e in self.engines) - self.snapshot[0]
        slots = sum(e.slot_time for e in self.engines) - self.snapshot[1]
        stale_all = [p - self.g_version[g] for _, batch, p in self.trained for g in batch]
        measured = self.trained[self.warmup: self.warmup + s.measure]
        stale = [p - self.g_version[g] for _, batch, p in measured for g in batch]
        spans = [self.seq_spans[q] for _, batch, _ in measured for g in batch for q in self.g_seqs[g]]
        step_times = np.diff([0.0, *self.step_ends]).tolist()
        return Result(
            s_per_step=float(statistics.median(step_times[self.warmup:])), s_per_step_mean=float(window / s.measure),
            trainer_idle=float(max(0.0, 1 - sum(busy for busy, _, _ in measured) / window)),
            engine_idle=float(max(0.0, 1 - decode / (s.engines * window))),
            mean_batch=float(slots / max(decode, 1e-12)),
            staleness_mean=float(np.mean(stale)), staleness_max=max(stale), staleness_max_all=max(stale_all),
            partial_frac=float(np.mean(spans)), overflows=self.overflows,
            step_times=step_times)


def simulate(setup: Setup, lengths) -> Result:
    """Simulate ``setup`` with response lengths drawn (with replacement) from the pool ``lengths``."""
    return _Sim(setup, lengths).run()


def split(gpus: int, engine_share: float, engine_gpus: int = 1) -> tuple[int, int]:
    """(engines, trainer GPUs) for ``engine_share`` of ``gpus`` on engines of ``engine_gpus`` each."""
    engines = min(max(1, round(gpus * engine_share / engine_gpus)), (gpus - 1) // engine_gpus)
    return engines, gpus - engines * engine_gpus


def _nonneg_fit(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares y ~ features @ x with x >= 0 (two features: the pair, else the better single one)."""
    x = np.linalg.lstsq(features, y, rcond=None)[0]
    if (x >= 0).all():
        return x
    best = None
    for j in range(features.shape[1]):
        xj = np.zeros(features.shape[1])
        xj[j] = max(0.0, features[:, j] @ y / (features[:, j] @ features[:, j]))
        if best is None or np.sum((features @ xj - y) ** 2) < np.sum((features @ best - y) ** 2):
            best = xj
    return best


def calibrate(log_path: str | Path, n: int | None = None) -> tuple[dict, np.ndarray, dict]:
    """Setup overrides, a response-length pool and the log's own median seconds (step, gen, train,
    other) from an easyvlm run's experiment_log.jsonl (and its experiment_config.json and
    rollouts/step_*.jsonl when present). See docs/cluster_model.md."""
    log_path = Path(log_path)
    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing_s/gen" in r and "response_length/mean" in r]
    if not rows:
        raise SystemExit(f"{log_path}: no training rows with timing_s/gen and response_length/mean")
    rows = rows[1:] if len(rows) > 2 else rows  # the first step warms the engine up
    config_path = log_path.parent / "experiment_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    rollout, trainer = config.get("worker", {}).get("rollout", {}), config.get("trainer", {})
    n = n or rollout.get("n") or 8
    devices = (trainer.get("n_gpus_per_node") or 1) * (trainer.get("nnodes") or 1)
    engines = rollout.get("num_devices", 1) if rollout.get("placement") == "separate" else devices
    col = lambda key: np.array([r.get(key, 0.0) for r in rows], dtype=float)  # noqa: E731
    samples = col("perf/total_num_tokens") / (col("prompt_length/mean") + col("response_length/mean"))
    # gen = a * (decode steps = longest response) + c * (response tokens per engine); prefill folded in
    a, c = _nonneg_fit(np.column_stack([col("response_length/max"), col("response_length/mean") * samples / engines]),
                       col("timing_s/gen"))
    train = col("timing_s/update_actor") + col("timing_s/old") + col("timing_s/ref")
    other = col("timing_s/step") - col("timing_s/gen") - train  # weight sync, reward, advantages, driver
    records = sorted(log_path.parent.glob("rollouts/step_*.jsonl"))
    lengths = [json.loads(line)["response_length"] for f in records for line in f.read_text().splitlines() if line.strip()]
    if not lengths:  # per step: one sample at the max, one at the min, the rest at the mean's remainder
        for r, k in zip(rows, samples.round().astype(int)):
            lo, hi, mean = r["response_length/min"], r["response_length/max"], r["response_length/mean"]
            lengths += [hi, lo] + [round((mean * k - hi - lo) / max(1, k - 2))] * max(0, k - 2)
    overrides = dict(
        n=int(n), prompts=int(config.get("data", {}).get("rollout_batch_size") or round(float(np.median(samples)) / n)),
        prompt_len=int(round(float(np.median(col("prompt_length/mean"))))),
        step_floor_s=float(a), step_per_seq_s=float(c), prefill_s_per_token=0.0,
        max_batch=int(rollout.get("max_num_seqs") or 256),
        train_tok_s=float(np.median(col("perf/total_num_tokens") / (train * devices))),
        sync_s=float(max(0.0, np.median(other))), load_s=0.0)
    medians = {key: float(np.median(v)) for key, v in
               (("step", col("timing_s/step")), ("gen", col("timing_s/gen")), ("train", train), ("other", other))}
    return overrides, np.maximum(1, np.asarray(lengths, dtype=int)), medians


def _row(gpus: int, engines: int, trainers: int, k: int, partial: bool, r: Result,
         admission: str = "demand") -> dict:
    return dict(gpus=gpus, engines=engines, trainer_gpus=trainers, staleness=k, partial=partial, admission=admission,
                **{key: v for key, v in asdict(r).items() if key != "step_times"})


def table(rows: list[dict]) -> str:
    lines = ["| GPUs | engines + trainer GPUs | k | partial | admission | s/step median (mean) | trainer idle | "
             "engine idle | mean batch | staleness mean / max | partial samples |", "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['engines']} + {r['trainer_gpus']} | {r['staleness']} | "
                     f"{'yes' if r['partial'] else 'no'} | {r.get('admission', 'demand')} | "
                     f"{r['s_per_step']:.3g} ({r['s_per_step_mean']:.3g}) | "
                     f"{r['trainer_idle']:.0%} | {r['engine_idle']:.0%} | {r['mean_batch']:.0f} | "
                     f"{r['staleness_mean']:.2f} / {r['staleness_max']} | {r['partial_frac']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    ap.add_argument("--partial", action="store_true", help="add rows with partial rollouts (k >= 1)")
    ap.add_argument("--admission", nargs="+", choices=ADMISSIONS, default=["demand"],
                    help="admission rules to try, rows for each (k >= 1; at k = 0 both are the same)")
    ap.add_argument("--engine-share", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                    help="shares of the GPUs on engines to try; each row shows the fastest (mean s/step)")
    ap.add_argument("--engine-gpus", type=int, default=1, help="GPUs per engine (tensor parallel)")
    ap.add_argument("--length", type=int, default=1024, help="long-tail lengths: most around L ...")
    ap.add_argument("--tail-share", type=float, default=0.05, help="... this share at --tail-factor x L")
    ap.add_argument("--tail-factor", type=float, default=8.0)
    ap.add_argument("--from-log", help="calibrate speeds and lengths from an easyvlm experiment_log.jsonl")
    ap.add_argument("--cpu-check", action="store_true",
                    help="1 engine (1 core) + 1 trainer (1 core) instead of --gpus; with --from-log or given speeds")
    ap.add_argument("--json", help="write the rows here")
    for f in Setup.__dataclass_fields__.values():
        if f.name not in ("engines", "trainer_gpus", "staleness", "partial") and f.type in ("int", "float", "bool"):
            kind = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes")}[f.type]
            ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None, help=f"default {f.default}")
    args = ap.parse_args(argv)
    base, lengths = {}, long_tail_lengths(args.length, args.tail_share, args.tail_factor)
    if args.from_log:
        base, lengths, medians = calibrate(args.from_log, args.n)
        print(f"calibrated from {args.from_log}: " + ", ".join(f"{k}={v:.3g}" for k, v in base.items())
              + f"; {len(lengths)} lengths, mean {lengths.mean():.1f}, max {lengths.max()}; the log's medians (s): "
              + ", ".join(f"{k} {v:.3g}" for k, v in medians.items()) + "\n")
    base.update({k: v for k, v in vars(args).items()
                 if k in Setup.__dataclass_fields__ and k not in ("staleness", "partial") and v is not None})
    configs = [(k, False, a) for a in args.admission for k in args.staleness if k > 0 or a == args.admission[0]]
    configs += [(k, True, a) for a in args.admission for k in args.staleness if k > 0 and args.partial]
    splits = {2: [(1, 1)]} if args.cpu_check else {
        g: sorted({split(g, share, args.engine_gpus) for share in args.engine_share}) for g in args.gpus}
    rows = []
    for gpus, options in splits.items():
        for k, partial, admission in configs:
            runs = [(simulate(Setup(**{**base, "engines": e, "trainer_gpus": tr, "staleness": k, "partial": partial,
                                       "admission": admission}), lengths), e, tr) for e, tr in options]
            r, e, tr = min(runs, key=lambda x: x[0].s_per_step_mean)
            rows.append(_row(gpus, e, tr, k, partial, r, admission))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": base, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
