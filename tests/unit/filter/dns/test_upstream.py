"""The upstream sockets' pure core (`Book`): IDs, matching replies to questions, rotation,
as transcripts without sockets (tests/integration/filter/test_upstream.py: on loopback)."""

from __future__ import annotations

import pytest
from dnslib import EDNS0, QTYPE, RR, DNSRecord

from appliance.filter.dns import reply as replies
from appliance.filter.dns import upstream
from appliance.filter.dns.reply import Question, labels_of
from appliance.filter.dns.upstream import Book

A = QTYPE.A
WWW = labels_of("www.example.com")


def scripted(*ids: int):
    """A random source that returns `ids` in order (16 bits asked each time)."""
    it = iter(ids)

    def random(bits: int) -> int:
        assert bits == 16
        return next(it)
    return random


def reply(question: Question, *lines: str, qid: int | None = None, name: str | None = None,
          qtype: str | None = None, qr: bool = True) -> bytes:
    record = DNSRecord.question(name or ".".join(x.decode() for x in question.labels),
                                qtype or QTYPE.get(question.qtype))
    answer = record.reply()
    answer.header.id = question.id if qid is None else qid
    answer.header.qr = int(qr)
    for line in lines:
        answer.add_answer(*RR.fromZone(line))
    return answer.pack()


def test_each_question_gets_a_random_id_none_outstanding_on_its_socket_holds():
    book = Book(0.0, scripted(5, 5, 5, 7, 5))
    first = book.ask(WWW, A, "first")
    second = book.ask(WWW, A, "second")  # 5 is taken: drawn again until free
    assert (first.id, second.id) == (5, 7)
    book.forget(first, "first")
    assert book.ask(WWW, A, "third").id == 5  # freed, so drawn again
    assert book.asked == 3 and set(book.outstanding) == {5, 7}


def test_a_reply_is_accepted_only_for_its_outstanding_question_and_then_forgotten():
    book = Book(0.0, scripted(0x1234, 0x4321))
    www = book.ask(WWW, A, "www")
    real = reply(www, "www.example.com. 60 IN A 192.0.2.1")
    spoofs = [
        reply(www, "www.example.com. 60 IN A 203.0.113.66", qid=0x1235),  # wrong ID
        reply(www, "evil.example. 60 IN A 203.0.113.66", name="evil.example"),  # question
        reply(www, "www.example.com. 60 IN AAAA 2001:db8::66", qtype="AAAA"),  # its type
        reply(www, "www.example.com. 60 IN A 203.0.113.66", qr=False),  # not a response
        real[:40],  # cut off
        b"\x12\x34",  # no header
    ]
    for spoof in spoofs:
        assert book.receive(spoof) is None
    assert book.strays == len(spoofs) and 0x1234 in book.outstanding  # still waits
    token, answer = book.receive(real)
    assert token == "www" and str(answer.records[0].address) == "192.0.2.1"
    assert not book.outstanding
    assert book.receive(real) is None and book.strays == len(spoofs) + 1  # a late duplicate


def test_a_timed_out_question_frees_its_id_and_its_late_reply_is_a_stray():
    book = Book(0.0, scripted(9, 9))
    late = book.ask(WWW, A, "late")
    book.forget(late, "late")
    assert not book.outstanding
    assert book.receive(reply(late, "www.example.com. 60 IN A 192.0.2.1")) is None
    again = book.ask(labels_of("other.example"), A, "again")
    assert again.id == 9
    book.forget(late, "late")  # the old question's owner, cleaning up late: not its ID now
    assert book.outstanding[9][1] == "again"


def test_a_socket_is_retired_after_so_many_questions_or_seconds_or_an_error():
    book = Book(100.0)
    assert not book.retired(100.0)
    for _ in range(upstream.ROTATE_QUERIES - 1):
        book.forget(book.ask(WWW, A, "t"), "t")
    assert not book.retired(100.0)
    book.ask(WWW, A, "t")
    assert book.retired(100.0)
    aged = Book(100.0)
    assert not aged.retired(100.0 + upstream.ROTATE_SECONDS - 0.001)
    assert aged.retired(100.0 + upstream.ROTATE_SECONDS)
    broken = Book(100.0)
    broken.broken = True
    assert broken.retired(100.0)


def test_a_socket_holds_at_most_so_many_questions_outstanding(monkeypatch):
    monkeypatch.setattr(upstream, "OUTSTANDING_MAX", 3)
    book = Book(0.0)
    for i in range(3):
        book.ask(WWW, A, i)
    assert book.full
    with pytest.raises(ValueError, match="3 questions outstanding"):
        book.ask(WWW, A, "one too many")


@pytest.mark.parametrize(("name", "qtype"), [
    ("www.example.com", "A"), ("Mixed.Case.Example.", "AAAA"), ("bücher.example", "TXT"),
    ("a" * 63 + ".example", "MX"),
])
def test_a_question_is_packed_as_dnslib_packs_it(name, qtype):
    query = DNSRecord.question(name.lower(), qtype)
    query.header.id = 0xBEEF
    query.add_ar(EDNS0(udp_len=replies.EDNS_SIZE))
    assert Question(0xBEEF, labels_of(name), getattr(QTYPE, qtype)).pack() == query.pack()


@pytest.mark.parametrize("name", ["a..example", "a" * 64 + ".example",
                                  ".".join(["abcdefg"] * 32), "\udcff.example"])
def test_a_name_no_query_can_carry_is_refused_before_anything_is_sent(name):
    with pytest.raises(ValueError, match="cannot ask for"):
        labels_of(name)
