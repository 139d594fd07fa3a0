"""An independent event simulator of admission timing, written from issue 13's text, to cross-check
``knittrans sim``. It imports nothing from ``knittrans``: its own random draws, its own admission
rules, its own staleness arithmetic. Its model, literally from the issue:

* ``rollout_slots`` slots generate one group each; a group of source ``s`` takes a lognormal time
  (mean, cv) and has ``group_size`` trajectories of lognormal token counts.
* **Window** ``W``: groups launched and not yet taken by a mini-batch the trainer has *started* stay
  ``<= W·q[s]`` per source (``scope="source"``, the issue's "per source, as today's quota-based room"),
  or ``<= W·G`` in total with the source furthest behind its quota share of launches going first
  (``scope="global"``, what ``knittrans.sched.timing`` implements, argued for in
  ``docs/explanation/architecture.md``). ``free_on="admit"`` frees the window at admission instead (the pre-issue
  model).
* **Lookahead** ``L``: mini-batch ``n`` is admitted only when ``n <= p + L``, ``p`` = mini-batches
  trained (``L = 0``: admitted when the trainer is ready to start it).
* **Trainer**: mini-batch ``n`` trains at version ``n`` for ``overhead + s_per_token x tokens of the
  busiest of world ranks`` (trajectories spread largest-first over the least-loaded rank); version
  ``n + 1`` reaches rollout ``sync`` seconds after it ends. A launch starts with the newest version the
  trainer has written, waiting for it to reach rollout (``launch_weights="published"``, the default, as
  ``knittrans rollout``'s worker loads the newest weights before each group), or at once with what has
  arrived (``"arrived"``). Running groups switch weights when they
  arrive (partial rollout): start version, end version (largest that produced a token: weights arriving
  exactly at the finish produced none) and the time-weighted mean.
* **Policies**: ``train_batch`` admits mini-batch ``k`` of a step only when the whole train batch has
  finished, cutting it by a fixed proportional plan; ``constraint_preserving`` admits the ``b`` earliest
  finished groups whose source still has quota left in the step, provided no source's remaining quota
  exceeds its finished + generating groups (otherwise it waits).
  ``tb_takes="train_batch"`` makes ``train_batch`` take its whole train batch when the trainer starts
  the step's first mini-batch (a conventional one-step-off-policy trainer that is handed the batch).
* **Issue 33's live loop** (``publish_s``, ``load_s``): rank 0 saves the new weights before it acks, so
  the trainer is busy ``publish_s`` after each optimizer step and version ``n + 1`` exists (and the
  window frees) only at the ack; a rollout slot that must switch weights is blocked ``load_s`` (before a
  group starts, and, with in-flight updates, each time a version arrives while it generates: it stops,
  loads, and goes on with the new weights; tokens are made only while it generates).
* **Straggler tails**: with probability ``tail_prob`` a group's duration is multiplied by
  ``tail_scale x Pareto(tail_alpha)``.
* ``version_aware`` (issue 33): the same counts per source as ``constraint_preserving``, but within a
  source it takes the groups whose age (the version their mini-batch trains at minus start version)
  reached ``2K`` first, earliest finished first, then the groups with the newest time-weighted version.
* **Architectural staleness** of a group in mini-batch ``k`` of a step, trained at version ``n``:
  ``n - v_gen - k``. Aggregates skip the first ``W`` steps; every group has the same number of
  trajectories, so group means are trajectory means.

Usage::

    .venv/bin/python benchmarks/sim_report/independent_sim.py --workload skewed3 --seeds 3
    .venv/bin/python benchmarks/sim_report/independent_sim.py --workload balanced --tb-takes mini_batch
    .venv/bin/python benchmarks/sim_report/independent_sim.py --scope source   # the issue's "per source"

Defaults: ``scope="global"``, ``tb_takes="train_batch"`` (what ``knittrans sim`` does by default).

Prints the ``constraint_preserving`` vs ``train_batch`` reductions (mean per reading, positive part of the
end reading) and steps/h, so they can be set beside ``knittrans sim``'s table.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

OLD_TIE = False
WORKLOADS = Path(__file__).resolve().parents[2] / "knittrans" / "sim" / "workloads"


@dataclass(frozen=True)
class Source:
    name: str
    quota: int
    mean_s: float
    cv: float
    tokens_mean: float
    tokens_cv: float
    tail_prob: float = 0.0
    tail_scale: float = 1.0
    tail_alpha: float = 2.0


@dataclass(frozen=True)
class Config:
    sources: tuple[Source, ...]
    group_size: int = 16
    K: int = 16
    W: int = 1
    L: int = 1
    slots: int = 64
    sync_s: float = 5.0
    publish_s: float = 0.0
    load_s: float = 0.0
    overhead_s: float = 1.0
    s_per_token: float = 2.0e-4
    world: int = 8
    steps: int = 40
    scope: str = "global"
    free_on: str = "start"
    tb_takes: str = "train_batch"
    launch_weights: str = "published"

    @property
    def G(self) -> int:
        return sum(s.quota for s in self.sources)


def load(name: str) -> Config:
    path = Path(name) if name.endswith(".yaml") else WORKLOADS / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    if raw.get("groups_per_call", 1) != 1:
        raise SystemExit(f"{name}: only one group per call is modelled here")
    if not raw.get("in_flight_updates", True):
        raise SystemExit(f"{name}: only in-flight updates are modelled here")
    sources = tuple(
        Source(
            s["name"],
            s["quota"],
            s["duration_mean_s"],
            s["duration_cv"],
            s["tokens_mean"],
            s["tokens_cv"],
            s.get("tail_prob", 0.0),
            s.get("tail_scale", 1.0),
            s.get("tail_alpha", 2.0),
        )
        for s in raw["sources"]
    )
    return Config(
        sources=sources,
        group_size=raw["group_size"],
        K=raw["mini_batches_per_step"],
        W=raw["window"],
        L=raw.get("lookahead", 1),
        slots=raw["rollout_slots"],
        sync_s=raw["sync_delay_s"],
        publish_s=raw.get("publish_delay_s", 0.0),
        load_s=raw.get("load_s", 0.0),
        overhead_s=raw["trainer_overhead_s"],
        s_per_token=raw["trainer_s_per_token"],
        world=raw["world_size"],
        steps=raw["steps"],
        launch_weights=raw.get("launch_weights", "published"),
    )


def lognormal(rng: np.random.Generator, mean: float, cv: float) -> float:
    if cv <= 0:
        return mean
    s2 = math.log(1.0 + cv * cv)
    return float(rng.lognormal(math.log(mean) - s2 / 2, math.sqrt(s2)))


@dataclass
class Group:
    gid: int
    src: int
    launched_at: float
    duration: float
    tokens: list[int]
    finished_at: float = math.nan
    # timed loads: the slot's weights, generation left, when it (re)started generating, (version, seconds) made
    version: int = 0
    left: float = 0.0
    gen_since: float = math.nan
    loading_from: float = math.inf
    made: list[tuple[int, float]] = field(default_factory=list)
    token: int = 0
    vs: tuple[int, int, float] | None = None


@dataclass
class MiniBatch:
    n: int
    step: int
    k: int
    groups: list[Group]
    duration: float


@dataclass
class Consumed:
    step: int
    k: int
    n: int
    src: int
    v_start: int
    v_end: int
    v_weighted: float


@dataclass
class Result:
    consumed: list[Consumed] = field(default_factory=list)
    makespan: float = 0.0
    peak_untaken: list[int] = field(default_factory=list)
    peak_ahead: int = 0


def plan(quotas: list[int], K: int) -> list[list[int]]:
    """Per mini-batch counts: cumulative targets (k+1)·q/K rounded by largest remainder."""
    G = sum(quotas)
    sizes = [G // K + (1 if i < G % K else 0) for i in range(K)]
    rows, prev, total = [], [0] * len(quotas), 0
    for k in range(K):
        total += sizes[k]
        exact = [(k + 1) * q / K for q in quotas]
        cum = [math.floor(x) for x in exact]
        order = sorted(range(len(quotas)), key=lambda i: (-(exact[i] - cum[i]), i))
        for i in order[: total - sum(cum)]:
            cum[i] += 1
        row = [c - p for c, p in zip(cum, prev, strict=True)]
        assert min(row) >= 0 and sum(row) == sizes[k]
        rows.append(row)
        prev = cum
    return rows


class Sim:
    def __init__(self, cfg: Config, policy: str, seed: int) -> None:
        self.c = cfg
        self.policy = policy
        self.q = [s.quota for s in cfg.sources]
        self.S = len(self.q)
        self.rngs = [np.random.default_rng([seed, i, 7919]) for i in range(self.S)]
        self.draws: list[list[tuple[float, list[int]]]] = [[] for _ in range(self.S)]
        self.avail = [0.0]  # avail[v]: when version v reaches rollout
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.now = 0.0
        self.idle_slots = cfg.slots
        self.idle_versions = [0] * cfg.slots  # weights held by each idle slot (timed loads only)
        self.running: set[int] = set()  # gids of generating groups (timed loads only)
        self.by_gid: dict[int, Group] = {}
        self.untaken = [0] * self.S
        self.launched = [0] * self.S
        self.pending = [0] * self.S
        self.pool: list[Group] = []  # finished, unadmitted
        self.trained = 0  # p: mini-batches trained
        self.busy = False
        self.queue: list[MiniBatch] = []
        self.adm_n = 0
        self.adm_a = [0] * self.S
        self.step_groups: dict[int, list[Group]] = {}
        self.plan = plan(self.q, cfg.K)
        self.b = [sum(r) for r in self.plan]
        self.res = Result(peak_untaken=[0] * self.S)

    # ---- draws: the i-th group of a source is the same under every policy -------------------------
    def draw(self, s: int) -> tuple[float, list[int]]:
        src, rng = self.c.sources[s], self.rngs[s]
        duration = lognormal(rng, src.mean_s, src.cv)
        if src.tail_prob > 0 and rng.random() < src.tail_prob:
            duration *= src.tail_scale * (1.0 - rng.random()) ** (-1.0 / src.tail_alpha)
        tokens = [max(1, round(lognormal(rng, src.tokens_mean, src.tokens_cv))) for _ in range(self.c.group_size)]
        return duration, tokens

    def push(self, t: float, kind: int, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, data))

    # ---- versions ----------------------------------------------------------------------------------
    def versions(self, start: float, end: float) -> tuple[int, int, float]:
        v0 = bisect.bisect_right(self.avail, start) - 1
        v1 = max(v0, (bisect.bisect_right if OLD_TIE else bisect.bisect_left)(self.avail, end) - 1)
        if v1 == v0 or end <= start:
            return v0, v0, float(v0)
        acc, t = 0.0, start
        for v in range(v0, v1):
            acc += v * (self.avail[v + 1] - t)
            t = self.avail[v + 1]
        acc += v1 * (end - t)
        return v0, v1, acc / (end - start)

    # ---- rollout -----------------------------------------------------------------------------------
    def pick_source(self) -> int | None:
        W = self.c.W
        if self.c.scope == "source":
            room = [W * self.q[s] - self.untaken[s] for s in range(self.S)]
            best = max(range(self.S), key=lambda s: (room[s] / self.q[s], -s))
            return best if room[best] > 0 else None
        if sum(self.untaken) >= W * self.c.G:
            return None
        return min(range(self.S), key=lambda s: (self.launched[s] / self.q[s], s))

    def launch(self) -> None:
        while self.idle_slots > 0:
            s = self.pick_source()
            if s is None:
                return
            duration, tokens = self.draw(s)
            # "published": the slot loads the newest weights the trainer has written before it generates
            start = max(self.now, self.avail[-1]) if self.c.launch_weights == "published" else self.now
            g = Group(gid=self.seq, src=s, launched_at=start, duration=duration, tokens=tokens)
            self.idle_slots -= 1
            self.untaken[s] += 1
            self.launched[s] += 1
            self.pending[s] += 1
            self.res.peak_untaken[s] = max(self.res.peak_untaken[s], self.untaken[s])
            if self.c.load_s <= 0:
                self.push(start + duration, 1, (g, 0))
                continue
            # timed loads: the idle slot with the newest weights; it loads the target version if it is older
            held = max(self.idle_versions)
            self.idle_versions.remove(held)
            target = len(self.avail) - 1 if self.c.launch_weights == "published" else self.version_at(self.now)
            g.version, g.left, g.gen_since = max(held, target), duration, start
            if held < target:
                g.loading_from, g.gen_since = start, start + self.c.load_s
            self.by_gid[g.gid] = g
            self.running.add(g.gid)
            self.push(g.gen_since + g.left, 1, (g, g.token))

    def version_at(self, t: float) -> int:
        return bisect.bisect_right(self.avail, t) - 1

    def arrive(self, version: int) -> None:
        """Timed loads with in-flight updates: every running slot on older weights stops and loads ``version``."""
        for gid in list(self.running):
            g = self.by_gid[gid]
            if g.version >= version or g.gen_since + g.left <= self.now:
                continue
            if g.gen_since <= self.now:  # generating: account what it made, then load
                g.made.append((g.version, self.now - g.gen_since))
                g.left -= self.now - g.gen_since
                g.loading_from, g.gen_since = self.now, self.now + self.c.load_s
            elif g.loading_from <= self.now:  # loading: load the new one right after
                g.gen_since += self.c.load_s
            else:
                continue  # still waiting for its start weights
            g.version = version
            g.token += 1
            self.push(g.gen_since + g.left, 1, (g, g.token))

    def finish(self, g: Group) -> None:
        g.finished_at = self.now
        self.idle_slots += 1
        self.pending[g.src] -= 1
        if self.c.load_s > 0:
            g.made.append((g.version, self.now - g.gen_since))
            made = [(v, d) for v, d in g.made if d > 0] or g.made[:1]
            total = sum(d for _, d in made)
            g.vs = (made[0][0], max(v for v, _ in made), sum(v * d for v, d in made) / total if total else made[0][0])
            self.running.discard(g.gid)
            del self.by_gid[g.gid]
            self.idle_versions.append(g.version)
        else:
            g.vs = self.versions(g.launched_at, g.finished_at)
        self.pool.append(g)

    # ---- admission ---------------------------------------------------------------------------------
    def select(self, k: int) -> list[Group] | None:
        by_src: list[list[Group]] = [[] for _ in range(self.S)]
        for g in sorted(self.pool, key=lambda g: (g.finished_at, g.gid)):
            by_src[g.src].append(g)
        left = [self.q[s] - self.adm_a[s] for s in range(self.S)]
        if self.policy == "train_batch":
            if any(len(by_src[s]) < left[s] for s in range(self.S)):
                return None
            return [g for s in range(self.S) for g in by_src[s][: self.plan[k][s]]]
        # constraint_preserving
        if any(left[s] > len(by_src[s]) + self.pending[s] for s in range(self.S)):
            return None
        taken = [0] * self.S
        out: list[Group] = []
        for g in sorted(self.pool, key=lambda g: (g.finished_at, g.gid)):
            if taken[g.src] < left[g.src]:
                taken[g.src] += 1
                out.append(g)
                if len(out) == self.b[k]:
                    break
        if len(out) < self.b[k]:
            return None
        if self.policy == "version_aware":  # same counts; within a source: due (age >= 2K) first, then newest
            out = []
            for s in range(self.S):
                due = [g for g in by_src[s] if self.adm_n - g.vs[0] >= 2 * self.c.K]  # type: ignore[index]
                rest = sorted(
                    (g for g in by_src[s] if self.adm_n - g.vs[0] < 2 * self.c.K),  # type: ignore[index]
                    key=lambda g: (-g.vs[2], -g.vs[1], g.finished_at, g.gid),  # type: ignore[index]
                )
                out += (due + rest)[: taken[s]]
        return out

    def try_admit(self) -> None:
        K = self.c.K
        while self.adm_n <= self.trained + self.c.L and self.adm_n < self.c.steps * K:
            step, k = divmod(self.adm_n, K)
            groups = self.select(k)
            if groups is None:
                break
            ids = {id(g) for g in groups}
            self.pool = [g for g in self.pool if id(g) not in ids]
            for g in groups:
                self.adm_a[g.src] += 1
            self.step_groups.setdefault(step, []).extend(groups)
            loads = [0] * self.c.world
            for t in sorted((t for g in groups for t in g.tokens), reverse=True):
                loads[loads.index(min(loads))] += t
            # rank 0 saves the new weights before it acks: the publish keeps the trainer busy
            duration = self.c.overhead_s + self.c.s_per_token * max(loads) + self.c.publish_s
            mb = MiniBatch(n=self.adm_n, step=step, k=k, groups=groups, duration=duration)
            self.res.peak_ahead = max(self.res.peak_ahead, self.adm_n - self.trained)
            if self.c.free_on == "admit":
                self.free(groups)
            self.queue.append(mb)
            self.adm_n += 1
            if k == K - 1:
                assert self.adm_a == self.q, (self.adm_a, self.q)
                self.adm_a = [0] * self.S
        if not self.busy and self.queue and self.queue[0].n == self.trained:
            self.start(self.queue.pop(0))

    def free(self, groups: list[Group]) -> None:
        for g in groups:
            self.untaken[g.src] -= 1

    # ---- training ----------------------------------------------------------------------------------
    def start(self, mb: MiniBatch) -> None:
        if self.c.free_on == "start":
            if self.policy == "train_batch" and self.c.tb_takes == "train_batch":
                if mb.k == 0:  # the trainer is handed the whole train batch (all of it has finished)
                    for s in range(self.S):
                        self.untaken[s] -= self.q[s]
            else:
                self.free(mb.groups)
        self.busy = True
        for g in mb.groups:
            v0, v1, vw = g.vs if g.vs is not None else self.versions(g.launched_at, g.finished_at)
            self.res.consumed.append(Consumed(mb.step, mb.k, mb.n, g.src, v0, v1, vw))
        self.push(self.now + mb.duration, 0, mb)

    def train_done(self, mb: MiniBatch) -> None:
        self.busy = False
        self.trained += 1
        self.avail.append(self.now + self.c.sync_s)
        if self.c.load_s > 0:
            if self.c.sync_s > 0:
                self.push(self.now + self.c.sync_s, 2, len(self.avail) - 1)
            else:
                self.arrive(len(self.avail) - 1)

    def run(self) -> Result:
        self.launch()
        while self.trained < self.c.steps * self.c.K:
            if not self.heap:
                raise RuntimeError(
                    f"stalled at t={self.now:.1f}: trained {self.trained}, pool {len(self.pool)}, "
                    f"untaken {self.untaken}, pending {self.pending}"
                )
            t, kind, _, data = heapq.heappop(self.heap)
            self.now = t
            if kind == 0:
                self.train_done(data)
            elif kind == 2:
                self.arrive(data)
            else:
                g, token = data
                if token != g.token:
                    continue  # rescheduled by an in-flight load
                self.finish(g)
            self.try_admit()
            self.launch()
        self.res.makespan = self.now
        return self.res


def summary(cfg: Config, res: Result) -> dict[str, float]:
    kept = [c for c in res.consumed if c.step >= cfg.W]
    out: dict[str, float] = {}
    for reading in ("start", "end", "weighted"):
        vals = [c.n - getattr(c, f"v_{reading}") - c.k for c in kept]
        out[f"{reading}_mean"] = statistics.fmean(vals)
        out[f"{reading}_pos"] = statistics.fmean(max(0.0, v) for v in vals)
        out[f"{reading}_max"] = max(vals)
        ordered = sorted(vals)
        out[f"{reading}_p99"] = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
    out["steps_per_h"] = cfg.steps / (res.makespan / 3600.0)
    return out


def compare(
    cfg: Config, seeds: int, policies: tuple[str, ...] = ("train_batch", "constraint_preserving")
) -> dict[str, Any]:
    avg: dict[str, dict[str, float]] = {}
    for policy in policies:
        runs = [summary(cfg, Sim(cfg, policy, seed).run()) for seed in range(seeds)]
        avg[policy] = {key: statistics.fmean(r[key] for r in runs) for key in runs[0]}
    if "train_batch" not in avg:
        return avg
    tb, cp = avg["train_batch"], avg["constraint_preserving"]

    def red(key: str) -> float:
        return 1.0 - cp[key] / tb[key] if tb[key] else math.nan

    return {
        "train_batch": tb,
        "constraint_preserving": cp,
        "reduction": {
            "start_mean": red("start_mean"),
            "end_mean": red("end_mean"),
            "weighted_mean": red("weighted_mean"),
            "start_pos": red("start_pos"),
            "end_pos": red("end_pos"),
            "weighted_pos": red("weighted_pos"),
        },
        "steps_ratio": cp["steps_per_h"] / tb["steps_per_h"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="skewed3")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int)
    ap.add_argument("-K", type=int)
    ap.add_argument("-W", type=int)
    ap.add_argument("-L", type=int)
    ap.add_argument("--scope", choices=("source", "global"), default="global")
    ap.add_argument("--free-on", choices=("start", "admit"), default="start")
    ap.add_argument("--tb-takes", choices=("mini_batch", "train_batch"), default="train_batch")
    ap.add_argument("--launch-weights", choices=("published", "arrived"), default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cfg = load(a.workload)
    over = {
        k: v
        for k, v in (("K", a.K), ("W", a.W), ("L", a.L), ("steps", a.steps), ("launch_weights", a.launch_weights))
        if v is not None
    }
    cfg = replace(cfg, scope=a.scope, free_on=a.free_on, tb_takes=a.tb_takes, **over)
    out = compare(cfg, a.seeds)
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    r = out["reduction"]
    tb, cp = out["train_batch"], out["constraint_preserving"]
    print(
        f"{a.workload} K={cfg.K} W={cfg.W} L={cfg.L} scope={cfg.scope} free_on={cfg.free_on} "
        f"tb_takes={cfg.tb_takes} launch_weights={cfg.launch_weights} seeds={a.seeds} steps={cfg.steps}"
    )
    for name, m in (("train_batch", tb), ("constraint_preserving", cp)):
        print(
            f"  {name:22s} mean s/e/w {m['start_mean']:6.2f} {m['end_mean']:6.2f} {m['weighted_mean']:6.2f}"
            f"  pos s/e/w {m['start_pos']:6.2f} {m['end_pos']:6.2f} {m['weighted_pos']:6.2f}"
            f"  max end {m['end_max']:5.1f}  steps/h {m['steps_per_h']:6.1f}"
        )
    print(
        f"  reduction mean s/e/w {r['start_mean']:.0%} / {r['end_mean']:.0%} / {r['weighted_mean']:.0%}"
        f"   pos s/e/w {r['start_pos']:.0%} / {r['end_pos']:.0%} / {r['weighted_pos']:.0%}"
        f"   steps/h x{out['steps_ratio']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
