"""Per-session DNS limits and the exfiltration guard, with explicit times (no clock)."""

from __future__ import annotations

import math
import string

import pytest

from appliance.filter.dns.guard import ExfilGuard, Report, SessionLimits, entropy
from appliance.filter.ratelimit import TokenBucket
from appliance.sessionconfig import DnsConfig


def test_a_bucket_gives_its_burst_then_its_rate():
    bucket = TokenBucket(rate=10, burst=5, now=0.0)
    assert [bucket.take(0.0) for _ in range(6)] == [True] * 5 + [False]
    assert bucket.take(0.05) is False  # half a token
    assert bucket.take(0.1) is True
    assert [bucket.take(100.0) for _ in range(6)] == [True] * 5 + [False]  # never above burst


def test_sessions_have_a_bucket_each():
    limits = SessionLimits(rate=1, burst=2, max_pending=1, max_tcp=1)
    assert [limits.admit("s2", 0.0) for _ in range(3)] == [True, True, False]
    assert limits.admit("s1", 0.0) and limits.admit(None, 0.0)


def test_denied_names_have_a_bucket_of_their_own_per_session():
    limits = SessionLimits(rate=1, burst=1, max_pending=1, max_tcp=1, denied_rate=1,
                           denied_burst=2)
    assert [limits.admit_denied("s2", 0.0) for _ in range(3)] == [True, True, False]
    assert limits.admit("s2", 0.0)  # the general bucket is untouched
    assert limits.admit_denied("s1", 0.0) and limits.admit_denied("s2", 1.0)
    limits.forget({None, "s1"})
    assert set(limits.denied_buckets) == {"s1"}


def test_waiting_queries_and_tcp_connections_are_capped_per_session():
    limits = SessionLimits(rate=1, burst=1, max_pending=2, max_tcp=1)
    assert [limits.begin("s2") for _ in range(3)] == [True, True, False]
    assert limits.begin("s1")
    limits.end("s2")
    assert limits.begin("s2")
    assert [limits.open_tcp("s2"), limits.open_tcp("s2"), limits.open_tcp("s1")] == [
        True, False, True]
    limits.close_tcp("s2")
    assert limits.open_tcp("s2")
    assert limits.pending == {"s2": 2, "s1": 1} and limits.tcp == {"s2": 1, "s1": 1}


def test_refusals_are_reported_at_most_once_a_second_with_the_count_since_the_last():
    limits = SessionLimits(rate=1, burst=1, max_pending=1, max_tcp=1)
    reports = [limits.refuse("s2", "rate", t / 10) for t in range(25)]  # 0.0 .. 2.4 s
    assert [(i, r) for i, r in enumerate(reports) if r is not None] == [
        (0, Report("rate", 1)), (10, Report("rate", 10)), (20, Report("rate", 10))]
    assert limits.refuse("s1", "rate", 2.45) == Report("rate", 1)  # another session
    assert limits.refuse("s2", "tcp", 2.45) == Report("tcp", 1)  # another limit
    assert limits.refused[("s2", "rate")] == 25


def test_a_session_that_has_gone_leaves_no_bucket_or_report_behind():
    limits = SessionLimits(rate=1, burst=1, max_pending=1, max_tcp=1)
    limits.admit("gone", 0.0)
    limits.refuse("gone", "rate", 0.0)
    limits.forget({None, "s1"})
    assert limits.buckets == {} and limits.refuse("gone", "rate", 0.1) == Report("rate", 1)


# -- exfiltration ------------------------------------------------------------------------

DEFAULTS = DnsConfig()


def guard(**overrides) -> ExfilGuard:
    values = {"length": DEFAULTS.exfil_length, "entropy_max": DEFAULTS.exfil_entropy,
              "entropy_length": DEFAULTS.exfil_entropy_length, "names": DEFAULTS.exfil_names}
    return ExfilGuard(**{**values, **overrides})


@pytest.mark.parametrize(("name", "zone"), [
    ("files.pythonhosted.org", "pythonhosted.org"),
    ("objects.githubusercontent.com", "githubusercontent.com"),
    ("private-user-images.githubusercontent.com", "githubusercontent.com"),
    ("d1a2b3c4d5e6f7.cloudfront.net", "cloudfront.net"),
    ("aws-sam-cli-managed-default-samclisourcebucket-2cjx583p9q74.s3.amazonaws.com",
     "amazonaws.com"),
    ("north-eu-company-artifacts-bucket-logs-dev-build-675202749261.s3.eu-west-1."
     "amazonaws.com", "amazonaws.com"),
    ("cdk-hnb659fds-assets-123456789012-us-east-1.s3.us-east-1.amazonaws.com",
     "amazonaws.com"),
    ("aws-cloudtrail-logs-681047261945-kxeqhnbr.s3.dualstack.ap-southeast-2.amazonaws.com",
     "amazonaws.com"),
    ("my-access-point-with-a-long-descriptive-name-1-123456789012.s3-accesspoint.dualstack"
     ".ap-southeast-2.amazonaws.com", "amazonaws.com"),
    ("company-service-platform-7ndibkj3xw44q4u5-8080.app.github.dev", "github.dev"),
    ("a79865eb4cd1a6ab990a45779b4e0b96.r2.cloudflarestorage.com", "cloudflarestorage.com"),
    ("0123456789abcdef0123456789abcdef01234567.example.com", "example.com"),
    ("prod-us-east-1-starport-layer-bucket.s3.us-east-1.amazonaws.com", "amazonaws.com"),
])
def test_real_package_and_cdn_names_never_look_like_exfiltration(name, zone):
    assert guard().check("s1", name, zone, 0.0) is None


