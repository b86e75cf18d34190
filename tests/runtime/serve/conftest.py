"""Fixtures of the processes' server tests: ctx, a ZeroMQ context destroyed after the test."""

from __future__ import annotations

import pytest
import zmq


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
