"""Node-local unit store: zero-copy reads, budget backpressure, spill, delete, rescan."""

from __future__ import annotations

import sys
import threading
import time
import weakref
from pathlib import Path

import pyarrow as pa
import pytest
from data_support import make_groups, store_unit, unit_bytes

from knittrans.errors import Conflict, InvalidName, InvalidRequest, NotFound, OverBudget, SchemaMismatch
from knittrans.procs import wait_until
from knittrans.schema import build_unit_tables
from knittrans.store import LocalReader, SealSpec, StoreConfig, UnitStore
from knittrans.store.unit import MEDIA_FILE, TRAJ_FILE, SealedUnit, write_table
from knittrans.tickets import Ticket, UnitRead


def _tables(seed: int = 0, n: int = 3):  # type: ignore[no-untyped-def]
    return build_unit_tables(make_groups(n, 4, seed=seed, prefix=f"s{seed}g"))


def _buffer_span(table: pa.Table) -> tuple[int, int]:
    bufs = [b for col in table.columns for ch in col.chunks for b in ch.buffers() if b is not None]
    return min(b.address for b in bufs), max(b.address + b.size for b in bufs)


def test_reads_are_zero_copy_slices_of_the_memory_map(store_dir: Path) -> None:
    """Row ranges and projections point into the unit's mapped file and equal the source rows."""
    store = UnitStore(StoreConfig(root=store_dir))
    t = _tables()
    unit = store_unit(store, "job", "u1", t)
    assert (store_dir / "job" / "u1" / "traj.arrow").exists()
    lo, hi = _buffer_span(unit.traj)
    got = store.read(
        Ticket(
            job="job", reads=(UnitRead(unit_id="u1", row_ranges=((2, 5), (7, 9))),), columns=("response_ids", "reward")
        )
    )
    assert got.column_names == ["response_ids", "reward"]
    expected = pa.concat_tables([t.traj.slice(2, 3), t.traj.slice(7, 2)]).select(["response_ids", "reward"])
    assert got.equals(expected)
    g_lo, g_hi = _buffer_span(got)
    assert lo <= g_lo and g_hi <= hi  # no copy: the result's buffers live in the mapped file
    with pytest.raises(InvalidRequest, match="has 12 rows; row range \\[10, 20\\) is out of range"):
        store.read(Ticket(job="job", reads=(UnitRead(unit_id="u1", row_ranges=((10, 20),)),)))
    with pytest.raises(InvalidRequest, match="no columns \\['nope'\\]"):
        store.read(Ticket(job="job", reads=(UnitRead(unit_id="u1"),), columns=("nope",)))


def test_names_are_validated_and_duplicates_refused(store_dir: Path) -> None:
    """Path-traversal ids are InvalidName; a second unit with the same id is a Conflict."""
    store = UnitStore(StoreConfig(root=store_dir))
    t = _tables()
    with pytest.raises(InvalidName):
        store.begin("job", "../evil")
    with pytest.raises(InvalidName):
        store.begin("../job", "u")
    store_unit(store, "job", "u", t)
    with pytest.raises(Conflict, match="already exists"):
        store_unit(store, "job", "u", t)
    for job, unit_id, what in (("../job", "u", "job"), ("job", "../u", "unit_id")):  # not NotFound
        with pytest.raises(InvalidName, match=rf"^{what} '\.\./"):
            store.get(job, unit_id)
        with pytest.raises(InvalidName, match=rf"^{what} '\.\./"):
            store.delete(job, unit_id)
    assert not any(p.name.startswith(".") for p in (store_dir / "job").iterdir())


@pytest.mark.timing
def test_waiting_writer_proceeds_when_space_is_freed(store_dir: Path) -> None:
    """With a full budget a writer blocks; deleting a unit wakes it and its unit is sealed."""
    t = _tables(n=20)
    need = unit_bytes(t)
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=int(need * 1.5), wait_timeout_s=20))
    store_unit(store, "job", "a", t)
    done = threading.Event()

    def second() -> None:
        store_unit(store, "job", "b", t)
        done.set()

    thread = threading.Thread(target=second)
    thread.start()
    wait_until(lambda: store.budget.waiting == 1, timeout_s=20, what="the second writer waiting for space")
    assert not done.is_set() and store.stats()["units"] == 1  # backpressure: still waiting
    store.delete("job", "a")
    thread.join(10)
    assert done.is_set() and [u.unit_id for u in store.units()] == ["b"]
    assert store.budget.used == store.get("job", "b").num_bytes


