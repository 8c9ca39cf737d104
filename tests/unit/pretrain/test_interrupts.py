"""Ctrl-C as a stop request (pretrain/context/interrupts.py), in this process: the first SIGINT
sets the flag, the same press delivered again within SAME_PRESS_S changes nothing, and a lost
peer after a Ctrl-C is the user's stop, not an infrastructure failure to retry."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from pretrain.context import exit_codes, interrupts
from pretrain.context.failures import classify


@pytest.fixture()
def sigint() -> Iterator[None]:
    previous = signal.getsignal(signal.SIGINT)
    interrupts.reset_for_tests()
    interrupts.install()
    yield
    signal.signal(signal.SIGINT, previous)
    interrupts.reset_for_tests()


def test_a_ctrl_c_is_a_flag_not_an_exception(sigint: None) -> None:
    assert not interrupts.requested()
    os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: the handler ran, the test goes on
    assert interrupts.requested()
    os.kill(os.getpid(), signal.SIGINT)  # the same press again (a launcher forwarding it)
    assert interrupts.requested()


def test_a_lost_peer_after_a_ctrl_c_is_the_users_stop(sigint: None) -> None:
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    assert classify(lost).exit_code == exit_codes.INFRASTRUCTURE  # before: a retryable failure
    os.kill(os.getpid(), signal.SIGINT)
    failure = classify(lost)
    assert (failure.kind, failure.exit_code, failure.retryable) == (
        "interrupted",
        exit_codes.INTERRUPTED,
        False,
    )
    # Only infrastructure-like failures become the user's: a real bug stays a bug.
    assert classify(ValueError("bad shape")).exit_code == exit_codes.USER_CODE


def test_a_ctrl_c_before_a_command_takes_sigint_over_is_one_line_and_130(
    caplog: pytest.LogCaptureFixture,
) -> None:
    @interrupts.one_line_on_ctrl_c("before anything started")
    def main(argv: list[str]) -> int:
        raise KeyboardInterrupt

    assert main([]) == exit_codes.INTERRUPTED == 130
    assert [r.getMessage() for r in caplog.records] == [
        "interrupted (Ctrl-C) before anything started"
    ]
