"""bench/targets.py: each of issue 29's targets read from a result, met, missed or not
measured (a row the result lacks is never met)."""

from __future__ import annotations

from bench import targets


def result(*rows: dict) -> dict:
    return {"meta": {"reps": 1, "cpus": 2, "python": {"version": "3.11.2",
                                                      "path": "/usr/bin/python3.11"}},
            "rows": list(rows)}


def test_a_target_against_a_peer_is_met_or_missed_by_the_ratio_measured_in_the_run():
    faster = result({"metric": "HTTP keep-alive", "tool": "corral", "value": 12000},
                    {"metric": "HTTP keep-alive", "tool": "squid", "value": 10000})
    slower = result({"metric": "HTTP keep-alive", "tool": "corral", "value": 5000},
                    {"metric": "HTTP keep-alive", "tool": "squid", "value": 10000})
    (met,) = [j for j in targets.judge(faster) if j["target"].startswith("HTTP keep-alive")]
    (missed,) = [j for j in targets.judge(slower) if j["target"].startswith("HTTP keep-alive")]
    assert (met["measured"], met["met"]) == (1.2, True)
    assert (missed["measured"], missed["met"]) == (0.5, False)


def test_at_most_targets_and_rows_named_with_their_sizes():
    judged = {j["target"]: j for j in targets.judge(result(
        {"metric": "CONNECT setup", "tool": "corral", "value": 1, "p50_us": 200, "p99_us": 900},
        {"metric": "CONNECT setup", "tool": "squid", "value": 1, "p50_us": 250, "p99_us": 700},
        {"metric": "team scale: 20 sessions x 200 HTTPS connections", "tool": "corral",
         "value": 9.0, "ratio_direct": 1.4},
        {"metric": "team scale: 20 sessions x 200 HTTPS connections",
         "tool": "corral, 2 workers", "value": 8.0, "ratio_direct": 1.25}))}
    assert judged["CONNECT setup p50 ≤ squid's"]["met"] is True
    assert judged["CONNECT setup p99 ≤ 1 ms"]["met"] is True
    assert judged["team scale: total ≤ 1.3x direct (workers = 1)"]["met"] is False
    assert judged["team scale: total ≤ 1.3x direct (workers = cores)"]["met"] is True


def test_a_row_the_result_lacks_is_not_measured_never_met():
    judged = targets.judge(result())
    assert judged and all(j["met"] is None and j["measured"] is None for j in judged)
    table = targets.markdown(result(), "x.json")
    assert "| inspected bulk ≥ 0.8 of the spliced tunnel | not measured | — |" in table
    assert "Python 3.11.2 (/usr/bin/python3.11)" in table