@pytest.mark.timing
def test_full_budget_times_out_with_over_budget(store_dir: Path) -> None:
    """Without free space the writer gets OverBudget naming budget, use and need; nothing is left behind."""
    t = _tables()
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=200_000, wait_timeout_s=0.2))
    store_unit(store, "job", "a", t)
    big = _tables(seed=1, n=200)
    with pytest.raises(OverBudget, match="budget is only 200000 bytes"):
        store_unit(store, "job", "huge", big)
    mid = _tables(seed=2, n=30)
    with pytest.raises(OverBudget, match=r"budget of 200000 bytes stayed full for 0\.2s.*need \d+ more"):
        for i in range(10):
            store_unit(store, "job", f"m{i}", mid)
    assert store.stats()["pending"] == 0
    assert not [p for p in (store_dir / "job").iterdir() if p.name.startswith(".")]


@pytest.mark.timing
def test_full_budget_spills_to_disk_directory(store_dir: Path, tmp_path: Path) -> None:
    """With a spill dir a unit that does not fit goes there, is readable and survives a rescan; deleting it
    gives back no budget (it held none)."""
    t = _tables(n=20)
    budget = int(unit_bytes(t) * 1.5)
    cfg = StoreConfig(root=store_dir, budget_bytes=budget, spill_dir=tmp_path / "spill", wait_timeout_s=0)
    store = UnitStore(cfg)
    store_unit(store, "job", "a", t)
    spilled = store_unit(store, "job", "b", t)
    assert spilled.spilled and spilled.path == tmp_path / "spill" / "job" / "b"
    assert store.read(Ticket(job="job", reads=(UnitRead(unit_id="b"),))).equals(t.traj)
    stats = store.stats()
    assert stats["bytes_spilled"] == spilled.num_bytes and stats["budget_used"] <= budget
    again = UnitStore(cfg)
    assert {u.unit_id: u.spilled for u in again.units()} == {"a": False, "b": True}
    assert again.budget.used == again.get("job", "a").num_bytes  # a spilled unit holds no budget
    assert (
        LocalReader([store_dir, tmp_path / "spill"])
        .read(Ticket(job="job", reads=(UnitRead(unit_id="b"),)))
        .equals(t.traj)
    )
    again.delete("job", "b")
    assert again.budget.used == again.get("job", "a").num_bytes and not spilled.path.exists()


def test_delete_removes_unit_and_frees_budget(store_dir: Path) -> None:
    """A deleted unit is gone from reads, disk and the budget; deleting it again is NotFound."""
    t = _tables()
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=10**8))
    store_unit(store, "job", "u", t)
    store.delete("job", "u")
    assert store.budget.used == 0 and not (store_dir / "job" / "u").exists()
    with pytest.raises(NotFound, match="unit 'u' of job 'job' is not on this node"):
        store.read(Ticket(job="job", reads=(UnitRead(unit_id="u"),)))
    with pytest.raises(NotFound):
        store.delete("job", "u")


def test_rescan_recovers_sealed_drops_temporaries_quarantines_corrupt(store_dir: Path) -> None:
    """A new store on the same directory serves every sealed unit, drops .tmp dirs, skips broken units."""
    store = UnitStore(StoreConfig(root=store_dir))
    tables = {f"u{i}": _tables(seed=i) for i in range(3)}
    for uid, t in tables.items():
        store_unit(store, "job", uid, t)
    half = store.begin("job", "half")
    half.write("traj", tables["u0"].traj.to_batches()[0])  # never sealed
    (store_dir / "job" / "broken").mkdir()
    (store_dir / "job" / "broken" / "traj.arrow").write_bytes(b"not arrow")
    (store_dir / "job" / "u2").rename(store_dir / "job" / "bad name")  # whole files, but not a unit id
    again = UnitStore(StoreConfig(root=store_dir))
    del tables["u2"]
    assert sorted(u.unit_id for u in again.units()) == ["u0", "u1"]
    for uid, t in tables.items():
        assert again.read(Ticket(job="job", reads=(UnitRead(unit_id=uid),))).equals(t.traj)
    names = sorted(p.name for p in (store_dir / "job").iterdir())
    assert not any(n.startswith(".tmp-") for n in names)
    assert any(n.startswith(".corrupt-broken-") for n in names) and "broken" not in names
    assert any(n.startswith(".corrupt-bad name-") for n in names) and "bad name" not in names
    assert again.stats()["recovered"] == 2 and again.stats()["quarantined"] == 2
    assert again.budget.used == sum(u.num_bytes for u in again.units())  # recovered units hold budget
    assert UnitStore(StoreConfig(root=store_dir)).stats()["quarantined"] == 0  # quarantined stays put


