"""The placement engine a sweep plan runs through (`sweep.compare` also replays evict-and-restart through
it): where every workload runs, free GPUs per node, the pools that index them, and the old nodes in drain
order, wave by wave; a `Policy` says where each displaced workload goes. Pure, no cluster. The cost is
O((nodes + moves) log nodes): free capacity is indexed by (GPU model, version set, tier) and, inside
that, by free GPUs, so no step scans the fleet.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple, Protocol

from pytest_gpucanary.sweep.model import (
    Change,
    CheckpointFate,
    Fleet,
    Move,
    MoveKind,
    Shortfall,
    ShortfallKind,
    SweepLimits,
    VersionSet,
    Wave,
    checkpoint_fate,
    restores_on,
)

NEW, HELD, MOVING = 0, 1, 2  # pool tiers, in the order a restore prefers them


class _Pool:
    """Nodes of one (GPU model, version set, tier); `buckets[f]` is a heap of (-rank, node) with f free GPUs."""

    __slots__ = ("key", "buckets", "standing")

    def __init__(self, key: tuple[str, VersionSet, int], max_gpus: int) -> None:
        self.key = key
        self.buckets: list[list[tuple[int, int]]] = [[] for _ in range(max_gpus + 1)]
        self.standing = 0


class Step(NamedTuple):
    node: int  # -1: no node now
    kind: MoveKind | None
    short: ShortfallKind | None = None


WAIT = Step(-1, None)


class Policy(Protocol):
    def now(self, e: Engine, w: int, src: int) -> Step: ...
    def later(self, e: Engine, w: int, src: int) -> Step: ...


class Engine:
    """Sweep state: where every workload runs, free GPUs per node, and the pools that index them."""

    def __init__(self, fleet: Fleet, change: Change, limits: SweepLimits) -> None:
        self.fleet, self.change, self.limits = fleet, change, limits
        self.workloads = fleet.workloads
        nodes = fleet.nodes
        self.cap = [n.gpus for n in nodes]
        self.free = list(self.cap)
        self.is_old = [not change.is_current(n.versions) for n in nodes]
        self.target = [change.apply(n.versions) for n in nodes]
        fate_of: dict[VersionSet | None, CheckpointFate] = {}
        for w in fleet.workloads:
            if w.checkpoint not in fate_of:
                fate_of[w.checkpoint] = checkpoint_fate(w.checkpoint, change)
        self.fates = [fate_of[w.checkpoint] for w in fleet.workloads]
        self._place_residents()
        order, self.tier = _drain_order(fleet, self.is_old, self.free, limits.hold_back_gpus)
        self.rank = [len(nodes)] * len(nodes)
        for position, n in enumerate(order):
            self.rank[n] = position
        self.wave_size = limits.wave_size(len(nodes))
        self.waves = [order[i : i + self.wave_size] for i in range(0, len(order), self.wave_size)]
        self._build_pools()
        # per workload, as of ready_at: in-memory work built so far, and seconds of running left
        self.ready_at = [0.0] * len(self.workloads)
        self.work_s = [w.since_start_s for w in fleet.workloads]
        self.left_s = [math.inf if w.remaining_s is None else w.remaining_s for w in fleet.workloads]
        self.end = list(self.left_s)
        self.ends = [(end, w) for w, end in enumerate(self.end) if end != math.inf]
        heapq.heapify(self.ends)
        self.old_total = sum(c for c, old in zip(self.cap, self.is_old) if old)
        self.old_used = sum(c - f for c, f, old in zip(self.cap, self.free, self.is_old) if old)
        self._restore_of: list[tuple[list[_Pool], list[_Pool]] | None] = [None] * len(self.workloads)
        self._restore_cache: dict[tuple[str, VersionSet | None], tuple[list[_Pool], list[_Pool]]] = {}
        self.lost_gpu_s = self.downtime_gpu_s = self.busy_gpu_s = 0.0

    def _place_residents(self) -> None:
        index = {n.name: i for i, n in enumerate(self.fleet.nodes)}
        self.loc = [index[w.node] for w in self.workloads]
        self.gpu_model = [self.fleet.nodes[n].gpu_model for n in self.loc]
        self.residents: list[set[int]] = [set() for _ in self.fleet.nodes]
        for w, n in enumerate(self.loc):
            self.residents[n].add(w)
            self.free[n] -= self.workloads[w].gpus

    def _build_pools(self) -> None:
        nodes = self.fleet.nodes
        max_gpus: dict[str, int] = {}
        for n in nodes:
            max_gpus[n.gpu_model] = max(max_gpus.get(n.gpu_model, 0), n.gpus)
        self.pools: dict[tuple[str, VersionSet, int], _Pool] = {}
        self.pool_of: list[_Pool | None] = []
        for i, n in enumerate(nodes):
            keys = [(n.gpu_model, n.versions, self.tier[i])]
            if self.is_old[i]:
                keys.append((n.gpu_model, self.target[i], NEW))
            for key in keys:
                if key not in self.pools:
                    self.pools[key] = _Pool(key, max_gpus[n.gpu_model])
            self.pool_of.append(self.pools[keys[0]])
            self.pools[keys[0]].standing += 1
            self._index(i)
        self._cold_pools = [
            [self.pools[(n.gpu_model, t, NEW)]] if (n.gpu_model, t, NEW) in self.pools else []
            for n, t in zip(nodes, self.target)
        ]

    def _index(self, n: int) -> None:
        pool = self.pool_of[n]
        if pool is not None and self.free[n] > 0:
            heapq.heappush(pool.buckets[self.free[n]], (-self.rank[n], n))

    def find(self, pools: list[_Pool], gpus: int) -> int:
        """Best fit in the first pool that has room, ties to the node that drains latest; -1 if none."""
        free, pool_of = self.free, self.pool_of
        for pool in pools:
            buckets = pool.buckets
            for f in range(gpus, len(buckets)):
                heap = buckets[f]
                while heap:
                    n = heap[0][1]
                    if pool_of[n] is pool and free[n] == f:
                        return n
                    heapq.heappop(heap)
        return -1

    def restore_pools(self, w: int) -> tuple[list[_Pool], list[_Pool]]:
        """Pools where workload w's checkpoint restores: (upgraded ones, old ones held-first)."""
        found = self._restore_of[w]
        if found is not None:
            return found
        key = (self.gpu_model[w], self.workloads[w].checkpoint)
        found = self._restore_cache.get(key)
        if found is None:
            fits = [p for p in self.pools.values() if p.key[0] == key[0] and restores_on(key[1], p.key[1], self.change)]
            found = (
                [p for p in fits if p.key[2] == NEW],
                sorted((p for p in fits if p.key[2] != NEW), key=lambda p: p.key[2]),
            )
            self._restore_cache[key] = found
        self._restore_of[w] = found
        return found

    def cold_pool(self, src: int) -> list[_Pool]:
        """The new-stack pool for work leaving old node src: same GPU model, src's versions changed."""
        return self._cold_pools[src]

    def same_set_pools(self, src: int) -> list[_Pool]:
        """Old pools with src's own GPU model and versions (where a restarted pod may land)."""
        node = self.fleet.nodes[src]
        return [p for tier in (HELD, MOVING) if (p := self.pools.get((node.gpu_model, node.versions, tier)))]

    def run(self, policy: Policy) -> tuple[list[Wave], list[Shortfall]]:
        waves: list[Wave] = []
        shortfalls: list[Shortfall] = []
        for k, wave in enumerate(self.waves, 1):
            t = (k - 1) * self.change.node_upgrade_s
            finished = self._finish_until(t)
            displaced = self._drain(wave)
            moves: list[Move] = []
            waiting: list[tuple[int, int]] = []
            for w, src in displaced:
                self._take(policy.now(self, w, src), k, w, src, t, moves, waiting, shortfalls)
            self._upgrade(wave)
            back = t + self.change.node_upgrade_s
            for w, src in waiting:
                self._take(policy.later(self, w, src), k, w, src, t, moves, None, shortfalls, start=back)
            waves.append(
                Wave(
                    k,
                    t,
                    back,
                    tuple(self.fleet.nodes[n].name for n in wave),
                    tuple(moves),
                    finished,
                    self.old_total,
                    self.old_used,
                )
            )
            if shortfalls:
                break
        return waves, shortfalls

    def _take(
        self,
        step: Step,
        k: int,
        w: int,
        src: int,
        t: float,
        moves: list[Move],
        waiting: list[tuple[int, int]] | None,
        shortfalls: list[Shortfall],
        *,
        start: float = -1.0,
    ) -> None:
        if step.node >= 0 and step.kind is not None:
            moves.append(self._move(k, w, src, step.node, step.kind, t, max(t, start)))
        elif step.short is None and waiting is not None:
            waiting.append((w, src))
        else:
            short = step.short or ShortfallKind.NO_NEW_CAPACITY
            workload = self.workloads[w]
            needs = workload.checkpoint if short is ShortfallKind.NO_OLD_CAPACITY else self.target[src]
            shortfalls.append(
                Shortfall(
                    k, short, self.fleet.nodes[src].gpu_model, needs or VersionSet(), (workload.name,), workload.gpus
                )
            )

    def _finish_until(self, t: float) -> tuple[str, ...]:
        done = []
        while self.ends and self.ends[0][0] <= t:
            end, w = heapq.heappop(self.ends)
            n = self.loc[w]
            if end != self.end[w] or n < 0:
                continue
            self.loc[w] = -1
            self.residents[n].discard(w)
            self._release(n, self.workloads[w].gpus)
            done.append(self.workloads[w].name)
        return tuple(done)

    def _release(self, n: int, gpus: int) -> None:
        self.free[n] += gpus
        if self.is_old[n] and self.pool_of[n] is not None:
            self.old_used -= gpus
        self._index(n)

    def _drain(self, wave: list[int]) -> list[tuple[int, int]]:
        displaced: list[tuple[int, int]] = []
        for n in wave:
            self.old_total -= self.cap[n]
            self.old_used -= self.cap[n] - self.free[n]
            pool = self.pool_of[n]
            assert pool is not None  # a node drains once, and every node starts in a pool
            pool.standing -= 1
            self.pool_of[n] = None
            displaced.extend((w, n) for w in self.residents[n])
            self.residents[n] = set()
            self.free[n] = self.cap[n]
        for w, _ in displaced:
            self.loc[w] = -1
        displaced.sort(key=lambda pair: (-self.workloads[pair[0]].gpus, self.workloads[pair[0]].name))
        return displaced

    def _upgrade(self, wave: list[int]) -> None:
        for n in wave:
            self.is_old[n] = False
            self.rank[n] = len(self.cap)
            pool = self._cold_pools[n][0]
            pool.standing += 1
            self.pool_of[n] = pool
            self._index(n)

    def _move(self, k: int, w: int, src: int, dst: int, kind: MoveKind, stop: float, start: float) -> Move:
        workload = self.workloads[w]
        gpus = workload.gpus
        took = workload.restore_s if kind is MoveKind.RESTORE else workload.cold_start_s
        ready = start + took
        ran = max(0.0, stop - self.ready_at[w])  # stopped before it was ready again: it had not run
        unfinished = max(0.0, self.ready_at[w] - stop)  # the restore or cold start this stop cut short
        work = self.work_s[w] + ran
        lost = 0.0 if kind is MoveKind.RESTORE else gpus * work
        self.left_s[w] = self.left_s[w] - ran + lost / gpus
        self.work_s[w] = work if kind is MoveKind.RESTORE else 0.0
        self.ready_at[w] = ready
        if self.left_s[w] != math.inf:
            self.end[w] = ready + self.left_s[w]
            heapq.heappush(self.ends, (self.end[w], w))
        self.lost_gpu_s += lost
        self.downtime_gpu_s += gpus * (ready - stop - unfinished)
        self.busy_gpu_s += gpus * (took - unfinished)
        self.loc[w] = dst
        self.residents[dst].add(w)
        self.free[dst] -= gpus
        if self.is_old[dst]:
            self.old_used += gpus
        self._index(dst)
        names = self.fleet.nodes
        return Move(k, workload.name, names[src].name, names[dst].name, kind, stop, start, ready, lost)


def _drain_order(fleet: Fleet, is_old: list[bool], free: list[int], hold_back_gpus: int) -> tuple[list[int], list[int]]:
    """Old nodes in drain order (others least loaded first, then held ones), and each node's tier."""
    groups: dict[tuple[str, VersionSet], list[int]] = {}
    for i, n in enumerate(fleet.nodes):
        if is_old[i]:
            groups.setdefault((n.gpu_model, n.versions), []).append(i)
    tier = [NEW] * len(fleet.nodes)
    used = [n.gpus - f for n, f in zip(fleet.nodes, free)]
    for members in groups.values():
        members.sort(key=lambda i: (used[i], fleet.nodes[i].name))
        held_gpus = 0
        for i in reversed(members):
            if held_gpus >= hold_back_gpus:
                tier[i] = MOVING
            else:
                tier[i] = HELD
                held_gpus += fleet.nodes[i].gpus
    order = sorted(
        (i for i in range(len(fleet.nodes)) if is_old[i]), key=lambda i: (tier[i] == HELD, used[i], fleet.nodes[i].name)
    )
    return order, tier
