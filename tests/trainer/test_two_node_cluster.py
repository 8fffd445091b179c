"""easyvlm on a Ray cluster of two nodes, started the way two machines start one.

A head node (``ray start --head``) and a worker node (``ray start --address=...``), each a
``ray start --block`` process with its own CPUs, working directory, ``HOME``, ``EASYVLM_CACHE`` and
Ray temp dir, and both in a mount namespace of their own in which the driver's working directory
and the driver's easyvlm cache are empty (a tmpfs over each): every Ray process is as far from the
driver's files as on another machine. They share this machine's disk otherwise, so the checkpoint
directory (an absolute path, as on a cluster's shared storage) is the same for all.

The driver is ``python -m easyvlm.trainer.main`` in a working directory of its own with a relative
reward file and a relative policy-loss file, joining through ``trainer.ray_address``. It trains 2
steps with the actor's 2 ranks (``trainer.nnodes=2``, one per node), saves a checkpoint, and a second
launch resumes from it for steps 3 and 4. What it proves:

- the ranks run on the two nodes (the driver's placement line against each raylet's node id);
- nothing a node runs reads the driver's files or caches: the builtin model is built into each
  node's own cache; the reward file and the loss file run from the text shipped in the run plan and
  report that their own path does not exist where they run (``driver_file_visible`` = 0);
- the resumed launch loads the checkpoint (it says so, continues at step 3 with the data loader's
  next prompts, and its policy differs from the reference model from its first step on, where the
  first launch's step 1 had a KL of exactly 0).

Every process started here is killed at the end (by process group and session), pass or fail.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from test_e2e import session_processes  # the run's processes, for the clean-up check

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
NODE_START_TIMEOUT_S = 120
RUN_TIMEOUT_S = 420

# the reward, in the driver's working directory only: the hash-parity score of the e2e tests (a
# learning signal for the tiny model) and whether this file exists where the reward runs
REWARD_FILE = '''
import os
import zlib

REWARD_TYPE = "batch"


def compute_score(reward_inputs):
    visible = float(os.path.exists(__file__))
    scores = []
    for item in reward_inputs:
        accuracy = float(zlib.crc32(item["response"].encode("utf-8", "replace")) % 2)
        scores.append({"overall": accuracy, "accuracy": accuracy, "driver_file_visible": visible})
    return scores
'''

# worker.actor.loss_type as a file: the built-in PPO loss, plus where it ran
LOSS_FILE = '''
import os

from easyvlm.algorithms.policy_losses import get_policy_loss


def ppo(inputs):
    loss, metrics = get_policy_loss("default")(inputs)
    return loss, {**metrics, "driver_file_visible": float(os.path.exists(__file__))}
'''


# ------------------------------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of ``proc``'s session (it was started with start_new_session)."""
    for _ in range(20):
        pids = session_processes(proc.pid)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.25)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    assert not session_processes(proc.pid), f"processes of session {proc.pid} survived SIGKILL"