def test_unit_files_must_be_whole_ipc_files(tmp_path: Path) -> None:
    """A unit reads as the whole IPC file says; stream-format, cut or foreign files are refused."""
    t = _tables(n=4)
    unit_dir = tmp_path / "u"
    unit_dir.mkdir()
    write_table(unit_dir / TRAJ_FILE, pa.Table.from_batches(t.traj.to_batches(max_chunksize=3)))
    write_table(unit_dir / MEDIA_FILE, t.media)
    whole = (unit_dir / TRAJ_FILE).read_bytes()
    unit = SealedUnit.open("job", "u", unit_dir)
    assert unit.traj.equals(pa.ipc.open_file(pa.py_buffer(whole)).read_all()) and unit.traj.equals(t.traj)
    assert unit.media.equals(t.media) and unit.traj.num_rows == t.traj.num_rows
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.traj.schema) as writer:
        writer.write_table(t.traj)
    footer_len = int.from_bytes(whole[-10:-6], "little")
    broken = {  # what: (bytes, why it is refused)
        "stream format": (sink.getvalue().to_pybytes(), "no Arrow file magic"),
        "cut footer": (whole[:-3], "no Arrow file magic"),
        "bad footer length": (
            whole[:-10] + (len(whole)).to_bytes(4, "little") + whole[-6:],
            f"footer length {len(whole)} does not fit",
        ),
        "footer dropped": (whole[: -10 - footer_len] + whole[-10:], ""),
        "too short": (whole[:12], "12 bytes is too short"),
        "shorter than a magic": (whole[:3], "3 bytes is too short"),
    }
    for what, (data, why) in broken.items():
        (unit_dir / TRAJ_FILE).write_bytes(data)
        with pytest.raises(SchemaMismatch, match=rf"traj\.arrow is not a readable Arrow IPC file: .*{why}"):
            SealedUnit.open("job", "u", unit_dir)
            pytest.fail(f"{what} was read")
    write_table(unit_dir / TRAJ_FILE, t.media)  # a whole IPC file, but of media
    with pytest.raises(SchemaMismatch, match="expected 'trajectories'"):
        SealedUnit.open("job", "u", unit_dir)


def test_media_by_hash_each_once(store_dir: Path) -> None:
    """A media ticket returns each requested hash once, from whichever unit holds it."""
    store = UnitStore(StoreConfig(root=store_dir))
    t = _tables()
    store_unit(store, "job", "u", t)
    hashes = [h.hex() for h in t.media.column("media_hash").to_pylist()]
    got = store.read(Ticket(job="job", kind="media", media_hashes=(hashes[1], hashes[0], hashes[1])))
    assert got.column("media_hash").to_pylist() == [bytes.fromhex(hashes[1]), bytes.fromhex(hashes[0])]
    with pytest.raises(NotFound, match=r"media hash 0{64} is in none of the units"):
        store.read(Ticket(job="job", kind="media", media_hashes=("0" * 64,)))


