"""The engine connectors' failure counters and rate-limited log
(kvplane._failures, shared by the SGLang backend and the AIBrix connector;
their own tests check the counters through real nodes)."""

from __future__ import annotations

import logging
import time

import pytest

from kvplane._failures import LOG_EVERY_S, Failures

LOGGER = "kvplane.test.failures"


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_one_warning_per_kind_every_interval_and_every_failure_counted(caplog: pytest.LogCaptureFixture) -> None:
    failures = Failures(logging.getLogger(LOGGER), "answered as a miss")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for i in range(5):
            failures.failure("get", "Unavailable", f"node gone {i}")
        failures.failure("set", "Timeout", "slow")
        failures.failure("get", "Timeout", "slow")
    assert warnings(caplog) == [
        "kvplane: get answered as a miss (Unavailable, 1 so far): node gone 0",
        "kvplane: set answered as a miss (Timeout, 1 so far): slow",
        "kvplane: get answered as a miss (Timeout, 1 so far): slow",
    ]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert debug == [f"kvplane: get answered as a miss (Unavailable, {n} so far): node gone {n - 1}" for n in range(2, 6)]
    assert failures.snapshot() == {"failed_get_Unavailable": 5, "failed_set_Timeout": 1, "failed_get_Timeout": 1}
    assert LOG_EVERY_S == 10.0


def test_a_kind_warns_again_once_its_interval_has_passed(caplog: pytest.LogCaptureFixture) -> None:
    failures = Failures(logging.getLogger(LOGGER), "failed", every_s=0.05)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        failures.failure("put", "Unavailable", "first")
        failures.failure("put", "Unavailable", "within the interval")
        assert warnings(caplog) == ["kvplane: put failed (Unavailable, 1 so far): first"]
        deadline = time.monotonic() + 10
        n = 2
        while len(warnings(caplog)) < 2:
            assert time.monotonic() < deadline, "no second warning after the interval"
            n += 1
            failures.failure("put", "Unavailable", "later")
            time.sleep(0.01)
    assert warnings(caplog)[1] == f"kvplane: put failed (Unavailable, {n} so far): later"


def test_logged_elsewhere_is_counted_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    failures = Failures(logging.getLogger(LOGGER), "failed")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        failures.failure("get", "node-down", "taken to be down", log=False)
    assert warnings(caplog) == []
    assert failures.snapshot() == {"failed_get_node-down": 1}
    failures.count(("get_found", 3), ("get_missing", 1))
    failures.count(("get_found", 2))
    assert failures.snapshot() == {"failed_get_node-down": 1, "get_found": 5, "get_missing": 1}