DENSE = (string.ascii_lowercase + string.digits + "_") * 2
"""Every character a lower-case name may hold but '-', over and over: what base36-or-more
encoded data looks like."""


@pytest.mark.parametrize(("name", "message"), [
    (".".join(["a" * 63, "b" * 63]) + ".x.example.com", "129 characters chosen under "
     "*.example.com (at most 128)"),
    (".".join(["ab"] * 60) + ".example.com", "179 characters chosen"),
    (DENSE[:63] + ".example.com", "a 63-character label with 5.15 bits of entropy"),
    (DENSE[:48] + ".example.com", "a 48-character label with 5.13 bits"),
])
def test_names_shaped_for_exfiltration_are_caught_with_the_limit_they_break(name, message):
    checked = guard()
    found = checked.check("s1", name, "example.com", 0.0)
    assert found is not None and message in found
    assert checked.denied == {"s1": 1}


def test_high_entropy_is_judged_on_long_labels_only():
    short = DENSE[:40]
    assert entropy(short) > 5.0
    assert guard().check("s1", f"{short}.example.com", "example.com", 0.0) is None
    assert guard(entropy_length=40).check("s1", f"{short}.example.com", "example.com", 0.0)


def test_entropy_is_bits_per_character():
    assert entropy("aaaa") == 0
    assert entropy("abab") == 1
    assert math.isclose(entropy(string.ascii_lowercase), math.log2(26))


def test_distinct_names_per_minute_are_limited_per_session_and_zone():
    g = guard(names=3)
    assert [g.check("s2", f"n{i}.cdn.example", "cdn.example", 0.0) for i in range(3)] == [
        None] * 3
    assert g.check("s2", "n0.cdn.example", "cdn.example", 1.0) is None  # seen: no new name
    assert "more than 3 distinct names under *.cdn.example" in g.check(
        "s2", "n3.cdn.example", "cdn.example", 1.0)
    assert g.check("s1", "n3.cdn.example", "cdn.example", 1.0) is None  # another session
    assert g.check("s2", "n3.other.example", "other.example", 1.0) is None  # another zone
    # a minute after n1 and n2 were last asked, they leave the window (n0 was asked at 1.0)
    assert g.check("s2", "n4.cdn.example", "cdn.example", 60.0) is None
    assert g.check("s2", "n5.cdn.example", "cdn.example", 60.0) is None
    assert g.check("s2", "n6.cdn.example", "cdn.example", 60.0) is not None
    assert g.check("s2", "n6.cdn.example", "cdn.example", 61.0) is None  # n0 has gone
    assert len(g.windows[("s2", "cdn.example")]) == 3


def test_a_refused_name_takes_no_place_in_the_window():
    g = guard(names=2, length=10)
    assert g.check("s2", "x" * 11 + ".cdn.example", "cdn.example", 0.0) is not None
    assert g.check("s2", "a.cdn.example", "cdn.example", 0.0) is None
    assert g.check("s2", "b.cdn.example", "cdn.example", 0.0) is None
    g.forget({None, "s1"})
    assert g.windows == {}


def test_the_defaults_bound_a_channel_to_a_few_kilobytes_a_minute():
    # base32 carries 5 bits a character; what one session can send under one zone
    bits = DEFAULTS.exfil_names * DEFAULTS.exfil_length * 5
    assert bits / 8 <= 5000


def test_the_choice_of_query_type_counts_as_a_name_of_its_own():
    """20 types for one name would carry as much as 20 names: each type beyond A/AAAA counts
    on its own in the window; A, AAAA and the proxy's lookups count the name once."""
    guard = ExfilGuard(length=128, entropy_max=4.8, entropy_length=48, names=5)
    name = "x.wild.test"
    assert all(guard.check("s1", name, "wild.test", 0.0, qtype) is None
               for qtype in (None, 1, 28))
    verdicts = [guard.check("s1", name, "wild.test", 0.0, qtype) for qtype in range(2, 12)]
    assert verdicts[:4] == [None] * 4 and all(v and "distinct names" in v for v in verdicts[4:])
