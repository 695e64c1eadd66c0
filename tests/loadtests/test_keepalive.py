"""loadtests.keepalive: a pooled connection's liveness check past descriptor 1024."""

import os
import socket

import pytest

from loadtests.keepalive import install, socket_alive


@pytest.fixture
def high_pair():
    """A connected socket pair whose descriptors are above select()'s 1024 limit."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        a, b = socket.socketpair()
        assert a.fileno() >= 1024 and b.fileno() >= 1024
        yield a, b
        a.close()
        b.close()
    finally:
        for fd in held:
            os.close(fd)


def test_an_idle_connection_above_descriptor_1024_is_alive(high_pair):
    a, _ = high_pair
    assert socket_alive(a)


def test_a_connection_the_peer_closed_or_wrote_to_is_not(high_pair):
    a, b = high_pair
    b.send(b"x")  # stray bytes on an idle keep-alive connection
    assert not socket_alive(a)
    a.recv(1)
    assert socket_alive(a)
    b.close()  # FIN
    assert not socket_alive(a)


def test_a_closed_socket_or_none_is_not():
    a, b = socket.socketpair()
    a.close()
    b.close()
    assert not socket_alive(a)
    assert not socket_alive(None)


def test_install_replaces_geventhttpclients_select_check(high_pair):
    from geventhttpclient.connectionpool import ConnectionPool

    a, _ = high_pair
    original = ConnectionPool._is_socket_alive
    try:
        assert original(None, a) is False  # the library's check: select() refuses the descriptor
        install()
        assert ConnectionPool._is_socket_alive(None, a) is True
    finally:
        ConnectionPool._is_socket_alive = original
