"""Ticket envelope: strict decoding, clear errors, exact round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from knittrans.errors import InvalidTicket
from knittrans.tickets import MAX_TICKET_BYTES, MAX_TICKET_DEPTH, Ticket, UnitRead

names = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,15}", fullmatch=True)


@st.composite
def row_ranges(draw: st.DrawFn) -> tuple[tuple[int, int], ...]:
    cuts = sorted(set(draw(st.lists(st.integers(0, 10_000), max_size=8))))
    pairs = list(zip(cuts[::2], cuts[1::2], strict=False))
    return tuple((a, b) for a, b in pairs if b > a)


@given(
    job=names,
    units=st.lists(names, min_size=1, max_size=5, unique=True),
    ranges=row_ranges(),
    columns=st.one_of(st.none(), st.lists(names, min_size=1, max_size=4, unique=True)),
)
def test_rows_ticket_round_trips(
    job: str, units: list[str], ranges: tuple[tuple[int, int], ...], columns: list[str] | None
) -> None:
    """encode then decode gives back an equal ticket for any valid rows ticket."""
    t = Ticket(
        job=job,
        reads=tuple(UnitRead(unit_id=u, row_ranges=ranges) for u in units),
        columns=tuple(columns) if columns is not None else None,
    )
    assert Ticket.decode(t.encode()) == t


def test_media_ticket_round_trips() -> None:
    """a media ticket keeps its hashes and searched units."""
    t = Ticket(job="j", kind="media", reads=(UnitRead(unit_id="u1"),), media_hashes=("ab" * 32,))
    assert Ticket.decode(t.encode()) == t


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"v": 2, "job": "j", "reads": []}', "version 2"),
        (b'{"v": true, "job": "j", "reads": [{"unit": "u"}]}', "version True"),
        (b'{"v": 1.0, "job": "j", "reads": [{"unit": "u"}]}', "version 1.0"),
        (b'{"v": 1, "job": "j", "reads": [], "extra": 1}', "unknown fields"),
        (b'{"v": 1, "job": "../etc", "reads": [{"unit": "u"}]}', "job '../etc'"),
        (b'{"v": 1, "reads": [{"unit": "u"}]}', "job ''"),  # missing
        (b'{"v": 1, "job": 7, "reads": [{"unit": "u"}]}', "job 7"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "a/b"}]}', "unit_id 'a/b'"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "u", "rows": [[5, 2]]}]}', "[5, 2)"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "u", "rows": [[0, 4], [2, 6]]}]}', "overlap"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "u", "rows": [[0, "x"]]}]}', "not a pair of integers"),
        (b'{"v": 1, "job": "j", "reads": []}', "at least one read"),
        (b'{"v": 1, "kind": "media", "job": "j", "media": ["zz"]}', "64 lower-case hex"),
        (b'{"v": 1, "kind": "other", "job": "j", "reads": [{"unit": "u"}]}', "kind"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "u"}], "columns": []}', "columns"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "u"}], "columns": ["a", "a"]}', "duplicates"),
        (b'{"v": 1, "kind": "media", "job": "j", "reads": [{"unit": "u"}]}', "at least one media hash"),
        (b'{"v": 1, "job": "j", "reads": {"unit": "u"}}', "'reads' must be a list"),
        (b'{"v": 1, "job": "j", "reads": ["u"]}', "reads[0] must be an object"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "u", "rows": [0, 4]}]}', "reads[0].rows must be a list"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "u"}], "columns": "a"}', "'columns' must be a list"),
        (b'{"v": 1, "kind": "media", "job": "j", "media": "' + b"ab" * 32 + b'"}', "'media' must be a list"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "u"}], "grants": [7]}', "'grants' must be a list of strings"),
        (b'{"v": 1, "job": "j", "reads": [{"unit": "u"}], "media": ["' + b"ab" * 32 + b'"]}', "takes no media hashes"),
        (
            b'{"v": 1, "kind": "media", "job": "j", "media": ["' + b"ab" * 32 + b'"], "columns": ["a"]}',
            "takes no columns",
        ),
        (
            b'{"v": 1, "kind": "media", "job": "j", "reads": [{"unit": "u", "rows": [[0, 1]]}], "media": ["'
            + b"ab" * 32
            + b'"]}',
            "or row ranges",
        ),
    ],
)
def test_bad_tickets_name_the_problem(raw: bytes, needle: str) -> None:
    """every malformed ticket raises InvalidTicket whose message names what was wrong."""
    with pytest.raises(InvalidTicket, match=None) as info:
        Ticket.decode(raw)
    assert needle in str(info.value)


def test_oversized_ticket_is_refused() -> None:
    """a ticket above MAX_TICKET_BYTES is refused before parsing."""
    raw = json.dumps({"v": 1, "job": "j", "reads": [], "pad": "x" * MAX_TICKET_BYTES}).encode()
    with pytest.raises(InvalidTicket, match="more than"):
        Ticket.decode(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"v": 1, "job": "j", "reads": [{"unit": "u", "rows": [[[[[[[0, 1]]]]]]]}]}',
        b'{"v": 1, "job": "j", "reads": ' + b"[" * 500_000,
    ],
)
def test_deeply_nested_ticket_is_refused_before_parsing(raw: bytes) -> None:
    """A ticket nesting deeper than MAX_TICKET_DEPTH (100,000 levels, 9 levels, or only opening brackets) is
    refused by its depth, naming the limit, before the JSON parser sees it."""
    with pytest.raises(InvalidTicket, match=f"nests deeper than the {MAX_TICKET_DEPTH} levels allowed"):
        Ticket.decode(raw)


def test_a_ticket_at_the_depth_limit_with_brackets_in_strings_decodes() -> None:
    """Brackets inside strings do not count: a valid ticket whose column names are brackets decodes."""
    t = Ticket(job="j", reads=(UnitRead(unit_id="u", row_ranges=((0, 1),)),), columns=("[[[[[[[[[", "{{{{{{{{"))
    assert Ticket.decode(t.encode()) == t


def test_a_ticket_encodes_as_compact_json_with_only_the_fields_it_uses() -> None:
    """The wire bytes: version, kind, job and reads always; columns, media and grants only when the ticket has
    them (an unsigned rows ticket carries no grants key, a rows ticket no media key)."""
    reads = (UnitRead(unit_id="u", row_ranges=((0, 2), (5, 6))), UnitRead(unit_id="w"))
    plain = Ticket(job="j", reads=reads)
    assert (
        plain.encode()
        == b'{"v":1,"kind":"rows","job":"j","reads":[{"unit":"u","rows":[[0,2],[5,6]]},{"unit":"w","rows":[]}]}'
    )
    signed = Ticket(job="j", reads=reads[:1], columns=("reward",), grants=("g1", "g2"))
    assert signed.encode() == (
        b'{"v":1,"kind":"rows","job":"j","reads":[{"unit":"u","rows":[[0,2],[5,6]]}],"columns":["reward"],'
        b'"grants":["g1","g2"]}'
    )
    assert Ticket.decode(signed.encode()) == signed
    media = Ticket(job="j", kind="media", reads=(UnitRead(unit_id="w"),), media_hashes=("ab" * 32,))
    assert (
        media.encode()
        == b'{"v":1,"kind":"media","job":"j","reads":[{"unit":"w","rows":[]}],"media":["' + b"ab" * 32 + b'"]}'
    )


def test_a_read_counts_its_rows_and_a_ticket_reads_no_row_twice() -> None:
    """num_rows: the rows of the ranges, None for a whole unit; a ticket reading a unit whole and again (either
    order), or one row of a unit in two reads, is refused; other units' rows do not clash."""
    assert UnitRead(unit_id="u", row_ranges=((0, 2), (5, 8))).num_rows == 5
    assert UnitRead(unit_id="u").num_rows is None
    whole, part = UnitRead(unit_id="u"), UnitRead(unit_id="u", row_ranges=((3, 4),))
    for reads in [(whole, part), (part, whole), (whole, whole)]:
        with pytest.raises(InvalidTicket, match="unit 'u' is read whole and again in the same ticket"):
            Ticket(job="j", reads=reads)
    with pytest.raises(InvalidTicket, match="unit 'u': row 3 is read more than once"):
        Ticket(job="j", reads=(UnitRead(unit_id="u", row_ranges=((1, 4),)), part))
    other = UnitRead(unit_id="v", row_ranges=((3, 4),))
    assert Ticket(job="j", reads=(part, other, UnitRead(unit_id="u", row_ranges=((0, 3), (4, 5))))).reads[1] == other
