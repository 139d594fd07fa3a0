"""Read a rank's whole share through one ``DoGet`` per store node and kind, micro-batch by micro-batch."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import pyarrow as pa

from knittrans.errors import DataLost, InvalidRequest, KnitTransError, NotFound
from knittrans.manifest import RankPlan
from knittrans.tickets import Ticket, join_tickets
from knittrans.trainer.fetch import Fetcher
from knittrans.trainer.media import MediaRecord

__all__ = ["ShareStreams", "media_records"]

logger = logging.getLogger(__name__)


def media_records(data: pa.Table | pa.RecordBatch) -> dict[str, MediaRecord]:
    """Rows of a media table or batch as ``{hex hash: MediaRecord}`` (payloads stay Arrow buffers)."""
    out: dict[str, MediaRecord] = {}
    for batch in data.to_batches() if isinstance(data, pa.Table) else [data]:
        hashes = batch.column("media_hash").to_pylist()
        kinds = batch.column("kind").to_pylist()
        shapes = batch.column("shape").to_pylist()
        dtypes = batch.column("dtype").to_pylist()
        payload = batch.column("data")
        for j in range(batch.num_rows):
            out[hashes[j].hex()] = MediaRecord(kinds[j], shapes[j], dtypes[j], payload[j].as_buffer())
    return out


class _Call:
    """The batches of one call, being opened in the fetcher's pool; an error opening it is raised at the first
    read, and :meth:`close` cancels a call not read to its end."""

    def __init__(self, opening: Future[Iterator[pa.RecordBatch]], what: str) -> None:
        self._opening = opening
        self._batches: Iterator[pa.RecordBatch] | None = None
        self._what = what

    def _next(self) -> pa.RecordBatch | None:
        if self._batches is None:
            self._batches = self._opening.result()
        return next(self._batches, None)

    def close(self) -> None:
        if self._batches is None and not self._opening.cancel():
            try:
                self._batches = self._opening.result()
            except KnitTransError:
                return
        close = getattr(self._batches, "close", None)
        if close is not None:
            try:
                close()
            except ValueError:  # still running in a thread that did not stop in time
                logger.warning("%s: stream still in use, not cancelled", self._what)


class _RowTaker(_Call):
    """Consecutive row counts out of a call's batches; a batch is sliced where a count ends."""

    _rest: pa.RecordBatch | None = None
    taken = 0

    def take(self, n: int) -> list[pa.RecordBatch]:
        out: list[pa.RecordBatch] = []
        have = 0
        while have < n:
            batch = self._rest if self._rest is not None else self._next()
            self._rest = None
            if batch is None:
                raise DataLost(f"{self._what} ended after {self.taken + have} rows; {self.taken + n} were asked for")
            need = n - have
            if batch.num_rows > need:
                out.append(batch.slice(0, need))
                self._rest = batch.slice(need)
                have = n
            else:
                out.append(batch)
                have += batch.num_rows
        self.taken += n
        return out


class _MediaStream(_Call):
    """One node's media of the share, in first-use order; records that arrive early wait until asked for."""

    def __init__(self, opening: Future[Iterator[pa.RecordBatch]], what: str) -> None:
        super().__init__(opening, what)
        self._pending: dict[str, MediaRecord] = {}

    def get(self, media_hash: str) -> MediaRecord:
        while media_hash not in self._pending:
            batch = self._next()
            if batch is None:
                raise NotFound(f"media {media_hash} is not in {self._what}")
            self._pending.update(media_records(batch))
        return self._pending.pop(media_hash)


class ShareStreams:
    """One rank's share of a plan read as at most one rows and one media ``DoGet`` per store node, every call
    opened by the constructor (none for a share that reads nothing), so all of them flow from the start.

    Not thread-safe: one loader (the prefetch thread, or the training thread in ``eager`` mode)
    calls :meth:`rows` for micro-batches ``0, 1, ...`` in order and :meth:`media` as it goes.

    Raises:
        InvalidRequest: a rows ticket has no explicit row ranges (a manifest's shares never do); or, from
            :func:`~knittrans.tickets.join_tickets` (:class:`~knittrans.errors.InvalidTicket`), one node's
            tickets differ in kind, job or projection.
    """

    def __init__(self, fetcher: Fetcher, plan: RankPlan, *, media: bool = True) -> None:
        self._row_counts: list[list[tuple[str, int]]] = []
        rows: dict[str, list[Ticket]] = {}
        endpoints: dict[str, str] = {}
        for micro in plan.micro_batches:
            per_micro = []
            for f in micro.fetches:
                ticket, node = f.ticket, f.node_id
                sizes = [r.num_rows for r in ticket.reads]
                if ticket.kind != "rows" or None in sizes:
                    raise InvalidRequest(f"plan {plan.plan_id}: its rows tickets cannot be streamed (row ranges)")
                endpoints[node] = f.endpoint
                rows.setdefault(node, []).append(ticket)
                per_micro.append((node, sum(n or 0 for n in sizes)))
            self._row_counts.append(per_micro)
        media_of: dict[str, list[Ticket]] = {}
        self._media_node: dict[str, str] = {}
        for micro in plan.micro_batches if media else ():
            for m in micro.media:
                if m.hash in self._media_node:
                    continue
                self._media_node[m.hash] = m.node_id
                endpoints.setdefault(m.node_id, m.endpoint)
                media_of.setdefault(m.node_id, []).append(m.ticket)

        def stream(node: str, tickets: list[Ticket]) -> Future[Iterator[pa.RecordBatch]]:
            # Opened in parallel (each open is a round trip); a failure is raised by the first micro-batch
            # that reads this node, as with one call per micro-batch. The joined ticket carries its
            # tickets' grants once each (the manifest gives every ticket of a node the node's one grant).
            ticket = join_tickets(tickets)
            return fetcher.pool.submit(fetcher.stream, node, endpoints[node], ticket)

        self._rows = {n: _RowTaker(stream(n, ts), f"the rows stream of node {n}") for n, ts in rows.items()}
        self._media = {n: _MediaStream(stream(n, ts), f"the media stream of node {n}") for n, ts in media_of.items()}
        self.calls = len(self._rows) + len(self._media)
        """``DoGet`` calls (or local reads) opened."""
        self._next = 0

    def rows(self, i: int) -> pa.Table | None:
        """Rows of micro-batch ``i`` in plan order (None when it has none); ``i`` must be the next one."""
        if i != self._next:
            raise InvalidRequest(f"micro-batch {i} asked for out of order; the stream is at micro-batch {self._next}")
        self._next += 1
        batches = [b for node, n in self._row_counts[i] for b in self._rows[node].take(n)]
        if not batches:
            return None
        try:
            return pa.Table.from_batches(batches)
        except pa.ArrowInvalid as exc:
            raise InvalidRequest(f"micro-batch {i}: nodes return different columns: {exc}") from None

    def media(self, hashes: Sequence[str]) -> dict[str, MediaRecord]:
        """Records of ``hashes`` (a :class:`~knittrans.trainer.media.MediaCache` fetch function)."""
        out = {}
        for h in hashes:
            node = self._media_node.get(h)
            if node is None:
                raise InvalidRequest(f"media hash {h} is not in this share's plan")
            out[h] = self._media[node].get(h)
        return out

    def close(self) -> None:
        """Cancel every call that was not read to its end."""
        for rows in self._rows.values():
            rows.close()
        for media in self._media.values():
            media.close()
        self._rows, self._media = {}, {}