def namespace_prefix(probe_dir: Path) -> list[str] | None:
    """The command prefix that runs a process in a mount namespace of its own (root: a private one;
    otherwise a user namespace mapped to root), or None when this machine allows neither."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "--mount", "--propagation", "private"],
                   ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]):
        probe = subprocess.run([*prefix, "mount", "-t", "tmpfs", "easyvlm-probe", str(probe_dir)],
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            return prefix
    return None


class Node:
    """One ``ray start --block`` process: its own CPUs, working directory, HOME, easyvlm cache and Ray
    temp dir; ``hide``: directories it sees empty (a tmpfs over each, in its own mount namespace)."""

    def __init__(self, root: Path, ray_temp: Path, role: str, ray_args: list[str], env: dict[str, str],
                 hide: list[Path], prefix: list[str] | None):
        self.role, self.dir = role, root / role
        for sub in ("cwd", "home", "cache"):
            (self.dir / sub).mkdir(parents=True)
        self.cache = self.dir / "cache"
        env = {**env, "HOME": str(self.dir / "home"), "EASYVLM_CACHE": str(self.cache)}
        command = [RAY, "start", "--block", "--disable-usage-stats", f"--temp-dir={ray_temp / role}",
                   "--min-worker-port=0", "--max-worker-port=0", f"--dashboard-agent-listen-port={free_port()}",
                   "--object-store-memory=200000000", *ray_args]
        if prefix is not None and hide:
            mounts = " && ".join(f"mount -t tmpfs easyvlm-hidden {shlex.quote(str(d))}" for d in hide)
            command = [*prefix, "sh", "-c", f'{mounts} && exec "$@"', "sh", *command]
        self.log = self.dir / "ray_start.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command, cwd=self.dir / "cwd", env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_started(self, deadline: float) -> None:
        while "Ray runtime started" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {self.role} node did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def node_id(self) -> str:
        """Ray's id of this node, from its raylet's command line."""
        for pid in session_processes(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"/raylet"):
                return next(a.decode().split("=", 1)[1] for a in argv if a.startswith(b"--node_id="))
        raise AssertionError(f"no raylet in the {self.role} node's session")

    def stop(self) -> None:
        kill_session(self.proc)


# ------------------------------------------------------------------------------------------------
# the run


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def placement(stderr: str) -> tuple[dict[int, str], str]:
    """(hybrid rank -> node id prefix, the reward actor's node id prefix) from the driver's line."""
    line = next(line for line in stderr.splitlines() if line.startswith("easyvlm: placement: "))
    ranks = {int(r): node for r, node in re.findall(r"hybrid rank (\d+) -> node ([0-9a-f]+)", line)}
    reward = re.search(r"reward actor -> node ([0-9a-f]+)", line)
    assert ranks and reward, line
    return ranks, reward.group(1)


@pytest.fixture
def cluster(tmp_path, easyvlm_cache_dir):
    """The two nodes; yields (address, token, nodes, isolated: whether the nodes cannot see the
    driver's files). Stops both, pass or fail."""
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("the two-node cluster needs 2 cores: each node holds one rank of os.cpu_count() CPUs")
    driver_dir = tmp_path / "driver"
    driver_dir.mkdir()
    token = secrets.token_hex(32)  # Ray 2.60's `ray start` wants one token on every node and driver
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("EASYVLM_CACHE", "HF_HOME", "PYTHONPATH", "HOME")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    # main.py gives each CPU rank os.cpu_count() // trainer.n_gpus_per_node (1) CPUs: a node of
    # cores + 1 CPUs holds one rank and the reward actor's 1 CPU, never two ranks
    port = free_port()
    nodes: list[Node] = []
    ray_temp = Path(tempfile.mkdtemp(prefix="ev2n-", dir="/tmp"))  # Ray's socket paths must stay under 108 bytes
    try:
        # the driver's working directory and easyvlm cache, unless the cache holds what the nodes need
        hidden = [driver_dir, *[d for d in [Path(easyvlm_cache_dir).resolve()] if not any(
            p == d or d in p.parents for p in (tmp_path.resolve(), ray_temp, Path(sys.prefix).resolve(), REPO_ROOT))]]
        (tmp_path / "probe").mkdir()
        prefix = namespace_prefix(tmp_path / "probe")
        if prefix is None:
            warnings.warn("no mount namespace on this machine (unshare): the nodes see the driver's files; the run "
                          "still proves placement and resume, not that nothing reads the driver's files")
        head_args = ["--head", f"--port={port}", f"--num-cpus={cores + 1}", "--include-dashboard=false",
                     f"--ray-client-server-port={free_port()}"]
        nodes.append(Node(tmp_path, ray_temp, "head", head_args, env, hidden, prefix))
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        nodes[0].wait_started(deadline)
        nodes.append(Node(tmp_path, ray_temp, "worker", [f"--address=127.0.0.1:{port}", f"--num-cpus={cores + 1}"],
                          env, hidden, prefix))
        nodes[1].wait_started(deadline)
        yield f"127.0.0.1:{port}", token, nodes, prefix is not None and len(hidden) == 2
    finally:
        for node in reversed(nodes):
            node.stop()
        shutil.rmtree(ray_temp, ignore_errors=True)


def run_driver(driver_dir: Path, args: list[str], token: str, e2e_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(e2e_env)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "easyvlm.trainer.main", *args], cwd=driver_dir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the run took over {RUN_TIMEOUT_S} s:\n{stderr[-5000:]}")
    finally:
        if proc.poll() is None:
            kill_session(proc)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{stderr[-8000:]}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def assert_finite(row: dict, keys) -> None:
    for key in keys:
        value = row.get(key)
        assert isinstance(value, float) and math.isfinite(value), f"step {row['step']}: {key} = {value!r}"


@pytest.mark.slow
def test_train_save_and_resume_on_two_nodes(cluster, e2e_base_args, e2e_env, tmp_path):
    address, token, nodes, isolated = cluster
    head, worker = nodes
    driver_dir = tmp_path / "driver"
    (driver_dir / "my_reward.py").write_text(REWARD_FILE)
    (driver_dir / "my_loss.py").write_text(LOSS_FILE)
    ckpt = tmp_path / "shared" / "checkpoints"  # absolute: every node and the driver see this path
    args = [
        *e2e_base_args,
        "worker.reward.reward_function=my_reward.py:compute_score",  # relative to the driver's cwd
        "worker.actor.loss_type=my_loss.py:ppo",
        "worker.rollout.name=hf",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        f"trainer.ray_address={address}",
        "trainer.save_freq=2",
        f"trainer.save_checkpoint_path={ckpt}",
    ]
    node_ids = {head.node_id()[:12]: "head", worker.node_id()[:12]: "worker"}

    # ---- launch 1: steps 1-2 on both nodes, checkpoint at step 2
    start = time.monotonic()
    first = run_driver(driver_dir, [*args, "trainer.max_steps=2"], token, e2e_env)
    first_s = time.monotonic() - start
    ranks, reward_node = placement(first.stderr)
    assert set(ranks) == {0, 1} and set(ranks.values()) == set(node_ids), (ranks, node_ids)  # one rank per node
    assert reward_node in node_ids
    for node in nodes if isolated else ():  # each node built the builtin model into its own cache
        assert list((node.cache / "models").glob("tiny-qwen2.5-vl-v*")), f"the {node.role} node built no model"
    rows = read_jsonl(ckpt / "experiment_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert_finite(row, ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "reward/overall",
                            "reward/driver_file_visible", "actor/driver_file_visible"])
        assert row["actor/skipped_steps"] == 0.0
        if isolated:  # the reward and the loss ran from shipped text where their files do not exist
            assert row["reward/driver_file_visible"] == 0.0 and row["actor/driver_file_visible"] == 0.0
    assert rows[0]["actor/kl_loss"] == 0.0  # step 1: the policy is the reference model
    step2 = ckpt / "global_step_2"
    assert json.loads((step2 / "COMPLETE").read_text())["step"] == 2
    manifest = json.loads((step2 / "MANIFEST.json").read_text())["files"]
    for rank in (0, 1):  # both ranks (one per node) wrote their shards into the shared directory
        assert f"actor/extra_state_rank{rank}.pt" in manifest
        assert any(re.fullmatch(rf"actor/model_optim/__{rank}_\d+\.distcp", name) for name in manifest), sorted(manifest)

    # ---- launch 2: resumes from step 2 on the same two nodes, steps 3-4
    start = time.monotonic()
    second = run_driver(driver_dir, [*args, "trainer.max_steps=4"], token, e2e_env)
    second_s = time.monotonic() - start
    assert f"resuming from {step2}" in second.stderr
    ranks, _ = placement(second.stderr)
    assert set(ranks.values()) == set(node_ids), (ranks, node_ids)
    rows = read_jsonl(ckpt / "experiment_log.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows[2:]:
        assert_finite(row, ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "reward/overall"])
        assert row["actor/skipped_steps"] == 0.0
    # the checkpoint's weights: step 3 starts from the trained policy, not from the reference model
    assert rows[2]["actor/kl_loss"] > 0.0, rows[2]["actor/kl_loss"]
    order = read_jsonl(ckpt / "data_order.jsonl")
    assert [entry["step"] for entry in order] == [1, 2, 3, 4]
    first_uids = set(order[0]["uids"]) | set(order[1]["uids"])
    assert not first_uids & (set(order[2]["uids"]) | set(order[3]["uids"]))  # the data loader's position too
    assert json.loads((ckpt / "global_step_4" / "COMPLETE").read_text())["step"] == 4
    print(f"two nodes: launch 1 {first_s:.0f} s, launch 2 {second_s:.0f} s; step-3 kl_loss {rows[2]['actor/kl_loss']:.3g}")
