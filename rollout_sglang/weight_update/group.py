"""The dedicated trainer -> engines process group of the weight sync (NCCL on GPUs, gloo on CPU).

The group lives outside ``torch.distributed``'s default world: rank 0 is the trainer rank that
broadcasts (one per pipeline stage), ranks ``1..world_size-1`` are the engines' ranks (an SGLang
server with tensor parallelism contributes one rank per GPU, at ``rank_offset + tp_rank``).

The rendezvous follows SGLang's ``init_custom_process_group`` (what the engine side runs for
``/init_weights_update_group``): a ``TCPStore`` at ``master_address:master_port`` hosted by rank 0,
wrapped in ``PrefixStore(group_name)``; torch's group helper then adds ``"<group_name>/"`` and
``"<device>/"`` prefixes. :func:`init_weight_group` builds the backend directly on the same
store prefixes (no entry in torch's global group registry), so several ranks of one group can
live in one process (threads) -- the stand-in server and the benchmark rely on that -- and it
rendezvouses with an engine that used the registered helper.

When the group forms: gloo connects every pair in :func:`init_weight_group` (all ranks must call
it at about the same time), NCCL at the group's first collective. An SGLang engine on NCCL thus
joins only inside its first ``/update_weights_from_distributed``; the trainer's side must not
wait for the group before that request is out (see ``BucketBroadcaster``).

Timeouts: ``timeout_s`` bounds the rendezvous (a missing peer raises) and every collective;
:meth:`WeightGroup.broadcast` additionally waits at most its own ``timeout_s``. After a timeout
the group is unusable: :meth:`WeightGroup.close` it and build a new one.
"""
from __future__ import annotations

import datetime
import logging
import os
import time

import torch
import torch.distributed as dist

from env_controller.http.net import free_port

logger = logging.getLogger(__name__)


# gloo worker threads of a weight-sync group (torch's default is 2). The sync is one ordered stream
# of broadcasts from rank 0 over one TCP connection per peer, so a second worker thread only runs
# two of them at once on that connection: more thread hand-offs and CPU contention, no overlap.
# Measured (bench/weight_sync.py, 2 cores, 3 interleaved runs each): bucketed/raw bandwidth ratio
# 0.71-0.77 with 2 threads, 0.77-0.85 with 1. AGENTRL_GLOO_THREADS overrides it.
GLOO_THREADS = int(os.environ.get("AGENTRL_GLOO_THREADS", "1"))
# point-to-point message tags wrap at this (gloo keys messages by a 32-bit slot). SGLang's API moves
# weights by broadcast only; the point-to-point operations serve transports that number their
# messages themselves (the stand-in's, rollout_sglang.testing.transport).
SEND_RECV_TAGS = 1 << 30
_GRAVEYARD: list[list] = []  # backends of groups that timed out (see WeightGroup.close)


class WeightSyncTimeout(TimeoutError):
    """A weight-sync step (group init, a bucket) did not finish within its timeout."""


def default_backend() -> str:
    """"nccl" when CUDA is available, else "gloo"."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class WeightGroup:
    """One rank's handle on a weight-sync group: broadcast with a timeout, close.

    Built by :func:`init_weight_group`; ``rank``/``world_size`` are group ranks, ``device`` is
    where this rank's buffers must live (``cuda`` for NCCL, ``cpu`` for gloo).
    """

    def __init__(self, backend_pg: object, store: dist.Store, name: str, rank: int, world_size: int,
                 backend: str, timeout_s: float) -> None:
        self._pg = backend_pg
        self._store = store  # keeps rank 0's TCPStore server alive
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.broken = False
        self._timed_out = False

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as the backend should move it (raises when the group is unusable)."""
        if self.broken:
            raise RuntimeError(f"weight-sync group {self.name!r} timed out or failed earlier; "
                               "close it and build a new one")
        if self.backend == "gloo" and tensor.is_contiguous() and tensor.dtype != torch.uint8:
            # gloo moves bytes; a byte view of the same memory skips its slower path for 16-bit
            # floats and meets a typed receive of the same size
            return tensor.reshape(-1).view(torch.uint8)
        return tensor

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> object:
        """Start broadcasting ``tensor`` (in place) from group rank ``src``; returns the work handle."""
        opts = dist.BroadcastOptions()
        opts.rootRank = int(src)
        opts.rootTensor = 0
        return self._pg.broadcast([self._wire(tensor)], opts)  # type: ignore[attr-defined]

    def send_async(self, tensor: torch.Tensor, dst: int, tag: int) -> object:
        """Start a point-to-point send of ``tensor`` to group rank ``dst`` as message ``tag``; returns the work.

        On gloo a send is posted from the calling thread, not queued behind the group's worker
        thread as a collective is: a receiver that posted all its receives up front gets a whole
        bucket as one stream, with no idle round trip between tensors. Tags wrap at
        :data:`SEND_RECV_TAGS`.
        """
        return self._pg.send([self._wire(tensor)], int(dst), int(tag) % SEND_RECV_TAGS)  # type: ignore[attr-defined]

    def recv_async(self, tensor: torch.Tensor, src: int, tag: int) -> object:
        """Start receiving message ``tag`` from group rank ``src`` into ``tensor`` (same bytes as the send)."""
        return self._pg.recv([self._wire(tensor)], int(src), int(tag) % SEND_RECV_TAGS)  # type: ignore[attr-defined]

    def wait(self, work: object, timeout_s: float | None = None, what: str = "broadcast") -> None:
        """Wait for ``work``; WeightSyncTimeout (and the group marked broken) after ``timeout_s`` seconds."""
        t = self.timeout_s if timeout_s is None else float(timeout_s)
        try:
            work.wait(datetime.timedelta(seconds=t))  # type: ignore[attr-defined]
        except RuntimeError as e:
            self.broken = True
            msg = str(e)
            if "timed out" in msg.lower() or "timeout" in msg.lower():
                self._timed_out = True
                raise WeightSyncTimeout(
                    f"{what} on weight-sync group {self.name!r} (rank {self.rank}/{self.world_size}) did not finish "
                    f"within {t:.1f}s; an engine of the slot is stalled or gone (raise weight_sync_bucket_timeout_s "
                    "for very large buckets on slow links)"
                ) from e
            raise

    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> None:
        """Broadcast ``tensor`` in place from group rank ``src`` and wait (see :meth:`wait`)."""
        self.wait(self.broadcast_async(tensor, src), timeout_s)

    def close(self) -> None:
        """Release the backend (best effort); the handle cannot be used afterwards."""
        self.broken = True
        holder = [self._pg, self._store]
        self._pg = self._store = None
        shutdown = getattr(holder[0], "shutdown", None)
        if self.backend == "nccl" and callable(shutdown):
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - best effort
                logger.debug("shutdown of weight-sync group %s failed", self.name, exc_info=True)
        if self._timed_out:
            # a backend with a timed-out operation blocks (holding the GIL) in its destructor until
            # the operation's own timeout: keep it alive instead; the leak is one broken group
            _GRAVEYARD.append(holder)


