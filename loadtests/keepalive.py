"""Keep-alive for Locust's HTTP users past 1024 open descriptors.

geventhttpclient (2.6, behind Locust's ``FastHttpUser``) checks a pooled connection before
reusing it with ``select.select([sock], [], [], 0)``, and treats any error as a dead
connection. ``select`` cannot take a descriptor >= 1024 (``ValueError``), so once a Locust
process holds more than about a thousand connections, every request of the users above that
line closes its healthy connection and opens a new one: a TCP handshake, a resolver call and a
new server-side connection per round, none of which a real edge pays (it keeps its
connection). :func:`install` replaces the check with ``poll``, which has no descriptor limit,
and keeps its meaning: an idle keep-alive connection is alive while nothing is readable on it
(no FIN, no stray bytes).
"""

from __future__ import annotations

import select

try:  # under Locust, gevent has replaced select.poll; the check needs the blocking-free original
    from gevent.monkey import get_original
    _poll = get_original("select", "poll")
except ImportError:  # pragma: no cover - gevent is a Locust dependency
    _poll = select.poll

_READY = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP


def socket_alive(sock) -> bool:
    """Whether an idle pooled connection can take the next request: open, and nothing readable
    (a readable idle connection has been closed by the server or holds bytes nobody asked for)."""
    if sock is None:
        return False
    try:
        fd = sock.fileno()
        if fd < 0:
            return False
        p = _poll()
        p.register(fd, _READY)
        return not p.poll(0)
    except (OSError, ValueError):
        return False


def install() -> None:
    """Make geventhttpclient's connection pool use :func:`socket_alive`."""
    from geventhttpclient.connectionpool import ConnectionPool

    ConnectionPool._is_socket_alive = lambda self, sock: socket_alive(sock)
