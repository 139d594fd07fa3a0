"""Mini-batch delivery: manifests (built once per admitted mini-batch), fetched and ack reports, versions."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from knittrans.api.entries import MiniBatch
from knittrans.api.jobbase import JobBase
from knittrans.api.records import Kind, index_key, version_key
from knittrans.api.store import Txn
from knittrans.errors import Conflict, DataLost, InvalidRequest, NotFound
from knittrans.grants import sign_grant
from knittrans.manifest import Manifest, ManifestGroup, ManifestNode, Row, etag_of
from knittrans.sched.staleness import ConsumedGroup

__all__ = ["Delivery", "Published", "rank_runs", "ranks_of_runs"]


@dataclass(frozen=True)
class Published:
    """What a job serves at ``GET .../minibatches/{n}`` now (handed to the event loop after each change)."""

    manifests: dict[int, tuple[str, bytes]]
    """Planned, not consumed mini-batches: ``n -> (ETag, manifest bytes)``."""
    position: int
    """Trainer position: mini-batches below it are consumed."""
    final: int | None
    """No mini-batch at or beyond this index will ever be admitted (None: the job goes on)."""
    state: str
    """Lifecycle state of the job."""


def rank_runs(ranks: set[int]) -> list[list[int]]:
    """``ranks`` as sorted half-open ``[start, stop)`` runs (what acks and fetches persist: all W ranks are one run)."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return runs


def ranks_of_runs(runs: Sequence[Sequence[int]]) -> set[int]:
    """The ranks of :func:`rank_runs`' runs."""
    return {r for start, stop in runs for r in range(start, stop)}


