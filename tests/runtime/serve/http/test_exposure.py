"""The exposure module's pure parts: the rate-limited refusal log (one line per class per interval, with the count
since the last line), the connection cap under the file-descriptor limit, and the error answers' bytes."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from runtime.serve.http.exposure import (
    FD_RESERVE,
    ExposureLimits,
    RefusalLog,
    add_exposure_flags,
    connection_cap,
    error_answer,
    exposure_limits,
)


def test_refusals_are_logged_once_per_class_per_interval(caplog):
    log = RefusalLog(every_s=10.0)
    with caplog.at_level(logging.WARNING, logger="runtime.serve.http.exposure"):
        for t in (0.0, 1.0, 2.0, 9.9):
            log.refused("header timeout", "slow", now=t)
        log.refused("connection cap", "full", now=5.0)
        log.refused("header timeout", "slow again", now=10.0)
    assert [r.getMessage() for r in caplog.records] == [
        "refused 1 connection(s) (header timeout) in the last 10 s: slow",
        "refused 1 connection(s) (connection cap) in the last 10 s: full",
        "refused 4 connection(s) (header timeout) in the last 10 s: slow again",
    ]
    assert log.total == {"header timeout": 5, "connection cap": 1}


@pytest.mark.parametrize(("fd_limit", "cap"), [(20000, 4096), (1024, 1024 - FD_RESERVE), (10, 1)])
def test_the_cap_binds_before_the_fd_limit(fd_limit, cap):
    assert connection_cap(ExposureLimits(), fd_limit) == cap


def test_error_answer_is_an_openai_error_that_closes():
    raw = error_answer(431, "request headers too large", "headers_too_large")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert b"connection: close" in head and f"content-length: {len(body)}".encode() in head
    assert json.loads(body) == {
        "error": {
            "message": "request headers too large",
            "type": "invalid_request_error",
            "param": None,
            "code": "headers_too_large",
        }
    }


def test_flags():
    parser = argparse.ArgumentParser()
    add_exposure_flags(parser)
    assert exposure_limits(parser.parse_args([])) == ExposureLimits()
    ns = parser.parse_args(["--header-timeout-s", "2", "--max-connections", "8", "--max-headers", "5"])
    assert exposure_limits(ns) == ExposureLimits(2.0, 5.0, 8, 64 * 1024, 5)
    with pytest.raises(ValueError, match="--max-header-bytes must be > 0"):
        exposure_limits(parser.parse_args(["--max-header-bytes", "0"]))
