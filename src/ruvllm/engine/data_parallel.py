"""Data-parallel replicas on one machine: N engine-core processes, each with its own model copy and
KV pool, behind one front (docs/scaling.md).

`DataParallelCoreClient` is a CoreClient like the others, so the AsyncEngine front (tokenizer,
detokenizer, stop strings, n > 1) and the server above it are the same code with one replica or
many. It routes each request (all n sequences of it together) to one replica (engine/router.py),
sends aborts where the sequence went, and sums the replicas' stats; `replica_states` gives them one
by one (the `replica` label of /metrics).

A replica that dies (killed, out of memory, a failed step) fails only its own open requests
(ReplicaLostError, through the front's `on_lost`), is taken out of routing at once, and is started
again in the background: the same config, then the adapters loaded at run time. The front keeps that
list (`_adapters`: a load enters it once every running replica has loaded it, an unload leaves it), so
it outlives any replica, and every replica at once.
The engine as a whole fails only when no replica is left and restarting has given up (more than
`max_restarts` failures of one replica within `restart_window_s`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace

import msgspec

from ruvllm.config import Checked, EngineConfig, setting
from ruvllm.engine.core_client import OnFailure, OnLost, OnOutputs, ProcessCoreClient, ReplicaState
from ruvllm.engine import core_launcher
from ruvllm.engine.router import Router, RouterConfig
from ruvllm.errors import EngineDeadError, ReplicaLostError, RuvllmError
from ruvllm.messages import (CallResult, CoreCall, CoreOutput, CoreRequest, EngineInfo, EngineStats, LoadAdapter,
                             UnloadAdapter, sum_stats)

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DataParallelConfig(Checked):
    size: int = setting(1, "Engine-core processes, each with its own model copy and KV cache, behind this one "
                           "server (docs/scaling.md).", flag="--data-parallel-size", aliases=("--dp",), minimum=1,
                        metavar="N")
    threads_per_replica: int | None = setting(None, "With --data-parallel-size: CPU threads of each replica (default: "
                                                    "the cores split evenly; --threads is ignored).", minimum=1,
                                              metavar="T")
    # Pin replica i to its own cores (i*T .. i*T+T-1 of the usable ones) when they are enough for
    # all; otherwise the OS schedules them freely.
    pin_cores: bool = setting(True, "Pin each replica to cores of its own.", cli=False)
    routing: RouterConfig = RouterConfig()
    max_restarts: int = setting(5, "Failures of one replica within restart_window_s before it is given up.",
                                minimum=0, cli=False)
    restart_window_s: float = setting(300.0, "Seconds max_restarts counts over.", minimum=0, cli=False)

    def threads(self) -> int:
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        return max(1, len(_usable_cpus()) // self.size)

    def replica_cpus(self, index: int) -> set[int] | None:
        cpus = sorted(_usable_cpus())
        t = self.threads()
        if not self.pin_cores or t * self.size > len(cpus):
            return None
        return set(cpus[index * t:(index + 1) * t])


def _usable_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))


class _Replica:
    def __init__(self, index: int, config: EngineConfig, cpus: set[int] | None) -> None:
        self.index, self.config, self.cpus = index, config, cpus
        self.client: ProcessCoreClient | None = None
        self.launching: ProcessCoreClient | None = None  # a restart still loading
        self.status = "starting"
        self.sequences: set[str] = set()  # sent here and not yet finished or aborted
        self.stats = EngineStats()
        self.failures: list[float] = []  # monotonic times
        self.restarts = 0
        self.last_error: str | None = None


class DataParallelCoreClient:
    """N ProcessCoreClients behind one router (see the module's docstring)."""

    def __init__(self, config: EngineConfig, dp: DataParallelConfig) -> None:
        """Starts every replica's process at once (their loads overlap); `wait_ready` waits for all."""
        self.dp = dp
        threads = dp.threads()
        self._replicas = [_Replica(i, replace(config, num_threads=threads), dp.replica_cpus(i))
                          for i in range(dp.size)]
        self._lock = threading.Lock()
        self._where: dict[str, int] = {}  # sequence id -> replica
        self._stopping = threading.Event()
        self._on_outputs: OnOutputs | None = None
        self._pending: list[ProcessCoreClient] = []
        # The adapters loaded at run time, name -> path, in load order: what a restarted replica
        # loads. Kept here rather than asked of a running replica, so a restart after every replica
        # died still has it. `_adapters_lock` is held through a load or unload on every replica and
        # while a restarted replica is marked up, so none misses a load made while it restarted.
        self._adapters: dict[str, str] = {}
        self._adapters_lock = threading.Lock()
        # The replicas and their restarts fork from one launcher (core_launcher.py): each replica
        # skips an interpreter's start and torch's import (a default-model replica's restart: ready in ~1.1 s, not ~3).
        self._launcher = core_launcher.start(threads)
        try:
            for rep in self._replicas:
                self._pending.append(ProcessCoreClient(rep.config, cpus=rep.cpus, launcher=self._launcher))
        except BaseException:
            self._shutdown_pending()
            self._close_launcher()
            raise
        self.router: Router | None = None

    def wait_ready(self, timeout: float = 600.0) -> None:
        try:
            for rep, client in zip(self._replicas, self._pending):
                client.wait_ready(timeout)
                rep.client, rep.status, rep.stats = client, "up", client.latest_stats
        except BaseException:
            self._shutdown_pending()
            self._close_launcher()
            raise
        self._pending = []
        first = self._replicas[0].client.info  # type: ignore[union-attr]
        # Capacity fields are the sum over replicas (the server admits that many sequences); what
        # one sequence may hold (max_seq_len) is one replica's.
        infos = [rep.client.info for rep in self._replicas]  # type: ignore[union-attr]
        self.info: EngineInfo = msgspec.structs.replace(
            first, max_num_seqs=sum(i.max_num_seqs for i in infos),
            num_hot_blocks=sum(i.num_hot_blocks for i in infos), num_cold_blocks=sum(i.num_cold_blocks for i in infos),
            kv_cache_bytes=sum(i.kv_cache_bytes for i in infos), weight_bytes=sum(i.weight_bytes for i in infos))
        self.router = Router(first.block_size, self.dp.routing)

    def _shutdown_pending(self) -> None:
        for client in self._pending:
            client.shutdown()
        self._pending = []

    def start(self, on_outputs: OnOutputs, on_failure: OnFailure, on_lost: OnLost | None = None) -> None:
        self._on_outputs, self._on_failure = on_outputs, on_failure
        self._on_lost = on_lost
        for rep in self._replicas:
            assert rep.client is not None
            self._attach(rep, rep.client)

    def _attach(self, rep: _Replica, client: ProcessCoreClient) -> None:
        client.start(lambda outs: self._outputs(rep, outs), lambda err: self._replica_failed(rep, client, err))

    # --- the front's calls -------------------------------------------------------------------------
    def add(self, requests: list[CoreRequest]) -> None:
        if not requests:
            return
        first = requests[0]
        with self._lock:
            loads = {rep.index: len(rep.sequences) + rep.stats.kv_usage for rep in self._replicas if rep.status == "up"}
            if not loads:
                raise self._none_running()
            assert self.router is not None
            index = self.router.choose(first.prompt_token_ids, (first.cache_salt, first.adapter), loads)
            rep = self._replicas[index]
            for req in requests:
                self._where[req.request_id] = index
                rep.sequences.add(req.request_id)
            client = rep.client
        assert client is not None
        try:
            client.add(requests)
        except EngineDeadError as exc:  # it died between the choice and the send
            self._lose(rep, [r.request_id for r in requests], exc)

    def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for sid in request_ids:
                index = self._where.pop(sid, None)
                if index is not None:
                    self._replicas[index].sequences.discard(sid)
                    by_replica.setdefault(index, []).append(sid)
            clients = {i: self._replicas[i].client for i in by_replica}
        for i, ids in by_replica.items():
            client = clients[i]
            if client is not None:
                client.abort(ids)

    def call(self, call: CoreCall, timeout: float = 60.0) -> CallResult:
        """Every running replica answers (adapters are loaded into and unloaded from all); the
        stats returned are their sum, the adapters (ListAdapters) the first one's."""
        if isinstance(call, (LoadAdapter, UnloadAdapter)):
            return self._adapter_call(call, timeout)
        answers = []
        for rep in self._up():
            assert rep.client is not None
            try:
                answers.append(rep.client.call(call, timeout=timeout))
            except EngineDeadError:
                continue  # its failure callback takes it out and restarts it
            rep.stats = answers[-1].stats
        return CallResult(0, self.latest_stats, adapters=answers[0].adapters if answers else [])

    def _adapter_call(self, call: LoadAdapter | UnloadAdapter, timeout: float) -> CallResult:
        """A load or unload on every running replica, then in the front's list. A load one replica
        refuses is undone on those that took it and never enters the list; with no replica running
        it is refused (nothing could check the adapter): 503 while replicas restart."""
        with self._adapters_lock:
            done: list[_Replica] = []
            try:
                for rep in self._up():
                    assert rep.client is not None
                    try:
                        rep.stats = rep.client.call(call, timeout=timeout).stats
                    except EngineDeadError:
                        continue  # its restart loads what the list holds then
                    done.append(rep)
            except Exception:
                if isinstance(call, LoadAdapter):
                    self._undo_load(call.name, done)
                elif done:  # gone from some replicas: a restart must not bring it back
                    self._adapters.pop(call.name, None)
                raise
            if not done:
                raise self._none_running()
            if isinstance(call, LoadAdapter):
                self._adapters[call.name] = call.path
            else:
                self._adapters.pop(call.name, None)
        return CallResult(0, self.latest_stats)

    def _none_running(self) -> RuvllmError:
        """No replica is up: while one restarts, a retry will be answered (503 replica_failed at the
        server); once all are given up, the engine has failed."""
        if any(rep.status == "restarting" for rep in self._replicas):
            return ReplicaLostError("no engine replica is running: they are restarting; send it again")
        return EngineDeadError("no engine replica is running (they have failed)")

    @staticmethod
    def _undo_load(name: str, replicas: list[_Replica]) -> None:
        for rep in replicas:
            assert rep.client is not None
            try:
                rep.client.call(UnloadAdapter(name))
            except Exception as exc:  # noqa: BLE001  # the load's own error is what the caller hears
                log.error("engine replica %d: unloading %r after a failed load failed: %s", rep.index, name, exc)

    def _up(self) -> list[_Replica]:
        with self._lock:
            return [rep for rep in self._replicas if rep.status == "up"]

    @property
    def latest_stats(self) -> EngineStats:
        up = [rep for rep in self._replicas if rep.status == "up" and rep.client is not None]
        down = [rep.stats for rep in self._replicas if rep not in up]
        return sum_stats([rep.client.latest_stats for rep in up] + down)  # type: ignore[union-attr]

    def replica_states(self) -> list[ReplicaState]:
        with self._lock:
            return [ReplicaState(rep.index, rep.status,
                                 rep.client.latest_stats if rep.status == "up" and rep.client else rep.stats,
                                 rep.restarts, rep.last_error) for rep in self._replicas]

    @property
    def is_alive(self) -> bool:
        return not self._stopping.is_set() and any(rep.status in ("up", "restarting") for rep in self._replicas)

    def shutdown(self) -> None:
        self._stopping.set()
        for rep in self._replicas:
            with self._lock:
                client, launching, rep.status = rep.client, rep.launching, "stopped"
            if launching is not None:  # its restart thread, waiting for it, sees it exit and cleans up
                launching.process.kill()
            if client is not None:
                client.shutdown()
        self._shutdown_pending()
        self._close_launcher()  # after its children: they leave when it does

    def _close_launcher(self) -> None:
        if self._launcher is not None:
            self._launcher.close()

    # --- the replicas' receiving threads ------------------------------------------------------------
    def _outputs(self, rep: _Replica, outputs: list[CoreOutput]) -> None:
        with self._lock:
            for out in outputs:
                if out.finish_reason is not None and self._where.pop(out.request_id, None) is not None:
                    rep.sequences.discard(out.request_id)
            if rep.client is not None:
                rep.stats = rep.client.latest_stats
        assert self._on_outputs is not None
        self._on_outputs(outputs)

    def _replica_failed(self, rep: _Replica, client: ProcessCoreClient, error: EngineDeadError) -> None:
        if self._stopping.is_set():
            return
        with self._lock:
            if rep.client is not client:  # a stale client's late report
                return
            lost = sorted(rep.sequences)
            give_up = self._count_failure(rep, str(error))
            rep.status = "failed" if give_up else "restarting"
            rep.stats = EngineStats(total_blocks=rep.stats.total_blocks, free_blocks=rep.stats.total_blocks)
        log.error("engine replica %d failed (%s); %d open sequence(s) lost; %s", rep.index, error, len(lost),
                  "giving up on it" if give_up else "restarting it")
        self._lose(rep, lost, error)
        if give_up:
            self._maybe_all_dead()
        else:
            threading.Thread(target=self._restart, args=(rep,), name=f"ruvllm-replica-{rep.index}-restart",
                             daemon=True).start()

    def _lose(self, rep: _Replica, seq_ids: list[str], error: BaseException) -> None:
        with self._lock:
            for sid in seq_ids:
                self._where.pop(sid, None)
                rep.sequences.discard(sid)
            assert self.router is not None
            self.router.forget(rep.index)
        if seq_ids and self._on_lost is not None:
            self._on_lost(seq_ids, ReplicaLostError(
                f"engine replica {rep.index} failed while serving this request ({error}); "
                "the other replicas are serving: send it again"))

    def _restart(self, rep: _Replica) -> None:
        old = rep.client
        if old is not None:  # its sockets and folder (the process is already reaped)
            old.shutdown()
        time.sleep(min(2.0 ** (len(rep.failures) - 1) * 0.5, 10.0))  # back off when it keeps failing
        while True:
            if self._stopping.is_set():
                return
            client = None
            try:
                # Started outside the lock: a fork's round trip (or a new launcher's imports) holds up
                # no other replica's outputs.
                client = ProcessCoreClient(rep.config, cpus=rep.cpus, launcher=self._launcher)
                with self._lock:  # shutdown stops a replica still loading through `launching`
                    stopping = self._stopping.is_set()
                    if not stopping:
                        rep.launching = client
                if stopping:  # shutdown came between the start and the lock: it did not see this one
                    client.shutdown()
                    return
                client.wait_ready()
                # Started first: its receiving thread answers the reload's calls. Until it is up,
                # nothing is routed to it, and its failure is a stale client's (ignored).
                self._attach(rep, client)
                self._reload_adapters(rep, client)  # returns holding _adapters_lock
            except Exception as exc:
                if client is not None:
                    client.shutdown()
                if self._stopping.is_set():
                    return
                with self._lock:
                    rep.launching = None
                    give_up = self._count_failure(rep, f"restart failed: {exc}")
                    if give_up:
                        rep.status = "failed"
                log.error("engine replica %d did not restart: %s", rep.index, exc)
                if give_up:
                    self._maybe_all_dead()
                    return
                time.sleep(1.0)
                continue
            try:
                with self._lock:
                    rep.launching = None
                    if self._stopping.is_set():
                        client.shutdown()
                        return
                    rep.client, rep.status, rep.stats = client, "up", client.latest_stats
                    rep.restarts += 1
            finally:
                self._adapters_lock.release()
            log.warning("engine replica %d is serving again (restart %d)", rep.index, rep.restarts)
            return

    def _reload_adapters(self, rep: _Replica, client: ProcessCoreClient) -> None:
        """Load the front's list into a restarted replica, and return holding `_adapters_lock` with
        the replica in step with the list (it is marked up under it). The loads run without the
        lock (an admin load waits for none of them); a load or unload made meanwhile is caught up
        with before returning. An adapter that no longer loads (its folder removed since) is
        logged and left out: the replica serves the rest rather than never coming back."""
        loaded: dict[str, str] = {}
        skipped: dict[str, str] = {}
        while True:
            with self._adapters_lock:
                want = dict(self._adapters)
            for name in [n for n, path in loaded.items() if want.get(n) != path]:  # unloaded meanwhile
                client.call(UnloadAdapter(name))
                del loaded[name]
            for name, path in want.items():
                if loaded.get(name) == path or skipped.get(name) == path:
                    continue
                try:
                    client.call(LoadAdapter(name, path))
                    loaded[name] = path
                except EngineDeadError:
                    raise
                except Exception as exc:  # noqa: BLE001  # the adapter's fault, not the replica's
                    skipped[name] = path
                    log.error("engine replica %d: adapter %r (%s) did not load again, so this replica serves "
                              "without it: %s", rep.index, name, path, exc)
            self._adapters_lock.acquire()
            if all(loaded.get(n) == p or skipped.get(n) == p for n, p in self._adapters.items()) and all(
                    self._adapters.get(n) == p for n, p in loaded.items()):
                return
            self._adapters_lock.release()

    def _count_failure(self, rep: _Replica, error: str) -> bool:
        """Note a failure (under the lock); True when the replica has failed too often to go on."""
        now = time.monotonic()
        rep.failures = [t for t in rep.failures if now - t < self.dp.restart_window_s] + [now]
        rep.last_error = error
        return len(rep.failures) > self.dp.max_restarts

    def _maybe_all_dead(self) -> None:
        if all(rep.status == "failed" for rep in self._replicas):
            self._on_failure(EngineDeadError("every engine replica failed and could not be restarted: "
                                             + "; ".join(f"replica {r.index}: {r.last_error}" for r in self._replicas)))

