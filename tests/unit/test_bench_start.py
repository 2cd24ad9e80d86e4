"""bench/start.py's rows from a start's times: medians and p95 over the starts, the start's
`took` broken down, the firewall's part taken from the filter's step; and its target."""

from __future__ import annotations

from bench import start, targets


def one(run: float, shell: float, network: float = 0.08, filter_s: float = 0.01) -> dict:
    return {"run_s": run, "shell_s": shell, "first_s": run + shell, "cli_s": 0.2,
            "took": {"network": network, "files": 0.05, "filter": filter_s, "container": 0.25}}


def test_p95_of_ten_is_the_slowest_and_of_two_the_slower():
    assert start.p95([0.5, 0.4, 0.9, 0.3, 0.6, 0.7, 0.45, 0.55, 0.35, 0.65]) == 0.9
    assert start.p95([0.2, 0.1]) == 0.2


def test_rows_give_medians_p95_and_where_the_run_went():
    result = {"starts": [one(0.9, 0.6), one(1.0, 0.7, network=0.1), one(0.95, 0.65)],
              "warm_up": one(2.0, 1.0), "firewall": {"load_ms": [1.0, 2.0, 3.0]}}
    run, shell, first = start.rows(result)
    assert (run["metric"], run["value"], run["p95_s"], run["n"]) == (
        "session start: run --detach", 0.95, 1.0, 3)
    assert (shell["value"], first["value"], first["p95_s"]) == (0.65, 1.6, 1.7)
    assert run["network_ms"] == 80.0 and run["container_ms"] == 250.0
    assert (run["firewall_apply_ms"], run["registration_ms"]) == (2.0, 8.0)  # of filter's 10
    assert run["outside_ms"] == 560.0 and run["cli_ms"] == 200.0  # 950 - (80+50+10+250)
    assert (run["warm_up_s"], first["warm_up_s"], run["backend"]) == (2.0, 3.0, "local")
    assert "firewall_apply_ms" not in shell


def test_an_appliance_measured_from_outside_has_no_firewall_part():
    (run, *_) = start.rows({"starts": [one(4.0, 6.0)], "warm_up": one(5.0, 7.0),
                            "backend": "appliance vm"})
    assert run["backend"] == "appliance vm" and "firewall_apply_ms" not in run


def test_the_first_command_target_is_half_a_second_on_the_local_backend():
    def judged(seconds):
        rows = [{"metric": "session start: first command done", "tool": "corral",
                 "value": seconds}]
        result = {"meta": {"reps": 1, "cpus": 2}, "rows": rows}
        (target,) = [j for j in targets.judge(result) if j["target"].startswith("session")]
        return target["met"]

    assert (judged(0.45), judged(1.5)) == (True, False)