def host_store(master_address: str, world_size: int, timeout_s: float, port: int | None = None,
               attempts: int = 5) -> tuple[dist.TCPStore, int]:
    """Rank 0's TCPStore on a free port of ``master_address`` (retrying when another process takes
    the port first); returns ``(store, port)``. Create it before telling the engines the port."""
    timeout = datetime.timedelta(seconds=float(timeout_s))
    last: Exception | None = None
    for _ in range(attempts if port is None else 1):
        host = master_address if master_address not in ("0.0.0.0", "") else "127.0.0.1"
        p = int(port) if port is not None else free_port(host)
        try:
            return dist.TCPStore(master_address, p, world_size, is_master=True, timeout=timeout,
                                 wait_for_workers=False), p
        except (RuntimeError, dist.DistError) as e:  # EADDRINUSE: the port was taken meanwhile
            last = e
    raise RuntimeError(f"could not host the weight-sync store on {master_address}: {last}") from last


def init_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str | None = None,
    timeout_s: float = 300.0,
    store: dist.TCPStore | None = None,
) -> WeightGroup:
    """Join (rank 0: host) the weight-sync group; with gloo it returns when all ``world_size`` ranks
    joined, with NCCL at once (the ranks meet at the first collective).

    backend: "gloo" or "nccl" (None: NCCL when CUDA is available). NCCL needs the current CUDA
    device set. store: rank 0's store from :func:`host_store` (None: created here). Raises
    WeightSyncTimeout when the other ranks do not join within ``timeout_s``, ValueError for bad
    arguments (with the fix).
    """
    backend = backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight-sync backend {backend!r} is not supported; use 'nccl' (GPU) or 'gloo' (CPU)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("weight-sync backend 'nccl' needs CUDA, which is not available here; use backend='gloo'")
    if not (0 <= rank < world_size):
        raise ValueError(f"rank {rank} is outside the weight-sync group of world_size {world_size}")
    timeout = datetime.timedelta(seconds=float(timeout_s))
    t0 = time.monotonic()
    try:
        if store is None:
            store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                                  timeout=timeout, wait_for_workers=False)
        # the prefixes of SGLang's init_custom_process_group + torch's _new_process_group_helper
        device = "cuda" if backend == "nccl" else "cpu"
        prefixed = dist.PrefixStore(f"{device}/",
                                    dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._threads = GLOO_THREADS
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            # NCCL creates the communicator at the first collective, as SGLang's engines do: no probe here
            # (an engine joins only when its first update request receives, so a probe would wait forever)
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    except (RuntimeError, dist.DistError) as e:  # DistStoreError / gloo connect timeouts
        if "timeout" in str(e).lower() or "timed out" in str(e).lower():
            raise WeightSyncTimeout(
                f"weight-sync group {group_name!r} at {master_address}:{master_port}: only part of the "
                f"{world_size} ranks joined within {timeout_s:.1f}s (this is rank {rank}); check that every "
                "engine of the slot received /init_weights_update_group and can reach the master address"
            ) from e
        raise
    logger.info("weight-sync group %s: rank %d/%d joined (%s) in %.2fs", group_name, rank, world_size, backend,
                time.monotonic() - t0)
    return WeightGroup(pg, store, group_name, rank, world_size, backend, timeout_s)