class Delivery(JobBase):
    """Manifests, fetch reports, acks and versions of one job."""

    # ------------------------------------------------------------------ manifests
    def published(self) -> Published:
        """The job's manifests and where the trainer is, for the event loop (each manifest rendered once)."""
        manifests = {mb.n: self._manifest(mb) for mb in self.in_flight()}
        return Published(manifests=manifests, position=self.position, final=self._final(), state=self.state)

    def _final(self) -> int | None:
        """No mini-batch at or beyond this index will be admitted (None: the job goes on)."""
        if self.done() or self.drain_closed:
            return self.next_n
        return None if self.spec.total_steps is None else self.spec.total_steps * self.K

    def _manifest(self, mb: MiniBatch) -> tuple[str, bytes]:
        """``(ETag, bytes)`` of ``mb``'s manifest, built on first use and kept: the same bytes for every
        rank and every request (rebuilt identically after a restart; anew only when a node moved)."""
        if mb.manifest is None:
            raw = self.build_manifest(mb).encode()
            mb.manifest = (etag_of(raw, mb.n, mb.attempt), raw)
        return mb.manifest

    def build_manifest(self, mb: MiniBatch) -> Manifest:
        """The :class:`~knittrans.manifest.Manifest` of ``mb`` from its layout and the groups' records."""
        # ids -> indices in order of first appearance (a dict's order is its list's)
        nodes: dict[str, int] = {}
        units: dict[str, tuple[int, int]] = {}  # unit id -> (index, node index)
        groups: list[ManifestGroup] = []
        media: dict[str, tuple[int, int]] = {}  # content hash -> (index, unit index)
        reads: dict[str, dict[str, list[tuple[int, int]]]] = {}
        media_at: dict[str, dict[str, str]] = {}
        ranks: list[tuple[tuple[Row, ...], ...]] = []
        # group id -> its index in ``groups``, tokens, first row and the list its node's grant collects its rows in
        seen: dict[str, tuple[int, tuple[int, ...], int, list[tuple[int, int]]]] = {}
        for share in mb.layout:
            micro_batches = []
            for micro in share:
                rows = []
                for group_id, row in micro:
                    known = seen.get(group_id)
                    if known is None:
                        entry = self.groups[group_id]
                        record = entry.record
                        if entry.unit_id not in units:
                            units[entry.unit_id] = (len(units), nodes.setdefault(entry.node_id, len(nodes)))
                        u = units[entry.unit_id][0]
                        for h in record.media_hashes:
                            if h not in media:
                                media[h] = (len(media), u)
                                media_at.setdefault(entry.node_id, {})[h] = entry.unit_id
                        ranges = reads.setdefault(entry.node_id, {}).setdefault(entry.unit_id, [])
                        known = seen[group_id] = (len(groups), record.trajectory_tokens, record.row_start, ranges)
                        groups.append(ManifestGroup(group_id, u, tuple(media[h][0] for h in record.media_hashes)))
                    index, tokens, start, ranges = known
                    rows.append((index, row, tokens[row - start]))
                    ranges.append((row, row + 1))
                micro_batches.append(tuple(rows))
            ranks.append(tuple(micro_batches))
        key, expires, columns = self.ticket_key, mb.admitted_at + self.ticket_ttl_s, self.spec.columns
        manifest_nodes = []
        for node_id in nodes:
            grant = None
            if key is not None:
                grant = sign_grant(
                    key,
                    job=self.name,
                    expires_at=expires,
                    reads=reads.get(node_id, {}),
                    columns=columns,
                    media=media_at.get(node_id, {}),
                )
            manifest_nodes.append(ManifestNode(node_id, self._endpoint(node_id), grant))
        return Manifest(
            job=self.name,
            global_index=mb.n,
            attempt=mb.attempt,
            step=mb.step,
            mini_batch_index=mb.k,
            policy_version=mb.n,
            admitted_at=mb.admitted_at,
            columns=tuple(columns) if columns else None,
            nodes=tuple(manifest_nodes),
            units=tuple((unit_id, node) for unit_id, (_, node) in units.items()),
            groups=tuple(groups),
            media=tuple((h, u) for h, (_, u) in media.items()),
            ranks=tuple(ranks),
        )

    def forget_rendered(self) -> None:
        """Drop built manifests (a node's endpoint changed: the manifests must name the new one)."""
        for mb in self.minibatches.values():
            mb.manifest = None

    def progress(self) -> dict[str, Any]:
        """Where the trainer is: position, the next index, and each in-flight mini-batch's fetched and acked ranks."""
        return {
            "state": self.state,
            "position": self.position,
            "next_global_index": self.next_n,
            "final": self._final(),
            "world_size": self.spec.world_size,
            "in_flight": [
                {
                    "global_index": mb.n,
                    "attempt": mb.attempt,
                    "admitted_at": mb.admitted_at,
                    "fetched_ranks": rank_runs(mb.fetched),
                    "acked_ranks": rank_runs(mb.acks),
                }
                for mb in self.in_flight()
            ],
        }

    # ------------------------------------------------------------------ progress
    def _planned(self, n: int, attempt: int) -> MiniBatch | None:
        """The planned mini-batch ``n`` at ``attempt``; None when it was consumed (progress on it is a repeat).

        Raises:
            DataLost: that attempt was withdrawn (its rows were on a lost node).
            NotFound: it was never issued.
        """
        if n < self.position:
            return None
        mb = self.minibatches.get(n)
        if mb is None or mb.attempt != attempt:
            if attempt <= self.attempts.get(n, -1):  # node loss keeps the latest attempt of what it withdrew
                raise DataLost(
                    f"mini-batch {n} attempt {attempt} was withdrawn (rows on a lost node); "
                    f"read its manifest again (GET .../minibatches/{n})"
                )
            raise NotFound(f"mini-batch {n} attempt {attempt} of job {self.name!r} was never issued")
        return mb

    def _ranks(self, ranks: Sequence[int] | None) -> set[int]:
        if ranks is None:
            return set(range(self.spec.world_size))
        bad = [r for r in ranks if not 0 <= r < self.spec.world_size]
        if bad:
            raise NotFound(f"ranks {bad} are outside the job's world_size {self.spec.world_size} (0..W-1)")
        return set(ranks)

    def fetched(self, n: int, attempt: int, ranks: Sequence[int] | None, txn: Txn) -> dict[str, Any]:
        """Record that ``ranks`` (None: every rank) hold their whole share of mini-batch ``n``; idempotent (the
        contract: the fetched route)."""
        who = self._ranks(ranks)
        mb = self._planned(n, attempt)
        if mb is not None and (new := who - mb.fetched - mb.acks):
            mb.fetched |= new
            txn.put(Kind.FETCHED, self.name, index_key(n), {"attempt": mb.attempt, "ranks": rank_runs(mb.fetched)})
        world = self.spec.world_size
        holding = world if mb is None else len(mb.fetched | mb.acks)
        return {"global_index": n, "attempt": attempt, "fetched_ranks": holding, "held": holding == world}

    def ack(
        self,
        n: int,
        attempt: int,
        ranks: Sequence[int] | None,
        version: int | None,
        txn: Txn,
        *,
        figures: Collection[int] = (),
    ) -> dict[str, Any]:
        """Record that ``ranks`` (None: every rank) finished mini-batch ``n``; idempotent (the contract: the ack route).

        At ``W`` acked ranks the mini-batch is consumed (:meth:`admit` then settles the lifecycle). ``version`` is
        recorded as the lowest acking rank's report; ``figures``: the ranks whose transfer figures the ack carries.

        Raises:
            DataLost: that attempt was withdrawn. NotFound: never issued.
            Conflict: a rank acks ``n`` before an earlier mini-batch it has not acked.
            InvalidRequest: figures that are not of exactly the ranks the ack reports for.
        """
        who = self._ranks(ranks)
        answer = {"global_index": n, "attempt": attempt, "world_size": self.spec.world_size}
        if figures and set(figures) != who:
            raise InvalidRequest(
                f"'transfer' has figures of ranks {rank_runs(set(figures))} but this ack reports for ranks "
                f"{rank_runs(who)} ([start, stop) runs); give each of them, and only them, one entry"
            )
        mb = self._planned(n, attempt)
        if version is not None:
            self._check_version(min(who), version)
        if mb is None:
            return {**answer, "consumed": True, "duplicate": True}
        new = who - mb.acks
        for rank in sorted(new):
            cursor = self.rank_cursor(rank)
            if cursor != n:
                raise Conflict(f"rank {rank} must ack mini-batch {cursor} before {n}")
        if version is not None:
            self._set_version(min(who), version, txn)
        if not new:
            return {**answer, "consumed": False, "duplicate": True}
        mb.acks |= new
        mb.fetched -= new
        consumed = len(mb.acks) == self.spec.world_size
        if consumed:
            self._consume(mb, txn)
        else:
            txn.put(Kind.ACK, self.name, index_key(n), {"attempt": mb.attempt, "ranks": rank_runs(mb.acks)})
        return {**answer, "consumed": consumed, "duplicate": False}

    def _consume(self, mb: MiniBatch, txn: Txn) -> None:
        records = []
        for gid in mb.group_ids:
            entry = self.groups[gid]
            self._set(entry, "consumed", txn, mb.n)
            r = entry.record
            records.append(
                ConsumedGroup(
                    group_id=gid,
                    source=r.source,
                    num_trajectories=r.num_trajectories,
                    v_train=mb.n,
                    mini_batch_index=mb.k,
                    step=mb.step,
                    version_start=r.version_start,
                    version_end=r.version_end,
                    version_weighted=r.version_weighted,
                )
            )
        self.consumed.add(records)
        self.retire(mb.group_ids)
        mb.status, mb.layout, mb.manifest = "consumed", [], None
        mb.acks, mb.fetched = set(), set()  # a consumed mini-batch needs neither
        while (m := self.minibatches.get(self.position)) is not None and m.status == "consumed":
            self.position += 1
        self.evict_consumed()
        txn.put(Kind.MINI_BATCH, self.name, index_key(mb.n), mb.to_json())
        txn.put(Kind.CONSUMED, self.name, index_key(mb.n), [dict(vars(r)) for r in records])
        for kind in (Kind.ACK, Kind.FETCHED):
            txn.delete(kind, self.name, index_key(mb.n))

    # ------------------------------------------------------------------ versions
    def report_version(self, rank: int, version: int, txn: Txn) -> None:
        """Record ``rank``'s policy version after an optimizer step; versions never go back."""
        self._ranks([rank])
        self._check_version(rank, version)
        self._set_version(rank, version, txn)

    def _check_version(self, rank: int, version: int) -> None:
        old = self.rank_versions.get(rank, 0)
        if version < old:
            raise Conflict(f"rank {rank} already reported version {old}; versions never decrease")

    def _set_version(self, rank: int, version: int, txn: Txn) -> None:
        if self.rank_versions.get(rank) != version:
            self.rank_versions[rank] = version
            txn.put(Kind.VERSION, self.name, version_key(rank), version)
