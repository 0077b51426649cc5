"""One TCP connection from each other host's `deepinfer follow` to the driver, held open for the run,
so the driver hears at once, step or no step, that a host's first rank is gone (docs/architecture.md §8).

Nothing travels on it after the host says which node it is: the kernel closes a dead process's
sockets, so the driver's end reads end-of-file the moment that process dies, however it died; a host
that loses power or its network sends nothing more, and TCP keepalive probes (1 s idle, 1 s apart, 2
unanswered) end the connection with an error after about 3 s. The driver's ranks watchdog polls
`HostLinks.lost()` every poll; `connect` is what a host's watchdog calls once at its start.
"""
from __future__ import annotations

import select
import socket
import struct

KEY_HOST_LINKS = "deepinfer/host_links"   # the driver's listening port, in the store
_NODE = struct.Struct("<I")
_KEEPALIVE = (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 2))


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        if hasattr(socket, name):   # Linux; elsewhere the system's keepalive timing applies
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class HostLinks:
    """The driver's end: a listening socket and one connection per other host."""

    def __init__(self, addr: str):
        self._listener = socket.create_server((addr, 0))
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._pending: list[socket.socket] = []      # accepted, node not read yet
        self._links: dict[socket.socket, int] = {}   # connection -> node
        self.nodes: set[int] = set()                 # every node that ever connected

    def lost(self) -> list[int]:
        """Accept new hosts, then the nodes whose connection ended since the last call (no wait)."""
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                break
            _keepalive(conn)
            self._pending.append(conn)
        watched = self._pending + list(self._links)
        if not watched:
            return []
        readable, _, _ = select.select(watched, [], [], 0)
        gone = []
        for conn in readable:
            if conn in self._pending:
                self._pending.remove(conn)
                data = _recv(conn, _NODE.size)
                if data is not None and len(data) == _NODE.size:
                    node = _NODE.unpack(data)[0]
                    self._links[conn] = node
                    self.nodes.add(node)
                else:
                    conn.close()
                continue
            if _recv(conn, 1) in (None, b""):    # end of file, or the keepalive gave up
                gone.append(self._links.pop(conn))
                conn.close()
        return gone

    def close(self) -> None:
        for conn in self._pending + list(self._links):
            conn.close()
        self._pending, self._links = [], {}
        self._listener.close()


def _recv(conn: socket.socket, n: int) -> bytes | None:
    try:
        return conn.recv(n)
    except OSError:
        return None


def connect(addr: str, port: int, node: int, timeout_s: float = 10.0) -> socket.socket:
    """A host's end: connect, say which node this is, and keep the socket (closing it says "gone")."""
    sock = socket.create_connection((addr, port), timeout=timeout_s)
    _keepalive(sock)
    sock.sendall(_NODE.pack(node))
    return sock
