"""The control-plane service: node registry and jobs over one record store; what the routes call."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from knittrans.api.delivery import Published
from knittrans.api.jobstate import JobState
from knittrans.api.records import JOB_KINDS, META_KEY, Kind
from knittrans.api.restore import restore_job
from knittrans.api.settings import Settings
from knittrans.api.spec import JobSpec
from knittrans.api.status import job_status
from knittrans.api.store import RecordStore, StateError, Txn
from knittrans.descriptors import UnitDescriptor
from knittrans.errors import Conflict, KnitTransError, NotFound, Unauthenticated, Unavailable
from knittrans.lifecycle import JobAction

__all__ = ["ControlPlane", "Node"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

HEARTBEATS_PER_TIMEOUT = 6
"""A node is asked to heartbeat every ``node_timeout_s / 6`` (5 s at the default 30 s): about five in a row may
be missed before it is declared lost. Heartbeats are most of the requests a control plane serves (128 nodes at 2 s
were 64 a second, more than a 1,024-rank trainer's own requests), so their rate follows the timeout."""


@dataclass
class Node:
    """A store node: where its Flight server listens and whether it is alive."""

    node_id: str
    endpoint: str
    host: str
    registered_at: float
    last_heartbeat: float
    lost: bool = False
    lost_reason: str = ""
    key_hash: str = ""
    """SHA-256 hex of the node's own credential (``node_key``); empty when it registered without one."""

    def to_json(self) -> dict[str, Any]:
        """The persisted record (the heartbeat is not: a restart gives every node a fresh one)."""
        body = asdict(self)
        del body["last_heartbeat"]
        return body

    def public(self, now: float, heartbeat_s: float) -> dict[str, Any]:
        """What ``NodePublic`` shows; ``heartbeat_s``: the interval the control plane asks of the node."""
        return {
            "node_id": self.node_id,
            "endpoint": self.endpoint,
            "host": self.host,
            "registered_at": self.registered_at,
            "lost": self.lost,
            "lost_reason": self.lost_reason,
            "state": "lost" if self.lost else "alive",
            "seconds_since_heartbeat": max(0.0, now - self.last_heartbeat),
            "heartbeat_s": heartbeat_s,
        }


class ControlPlane:
    """Nodes and jobs of one control plane, persisted in a :class:`RecordStore`."""

    def __init__(
        self,
        store: RecordStore,
        settings: Settings,
        *,
        on_change: Callable[[str], None],
        state_thread: Callable[[], None] | None = None,
    ) -> None:
        """Load all state from ``store`` and run admission once for every job.

        Args:
            store: the record store (SQLite file) holding the state.
            settings: the node timeout, admission records kept per job, the ticket key and the grants' lifetime.
            on_change: called with a job's name after every change of the job (committed or reloaded).
            state_thread: called when a job's state is looked up, a change begins and nodes are swept;
                raises when the calling thread may not touch the state (the app passes
                :meth:`StateRunner.check <knittrans.api.routes.deps.StateRunner.check>`); None: no check.
        """
        self.store = store
        self.settings = settings
        self.on_change = on_change
        self._state_thread = state_thread or (lambda: None)
        self.units_registered = 0
        self._load()
        with self._change(None) as txn:
            for job in self.jobs.values():
                job.admit_all(txn)

    # ------------------------------------------------------------------ plumbing
    def _load(self) -> None:
        """(Re)load the state; the registries are swapped in whole: the event loop reads them (heartbeats, the
        long-polls' job check) while a reload after a failed write runs on the state thread."""
        now = time.time()
        # a restarted control plane gives every live node a fresh heartbeat grace period
        self.nodes = {node_id: Node(**body, last_heartbeat=now) for _, node_id, body in self.store.load(Kind.NODE)}
        per_job: dict[str, dict[Kind, list[tuple[str, Any]]]] = {}
        previous_release = Txn()
        for kind in JOB_KINDS:
            for job, key, value in self.store.load(kind):
                if kind in (Kind.ACK, Kind.FETCHED) and "." in key:  # per-rank, from before manifests
                    previous_release.delete(kind, job, key)
                    continue
                per_job.setdefault(job, {}).setdefault(kind, []).append((key, value))
        if len(previous_release):
            logger.warning(
                "removed %d per-rank ack/fetched records of a previous release: a trainer of that release cannot "
                "resume its mini-batch (the manifest client acks per mini-batch)",
                len(previous_release),
            )
            self.store.commit(previous_release)
        jobs: dict[str, JobState] = {}
        for name, records in per_job.items():
            try:
                spec = JobSpec.from_dict(dict(records[Kind.JOB])[META_KEY]["spec"])
                state = self._new_job(spec)
                restore_job(state, records)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise StateError(
                    f"{self.store.path}: the records of job {name!r} are damaged "
                    f"({type(exc).__name__}: {exc}); restore a backup or remove the job"
                ) from exc
            jobs[name] = state
        self.jobs = jobs
        logger.info("loaded %d nodes and %d jobs from %s", len(self.nodes), len(self.jobs), self.store.path)

    def _new_job(self, spec: JobSpec) -> JobState:
        return JobState(
            spec,
            endpoint=lambda n: self.nodes[n].endpoint,
            node_state=self._node_state,
            recent_admissions=self.settings.recent_admissions,
            ticket_key=self.settings.ticket_key.get_secret_value().encode() if self.settings.ticket_key else None,
            ticket_ttl_s=self.settings.ticket_ttl_s,
        )

    def _node_state(self, node_id: str) -> str | None:
        """``alive`` or ``lost``; None for a node that never registered."""
        node = self.nodes.get(node_id)
        return None if node is None else ("lost" if node.lost else "alive")

    @contextmanager
    def _change(self, job: str | None) -> Iterator[Txn]:
        """One change: ``txn`` committed, then ``on_change(job)`` unless it wrote nothing (nothing changed)."""
        self._state_thread()
        txn = Txn()
        committed = False
        try:
            yield txn
            self.store.commit(txn)
            committed = True
        except Unavailable:  # the database refused the write: memory is ahead of it, reload
            logger.warning("state write failed; reloading state from %s", self.store.path)
            with contextlib.suppress(Exception):
                self._load()
            raise
        except KnitTransError:
            raise  # validation failures happen before any mutation
        except BaseException:
            logger.exception("state change failed; reloading state from %s", self.store.path)
            self._load()
            raise
        finally:
            if not committed:  # a meta record put in the failed change was never written
                for state in self.jobs.values():
                    state.meta_saved = None
            if job is not None and (len(txn) or not committed):
                self.on_change(job)
            elif not committed:  # a failed node-level change may have reloaded every job
                for name in list(self.jobs):
                    self.on_change(name)
            if committed:  # after publishing: the WAL copy waits behind no manifest
                self.store.checkpoint_if_due()

    def _apply(self, name: str, change: Callable[[JobState, Txn], T]) -> tuple[T, list[int]]:
        """``change(job, txn)`` and the admission it allows in one change, then what the job admits after it
        (:meth:`_admit_rest`); returns the change's result and every mini-batch admitted."""
        job = self.job(name)
        with self._change(name) as txn:
            result = change(job, txn)
            admitted = job.admit(txn)
        return result, self._admit_rest(name, admitted)

    def _admit_rest(self, name: str, admitted: list[int]) -> list[int]:
        """``admitted`` (what the change just committed admitted: at most one mini-batch) and those the job admits
        after it, one change each: every manifest is committed and published before the next one is formed, so
        the ranks waiting for the first do not wait for the others' admission."""
        admitted, job = list(admitted), self.jobs[name]
        more = admitted
        while more and job.may_admit_next():  # no change at all when the lookahead is reached (the usual case)
            with self._change(name) as txn:
                more = job.admit(txn)
            admitted += more
        return admitted

    def job(self, name: str) -> JobState:
        """The job called ``name``; :class:`NotFound` otherwise."""
        self._state_thread()
        found = self.jobs.get(name)
        if found is None:
            raise NotFound(f"job {name!r} does not exist; create it with POST /v1/jobs")
        return found

    # ------------------------------------------------------------------ nodes
    @property
    def heartbeat_s(self) -> float:
        """Seconds between a node's heartbeats that this control plane asks for (each node answer carries it):
        :data:`HEARTBEATS_PER_TIMEOUT` of them fit in ``node_timeout_s``."""
        return self.settings.node_timeout_s / HEARTBEATS_PER_TIMEOUT

    def register_node(
        self, node_id: str, endpoint: str, host: str, *, node_key: str | None = None, admin: bool = False
    ) -> dict[str, Any]:
        """Register (or re-register, reviving a lost) store node; returns its public record.

        Authority: the first registration binds the node's own credential ``node_key`` (kept as a
        SHA-256 hash). Moving a registered node to another endpoint needs that same key or
        ``admin`` (the request carried the admin token); anyone else gets :class:`Unauthenticated`,
        so a worker-token holder cannot point manifests, and the store token, at a server of theirs.
        """
        now = time.time()
        old = self.nodes.get(node_id)
        presented = hashlib.sha256(node_key.encode()).hexdigest() if node_key else ""
        key_hash = presented
        if old is not None:
            own = bool(old.key_hash) and hmac.compare_digest(old.key_hash, presented)
            if old.endpoint != endpoint and not (admin or own):
                raise Unauthenticated(
                    f"node {node_id!r} is registered at {old.endpoint}; moving it to {endpoint} needs the admin "
                    "token or the node's own node_key"
                )
            if old.key_hash and not (own or (admin and presented)):
                key_hash = old.key_hash  # the bound key stays unless an admin binds another: keyless never unbinds
        node = Node(
            node_id=node_id,
            endpoint=endpoint,
            host=host,
            registered_at=old.registered_at if old else now,
            last_heartbeat=now,
            key_hash=key_hash,
        )
        with self._change(None) as txn:
            self.nodes[node_id] = node
            txn.put(Kind.NODE, "", node_id, node.to_json())
        if old is not None and old.endpoint != endpoint:
            for job in self.jobs.values():
                job.forget_rendered()
                self.on_change(job.name)  # its manifests name the old endpoint
        return node.public(now, self.heartbeat_s)

    def heartbeat(self, node_id: str) -> dict[str, Any]:
        """Record a heartbeat of ``node_id``; a lost node must register again."""
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered; POST /v1/nodes first")
        if node.lost:
            raise Conflict(f"node {node_id!r} was declared lost ({node.lost_reason}); register it again")
        node.last_heartbeat = time.time()
        return node.public(node.last_heartbeat, self.heartbeat_s)

    def list_nodes(self) -> list[dict[str, Any]]:
        """Every node, after declaring timed-out ones lost."""
        self.sweep()
        now = time.time()
        return [n.public(now, self.heartbeat_s) for n in sorted(self.nodes.values(), key=lambda n: n.node_id)]

    def declare_lost(self, node_id: str, reason: str = "declared lost by an admin") -> dict[str, Any]:
        """Mark ``node_id`` lost: drop its unadmitted groups, re-plan untouched mini-batches with its rows."""
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered")
        withdrawn: dict[str, list[int]] = {}
        if not node.lost:
            with self._change(None) as txn:
                node.lost, node.lost_reason = True, reason
                txn.put(Kind.NODE, "", node_id, node.to_json())
                for job in self.jobs.values():
                    withdrawn[job.name] = job.node_lost(node_id, txn)
                    job.admit_all(txn)  # the withdrawn mini-batches' new attempts, published together
            for name in self.jobs:
                self.on_change(name)
            logger.warning("node %s lost (%s)", node_id, reason)
        return {**node.public(time.time(), self.heartbeat_s), "withdrawn": withdrawn}

    def sweep(self, *, paused_s: float = 0.0) -> None:
        """Declare lost every node whose last heartbeat is older than ``node_timeout_s``.

        ``paused_s`` > 0 says the caller itself was paused that long: heartbeats may be queued
        behind the pause, so every node gets a fresh grace period instead of being judged now.
        """
        self._state_thread()
        now = time.time()
        if paused_s > 0:
            logger.warning("node sweep ran %.1fs late; giving every node a fresh heartbeat grace period", paused_s)
            for n in self.nodes.values():
                n.last_heartbeat = max(n.last_heartbeat, now)
        timeout = self.settings.node_timeout_s
        for node_id in [n.node_id for n in self.nodes.values() if not n.lost and now - n.last_heartbeat > timeout]:
            self.declare_lost(node_id, f"no heartbeat for {timeout:g}s")

    # ------------------------------------------------------------------ jobs
    def create_job(self, spec: JobSpec) -> tuple[dict[str, Any], bool]:
        """Create a job; the same spec again is a no-op. Returns ``(job, created)``."""
        old = self.jobs.get(spec.name)
        if old is not None:
            if old.spec.to_dict() != spec.to_dict():
                raise Conflict(f"job {spec.name!r} already exists with a different spec")
            return self.get_job(spec.name), False
        with self._change(spec.name) as txn:
            job = self._new_job(spec)
            self.jobs[spec.name] = job
            job.admit(txn)  # a job without units admits nothing: this writes its record
        return self.get_job(spec.name), True

    def get_job(self, name: str) -> dict[str, Any]:
        """Spec and lifecycle of a job."""
        job = self.job(name)
        step = job.next_n // job.K
        return {
            "spec": job.spec.to_dict(),
            "state": job.state,
            "next_global_index": job.next_n,
            "quotas": job.quotas_for_step(step),
            "quota_changes": [{"from_step": s, "quotas": q} for s, q in job.quota_changes],
            "version": job.version,
        }

    def update_quotas(self, name: str, quotas: Mapping[str, int]) -> dict[str, Any]:
        """New quotas from the next train step on."""
        from_step, _ = self._apply(name, lambda job, txn: job.update_quotas(quotas))
        return {**self.get_job(name), "effective_from_step": from_step}

    def set_state(self, name: str, action: JobAction) -> dict[str, Any]:
        """``pause``, ``resume`` or ``drain`` a job."""
        self._apply(name, lambda job, txn: job.set_state(action, txn))
        return self.get_job(name)

    # ------------------------------------------------------------------ units, supply
    def register_units(self, name: str, units: Sequence[UnitDescriptor]) -> dict[str, Any]:
        """Register a batch of units atomically (all or none); runs admission."""
        new, admitted = self._apply(name, lambda job, txn: job.add_units(units, txn))
        self.units_registered += new
        return {"registered": new, "duplicates": len(units) - new, "admitted": admitted}

    def remove_unit(self, name: str, unit_id: str, reason: str) -> dict[str, Any]:
        """Admin repair: take a bad unit out of scheduling (its unadmitted groups are regenerated)."""
        removed, admitted = self._apply(name, lambda job, txn: job.remove_unit(unit_id, reason, txn))
        logger.warning(
            "job %s: unit %s removed by an admin (%s); groups to regenerate: %s", name, unit_id, reason, removed
        )
        return {"unit_id": unit_id, "removed_groups": removed, "admitted": admitted}

    def report_supply(self, name: str, **report: Any) -> dict[str, Any]:
        """Count groups started or dropped per source (``report``: the keyword arguments of
        :meth:`~knittrans.api.supply.Supply.add_supply`); runs admission."""
        applied, admitted = self._apply(name, lambda job, txn: job.add_supply(txn, **report))
        return {"applied": applied, "pending": self.jobs[name].pending(), "admitted": admitted}

    # ------------------------------------------------------------------ mini-batches
    def published(self, name: str) -> Published | None:
        """What ``GET .../minibatches/{n}`` serves for job ``name`` now; None when the job does not exist."""
        self._state_thread()
        job = self.jobs.get(name)
        return None if job is None else job.published()

    def progress(self, name: str) -> dict[str, Any]:
        """Trainer position and the fetched and acked ranks of each in-flight mini-batch."""
        return self.job(name).progress()

    def fetched(self, name: str, n: int, attempt: int, ranks: Sequence[int] | None) -> dict[str, Any]:
        """Report ``ranks`` fetched (:meth:`~knittrans.api.delivery.Delivery.fetched`)."""
        job = self.job(name)
        with self._change(name) as txn:
            return job.fetched(n, attempt, ranks, txn)

    def ack(
        self,
        name: str,
        n: int,
        attempt: int,
        ranks: Sequence[int] | None,
        version: int | None = None,
        *,
        figures: Collection[int] = (),
    ) -> dict[str, Any]:
        """Ack mini-batch ``n`` (:meth:`~knittrans.api.delivery.Delivery.ack`), then run admission."""
        job = self.job(name)
        with self._change(name) as txn:
            result = job.ack(n, attempt, ranks, version, txn, figures=figures)
            admitted = job.admit(txn) if not result["duplicate"] or version is not None else []
        self._admit_rest(name, admitted)
        return result

    def report_version(self, name: str, rank: int, version: int) -> dict[str, Any]:
        """Record a rank's policy version; runs admission."""
        self._apply(name, lambda job, txn: job.report_version(rank, version, txn))
        return self.get_version(name)

    def headroom(self, name: str) -> dict[str, Any]:
        """What rollout may launch now: room under the window, untaken groups, launch order."""
        return self.job(name).headroom()

    def get_version(self, name: str) -> dict[str, Any]:
        """Latest policy version (what rollout workers should generate with)."""
        job = self.job(name)
        return {"version": job.version, "by_rank": {str(r): v for r, v in sorted(job.rank_versions.items())}}

    def status(self, name: str) -> dict[str, Any]:
        """Job status: step, quota fill, counts, deficits, groups to regenerate, staleness, admissions."""
        self.sweep()
        return job_status(self.job(name))
