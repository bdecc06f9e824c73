"""A TCP proxy that a test can cut and restore: PostgreSQL or Redis "down" for the processes
behind it, without touching the servers other tests share."""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttableProxy:
    """Listens on 127.0.0.1; forwards to ``target_host:target_port``, or to PostgreSQL's Unix
    socket when ``target_host`` is a directory (the embedded PostgreSQL listens only there)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._up = threading.Event()
        self._up.set()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Drop every open connection; new ones are refused (closed at once) until restore()."""
        self._up.clear()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self._sockets.clear()

    def restore(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set() or self._closed:
                client.close()
                continue
            try:
                upstream = self._connect()
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _connect(self) -> socket.socket:
        host, port = self.target
        if not host.startswith("/"):
            return socket.create_connection(self.target, timeout=5)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.settimeout(5)
        try:
            upstream.connect(f"{host}/.s.PGSQL.{port}")
        except OSError:
            upstream.close()
            raise
        return upstream

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)