def test_store_settings_that_do_not_go_together_are_refused(store_dir: Path) -> None:
    """A spill directory that is the store directory, a budget that is not positive, a negative wait or a
    pending lifetime that is not positive are refused when the config is made."""
    for kw, why in [
        ({"spill_dir": store_dir / "." / "job" / ".."}, "spill_dir must differ from root"),
        ({"budget_bytes": 0}, "budget_bytes must be positive or None, not 0"),
        ({"wait_timeout_s": -1.0}, "wait_timeout_s must be >= 0 and pending_ttl_s > 0"),
        ({"pending_ttl_s": 0.0}, "wait_timeout_s must be >= 0 and pending_ttl_s > 0"),
    ]:
        with pytest.raises(ValueError, match=why):
            StoreConfig(root=store_dir, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spill_dir must differ from root"):  # given as strings too
        StoreConfig(root=str(store_dir), spill_dir=f"{store_dir}/.")  # type: ignore[arg-type]


def test_store_directories_may_be_given_as_strings(store_dir: Path) -> None:
    """``root`` and ``spill_dir`` given as strings (a script's or a config file's) are paths, and the store
    works on them."""
    cfg = StoreConfig(root=str(store_dir), spill_dir=str(store_dir.parent / "spill"))  # type: ignore[arg-type]
    assert cfg.root == store_dir and cfg.spill_dir == store_dir.parent / "spill"
    store = UnitStore(cfg)
    store_unit(store, "job", "u", _tables())
    assert [u.unit_id for u in store.units("job")] == ["u"]


def test_rescan_ignores_directories_that_are_not_jobs(store_dir: Path) -> None:
    """A directory of the store (or spill) directory whose name is no job name (a disk's ``lost+found``) is
    left alone, and the jobs beside it are recovered."""
    store = UnitStore(StoreConfig(root=store_dir))
    store_unit(store, "job", "u0", _tables())
    (store_dir / "lost+found" / "u9").mkdir(parents=True)
    again = UnitStore(StoreConfig(root=store_dir))
    assert [u.unit_id for u in again.units()] == ["u0"] and again.stats()["quarantined"] == 0
    assert (store_dir / "lost+found" / "u9").is_dir()


def test_local_reader_serves_a_media_ticket_naming_no_units_from_every_unit_of_its_job(
    store_dir: Path, tmp_path: Path
) -> None:
    """A media ticket without units reads the media of every sealed unit of its job, in memory or spilled, as the
    store does; temporaries and other jobs are not looked at."""
    spill = tmp_path / "spill"
    store = UnitStore(StoreConfig(root=store_dir))
    a, b = _tables(seed=1), _tables(seed=2)
    store_unit(store, "job", "a", a)
    store_unit(UnitStore(StoreConfig(root=spill)), "job", "b", b)  # a unit of the spill directory
    (store_dir / "job" / ".tmp-c-0000").mkdir()
    store_unit(store, "other", "x", _tables(seed=3))
    hashes = tuple(h.hex() for t in (b, a) for h in t.media.column("media_hash").to_pylist())
    ticket = Ticket(job="job", kind="media", media_hashes=hashes)
    got = LocalReader([store_dir, spill]).read(ticket)
    assert got.column("media_hash").to_pylist() == [bytes.fromhex(h) for h in dict.fromkeys(hashes)]
    assert len(set(hashes)) > b.media.num_rows  # units of both directories were read
    reader = LocalReader([store_dir])
    for job, unit_id in (("../other", "x"), ("other", "../job")):  # names are never paths out of the directories
        with pytest.raises(InvalidName):
            reader.unit(job, unit_id)
    kept = reader.unit("job", "a")
    assert reader.unit("job", "a") is kept  # opened once, then served from the cache
    unit = weakref.ref(kept)
    del kept
    store.delete("job", "a")
    with pytest.raises(NotFound, match=r"unit 'a' of job 'job' is not in \["):
        reader.unit("job", "a")
    assert unit() is None  # the reader let go of the deleted unit's mapped pages
    with pytest.raises(NotFound, match="is in none of the units"):
        LocalReader([store_dir, spill]).read(Ticket(job="other", kind="media", media_hashes=hashes[:1]))


def test_a_unit_is_sealed_only_whole_and_without_a_stream_writing(store_dir: Path) -> None:
    """Sealing a unit one of whose parts a stream is still writing is refused and leaves it as it is; a unit
    with media but no trajectory rows is refused and dropped."""
    store = UnitStore(StoreConfig(root=store_dir))
    t = _tables()
    pending, token = store.open_part("job", "u", "traj")
    pending.write("traj", t.traj.to_batches()[0], token=token)
    with pytest.raises(Conflict, match=r"cannot be sealed: parts \['traj'\] are still being written"):
        store.seal_units("job", [SealSpec(unit_id="u")])
    store.close_part(pending, "traj", token, ok=True)
    assert store.seal_units("job", [SealSpec(unit_id="u")])[0].num_rows == t.traj.to_batches()[0].num_rows
    media, token = store.open_part("job", "m", "media")
    media.write("media", t.media.to_batches()[0], token=token)
    store.close_part(media, "media", token, ok=True)
    with pytest.raises(InvalidRequest, match="unit 'm' has no trajectory rows; nothing to seal"):
        store.seal_units("job", [SealSpec(unit_id="m")])
    assert store.stats()["pending"] == 0 and store.budget.used == store.get("job", "u").num_bytes


def test_a_unit_left_unsealed_past_its_lifetime_is_aborted_when_the_next_begins(store_dir: Path) -> None:
    """A pending unit older than ``pending_ttl_s`` (its writer went away) is aborted, its files and budget given
    back, when the next unit begins; a stream still holding it is told so."""
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=1 << 30, pending_ttl_s=0.05))
    t = _tables()
    old, token = store.open_part("job", "old", "traj")
    old.write("traj", t.traj.to_batches()[0], token=token)
    assert store.budget.used > 0 and old.dir is not None and old.dir.is_dir()
    time.sleep(0.1)
    store.begin("job", "new")
    assert old.discarded and not old.dir.exists() and store.budget.used == 0
    assert store.stats()["pending"] == 1
    with pytest.raises(Conflict, match="was aborted while being written"):
        old.write("traj", t.traj.to_batches()[0], token=token)


