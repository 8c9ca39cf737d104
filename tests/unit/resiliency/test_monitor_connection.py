"""A rank-monitor connection the launcher closed is not the rank's failure, however nvrx says so.

ft_launcher closes every worker's monitor connection just before it stops the group (a restart,
a node joining an elastic job). nvrx's client then fails in one of two shapes: with the socket
error in the chain, or (its reply reader prints the reset and returns None) as "Unexpected
reply: None" alone. Seen under the elastic Slurm test: the second shape ended a growing job
with exit 4, "do not retry".
"""

from __future__ import annotations

import socket

import pytest

rank_monitor_client = pytest.importorskip(
    "nvidia_resiliency_ext.fault_tolerance.rank_monitor_client"
)

from resiliency.monitor.fault_tolerance import _connection_closed  # noqa: E402

pytestmark = pytest.mark.current_stack  # nvrx's client on both releases


def _client_error_after_the_peer_closed() -> BaseException:
    """What nvrx's client raises when its peer closed the socket before the reply: its own
    reply check on a socket pair whose other end is gone (nvrx code, no stand-in)."""
    ours, theirs = socket.socketpair()
    theirs.close()
    client = object.__new__(rank_monitor_client.RankMonitorClient)
    try:
        client._ensure_response_is_ok(ours)
    except rank_monitor_client.RankMonitorClientError as exc:
        try:  # as send_section_update wraps it
            raise rank_monitor_client.RankMonitorClientError(
                f"RankMonitorClient could not send section update. Exception: {exc}"
            ) from exc
        except rank_monitor_client.RankMonitorClientError as wrapped:
            return wrapped
    finally:
        ours.close()
    raise AssertionError("nvrx's client accepted a reply from a closed socket")


def test_a_reply_lost_with_the_closed_socket_is_the_launchers_doing() -> None:
    assert _connection_closed(_client_error_after_the_peer_closed())


def test_a_reset_in_the_chain_is_the_launchers_doing_and_other_errors_are_not() -> None:
    error = rank_monitor_client.RankMonitorClientError
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError:
            raise error("could not send section update")  # noqa: B904 - as nvrx raises it
    except error as exc:
        assert _connection_closed(exc)
    assert not _connection_closed(error("Unexpected reply: ErrorMsg(cause='bad'). Expected OkMsg"))
    assert not _connection_closed(ValueError("Unexpected reply: None."))  # not nvrx's client
