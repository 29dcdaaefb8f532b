"""The fault suite's real processes: a PostgreSQL cluster of its own (so that `pg_ctl restart` disturbs no other
test), an MLflow server on it, a loopback proxy in front of MLflow that can lose one response, and the
notification receiver. The Prefect server and worker are started by the suite's fixture (conftest.py)."""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from infra.support import free_port


class PrivatePostgres:
    """`initdb` + `pg_ctl` on a folder of its own, on a free loopback port, trust auth. As root, PostgreSQL's
    tools run as the `postgres` account (they refuse root). `restart()` is `pg_ctl restart -m fast`: every
    connection is cut, as in a failover."""

    def __init__(self) -> None:
        initdb = shutil.which("initdb") or next(iter(sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))),
                                                None)
        if initdb is None:
            message = "initdb is not installed: the fault suite needs a PostgreSQL cluster of its own"
            if os.environ.get("CI") == "true":
                pytest.fail(message + " (CI=true: the fault suite must run)")
            pytest.skip(message)
        self.bin = Path(initdb).resolve().parent  # /usr/local/bin may link initdb and pg_ctl only
        self.port = free_port()
        self.folder = Path(tempfile.mkdtemp(prefix="xbn-faults-pg-"))
        self.data, self.log = self.folder / "data", self.folder / "server.log"
        self._as = []
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\n"
                       "fsync = off\nmax_connections = 200\n")
        self.start()

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        done = subprocess.run([*self._as, str(self.bin / tool), *args], capture_output=True, text=True,
                              timeout=timeout, cwd=self.folder)
        assert done.returncode == 0, f"{tool} {' '.join(args)}:\n{done.stdout}\n{done.stderr}\n{self.tail()}"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def url(self, database: str, driver: str = "postgresql") -> str:
        return f"{driver}://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        conn.close()

    def dump(self, database: str) -> str:
        """`pg_dump` of `database`, as text: every row of every table."""
        done = subprocess.run([*self._as, str(self.bin / "pg_dump"), "-h", "127.0.0.1", "-p", str(self.port),
                               "-U", "postgres", database], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def start(self) -> None:
        self._run("pg_ctl", "start", "-w", "-D", str(self.data), "-l", str(self.log))

    def restart(self) -> float:
        """`pg_ctl restart -m fast`; the seconds until it accepts connections again."""
        began = time.monotonic()
        self._run("pg_ctl", "restart", "-m", "fast", "-w", "-D", str(self.data), "-l", str(self.log))
        return time.monotonic() - began

    def close(self) -> None:
        subprocess.run([*self._as, str(self.bin / "pg_ctl"), "stop", "-m", "immediate", "-D", str(self.data)],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)


def _read_chunked(reader) -> bytes:
    """An HTTP/1.1 chunked request body (RFC 9112 7.1), trailers dropped."""
    body = b""
    while size := int(reader.readline().split(b";", 1)[0].strip() or b"0", 16):
        body += reader.read(size)
        reader.readline()  # the CRLF after the chunk
    while reader.readline() not in (b"\r\n", b"\n", b""):
        pass
    return body


class LosingProxy:
    """A loopback HTTP/1.1 proxy in front of the MLflow server. `lose_next(path)`: the next request to `path`
    reaches the server and is carried out, but its response never comes back (the connection is closed), as
    when a load balancer or a NAT drops a connection under a request in flight. While the server is down, the
    client sees its connection closed."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.lost: list[str] = []  # the paths whose response was lost
        self.forwarded: list[tuple[str, str]] = []
        self._lose: str | None = None
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True).start()

    def lose_next(self, path: str) -> None:
        with self._lock:
            self._lose = path

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while True:
                request_line = reader.readline()
                if not request_line:
                    return
                method, target, _ = request_line.decode("latin-1").split(" ", 2)
                headers, length, chunked = [], 0, False
                while (line := reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                    chunked |= name.lower() == "transfer-encoding" and "chunked" in value.lower()
                    if name.lower() not in ("connection", "keep-alive", "transfer-encoding"):
                        headers.append((name, value.strip()))
                # A chunked body (requests sends an empty file that way) goes upstream with its length.
                body = _read_chunked(reader) if chunked else reader.read(length) if length else b""
                if chunked:
                    headers.append(("Content-Length", str(len(body))))
                upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
                try:
                    upstream.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                    for name, value in headers:
                        upstream.putheader(name, value)
                    upstream.endheaders(body)
                    response = upstream.getresponse()
                    payload = response.read()
                except OSError:
                    return  # the server is down: the client sees its connection closed
                finally:
                    upstream.close()
                path = target.split("?", 1)[0]
                self.forwarded.append((method, path))
                with self._lock:
                    lose = self._lose is not None and path.endswith(self._lose)
                    if lose:
                        self._lose = None
                if lose:
                    self.lost.append(path)
                    return  # carried out by the server; the answer is lost
                head = [f"HTTP/1.1 {response.status} {response.reason}"]
                head += [f"{k}: {v}" for k, v in response.getheaders()
                         if k.lower() not in ("connection", "transfer-encoding", "content-length", "keep-alive")]
                head += [f"Content-Length: {len(payload)}", "Connection: keep-alive"]
                conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
        except (OSError, ValueError):
            return
        finally:
            reader.close()
            conn.close()

    def close(self) -> None:
        self._listener.close()