def test_a_pending_unit_is_charged_for_every_batch_and_refuses_a_claim_once_aborted(store_dir: Path) -> None:
    """Each batch after a unit's first reserves its own bytes; an aborted unit takes no new stream."""
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=10**8))
    first, second = _tables().traj.to_batches(max_chunksize=5)[:2]
    pending = store.begin("job", "u")
    pending.write("traj", first)
    used = store.budget.used
    pending.write("traj", second)
    assert store.budget.used == used + pa.ipc.get_record_batch_size(second)
    store.abort("job", "u")
    assert store.budget.used == 0
    with pytest.raises(Conflict, match="was aborted; start it again"):
        pending.claim("traj")


def test_a_failed_stream_gives_back_its_part_and_a_stale_token_changes_nothing(store_dir: Path) -> None:
    """A failing stream drops its part's file, bytes and budget; a stale token neither writes nor ends the part
    another stream took; a batch of another schema is refused; an abort gives back exactly what is left."""
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=10**8))
    t = _tables()
    held = store_unit(store, "job", "a", t).num_bytes
    pending = store.begin("job", "u")
    media = pending.claim("media")
    pending.write("media", t.media.to_batches()[0], token=media)
    used = store.budget.used
    traj = pending.claim("traj")
    pending.write("traj", t.traj.to_batches()[0], token=traj)
    assert pending.received["traj"] > 0 and store.budget.used > used
    assert not pending.release("traj", traj, ok=False)  # the media stream still holds the unit
    assert store.budget.used == used and pending.received["traj"] == 0
    assert pending.dir is not None and not (pending.dir / TRAJ_FILE).exists()
    again = pending.claim("traj")
    with pytest.raises(Conflict, match="is now written by another stream"):
        pending.write("traj", t.traj.to_batches()[0], token=traj)
    pending.release("traj", traj, ok=False)  # the failed stream's token: it owns nothing now
    pending.write("traj", t.traj.to_batches()[0], token=again)
    pending.release("traj", again, ok=False)
    assert store.budget.used == used
    with pytest.raises(SchemaMismatch, match="expected 'trajectories'"):
        pending.write("traj", t.media.to_batches()[0])
    with pytest.raises(SchemaMismatch, match="batch schema changed within part 'media'"):
        pending.write("media", t.traj.to_batches()[0])
    store.abort("job", "u")
    assert store.budget.used == held


def test_a_stream_that_ends_after_its_unit_was_aborted_gives_back_nothing_twice(store_dir: Path) -> None:
    """The abort gave the unit's budget back: the failing stream's end releases none of it again."""
    store = UnitStore(StoreConfig(root=store_dir, budget_bytes=10**8))
    t = _tables()
    held = store_unit(store, "job", "a", t).num_bytes
    pending, token = store.open_part("job", "u", "traj")
    pending.write("traj", t.traj.to_batches()[0], token=token)
    store.abort("job", "u")  # e.g. the other part's stream was refused, or the unit outlived pending_ttl_s
    with pytest.raises(Conflict, match="was aborted while being written"):
        pending.write("traj", t.traj.to_batches()[0], token=token)
    store.close_part(pending, "traj", token, ok=False)
    assert store.budget.used == held
    store.abort("job", "u")  # no such unit now: nothing to do
    again = store.begin("job", "u")
    store.abort("job", "u", only=pending)  # aborts only that (older) unit of this id
    assert not again.discarded and store.stats()["pending"] == 1


def test_a_stream_whose_unit_is_aborted_while_it_opens_begins_the_unit_afresh(store_dir: Path) -> None:
    """A unit aborted between ``open_part`` finding it pending and claiming its part (a race with another stream's
    failure or the unit's lifetime) is begun again for the opening stream, instead of failing it."""
    store = UnitStore(StoreConfig(root=store_dir))
    old = store.begin("job", "u")
    got: list[object] = []
    opener = threading.Thread(target=lambda: got.append(store.open_part("job", "u", "traj")))
    with old.lock:  # the opener finds ``old`` pending, then waits for its lock in ``claim``
        opener.start()
        frames = sys._current_frames

        def in_claim() -> bool:
            frame = frames().get(opener.ident or 0)
            return frame is not None and frame.f_code.co_name == "claim"

        wait_until(in_claim, timeout_s=10, what="the opener to wait in claim")
        store.abort("job", "u")
    opener.join(10)
    ((pending, token),) = got
    assert pending is not old and not pending.discarded and old.discarded
    pending.write("traj", _tables().traj.to_batches()[0], token=token)
    store.close_part(pending, "traj", token, ok=True)
    assert store.seal_units("job", [SealSpec(unit_id="u")])[0].num_rows == 12
