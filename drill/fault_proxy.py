"""A fault-injecting TCP proxy: puts a real S3 server (SeaweedFS) behind a flaky network.

The outside soak (``drill.soak --outside``, kind ``s3_outage``) puts its job's object store
behind one; tests point boto3 at `FaultProxy(upstream).endpoint_url` and switch faults on and
off with `set_mode` while requests run. The proxy parses HTTP/1.1 in both directions (keep-
alive, bodies framed by Content-Length or chunked, HEAD / 1xx / 204 / 304 responses without a
body), so faults can target single requests and responses instead of whole TCP streams.

Modes (one at a time; a counted mode whose count is used up behaves as "pass"):
  pass                                  forward everything unchanged (the default)
  refuse                                close the listening socket (ECONNREFUSED) and all open
                                        connections; the same port is re-opened on the next mode
  reset, after_bytes, count             the next `count` responses: forward `after_bytes` bytes
                                        (head included), then RST the client connection
                                        (after the whole response if it is shorter)
  delay, seconds                        sleep `seconds` before each chunk sent to the client
  truncate, after_bytes, count,         the next `count` GET responses whose Content-Length is
      min_body                          above `min_body` (and `after_bytes`): head plus
                                        `after_bytes` body bytes, then FIN
  http_503, count                       answer the next `count` requests with 503 SlowDown
                                        without forwarding them, then close
  strip_conditional, secret_key         drop If-None-Match / If-Match request headers, and
                                        re-sign SigV4 requests with `secret_key` (default:
                                        $AWS_SECRET_ACCESS_KEY when set_mode is called)

Standard library only: one accept thread, two threads per connection (one per direction).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from urllib.parse import urlsplit

CHUNK = 256 * 1024  # large reads keep the pass-through path near loopback speed
MAX_HEAD = 64 * 1024  # a longer head is garbage, not HTTP: stop instead of buffering forever
CHUNKED, UNTIL_EOF = -1, -2  # body framings besides a Content-Length
DRAIN_S = 5.0  # how long a FIN-closed connection waits for the client's own close
_PARAMS: dict[str, dict[str, float | None]] = {  # mode -> parameter defaults (None: required)
    "pass": {},
    "refuse": {},
    "reset": {"after_bytes": 0, "count": 1},
    "delay": {"seconds": None},
    "truncate": {"after_bytes": 0, "count": 1, "min_body": 0},
    "http_503": {"count": 1},
    "strip_conditional": {},
}
_CONDITIONAL = (b"if-none-match", b"if-match")
_SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(_SLOW_DOWN_BODY)
) + _SLOW_DOWN_BODY

Headers = list[tuple[bytes, bytes]]  # (lower-cased name, value), in order


class _Stop(Exception):
    """This connection is being torn down: a peer left, a fault fired, or the proxy stops."""


# What ends one connection quietly: a teardown, a socket error, or bytes that are not HTTP.
_ENDS = (_Stop, OSError, ValueError, IndexError)


class _Cut(Exception):
    """A response used up its fault's byte budget; `close_as` says how the client is closed."""

    def __init__(self, close_as: str) -> None:
        super().__init__(close_as)
        self.close_as = close_as


@dataclass
class _Mode:
    name: str = "pass"
    params: dict[str, float] = field(default_factory=dict)
    left: int = 0  # counted modes: faults still to inject
    secret: str | None = None  # strip_conditional: the key that re-signs stripped requests


def _new_mode(name: str, params: dict[str, float | str]) -> _Mode:
    if name not in _PARAMS:
        raise ValueError(f"unknown mode {name!r}: one of {', '.join(_PARAMS)}")
    # A test that exported the server's credentials (as boto3 reads them) needs no key here.
    secret = params.pop("secret_key", None) if name == "strip_conditional" else None
    if name == "strip_conditional" and secret is None:
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    values = _numbers(name, params)
    return _Mode(name, values, int(values.get("count", 0)), None if secret is None else str(secret))


def _numbers(name: str, params: dict[str, float | str]) -> dict[str, float]:
    """The mode's numeric params, with defaults filled in."""
    defaults = _PARAMS[name]
    unknown = set(params) - set(defaults)
    if unknown:
        raise TypeError(f"mode {name!r} takes no {', '.join(sorted(unknown))}")
    merged = {**defaults, **params}
    missing = [key for key, value in merged.items() if value is None]
    if missing:
        raise TypeError(f"mode {name!r} needs {', '.join(missing)}")
    return {key: float(value) for key, value in merged.items() if value is not None}


class FaultProxy:
    """A TCP proxy on 127.0.0.1:<free port> in front of `upstream` ("http://host:port")."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self._upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._listen_changed = threading.Condition(self._lock)
        self._mode = _Mode()
        self.requests_seen = 0  # HTTP request heads parsed, in every mode
        self.faults_injected = 0  # faults actually injected, summed over all modes so far
        # Bound now, so endpoint_url is known before start() and stays the same across refuse.
        self._listener: socket.socket | None = _listen(0)
        self.port = int(self._listener.getsockname()[1])
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._want_listening = True
        self._asked = self._applied = 0  # listener changes asked for / done by the accept thread
        self._listen_error: OSError | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: set[_Conn] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.stop()

    def start(self) -> FaultProxy:
        if self._thread is None:
            self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy-accept",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
        conns = self._abort_connections()
        for conn in conns:
            conn.thread.join(timeout=5)
        self._wake_r.close()
        self._wake_w.close()

    def set_mode(self, mode: str, **params: float | str) -> None:
        """Switch faults; new requests, responses and connections see the new mode at once."""
        new = _new_mode(mode, params)
        refuse = mode == "refuse"
        with self._lock:
            self._mode = new
            flip = self._want_listening == refuse
            self._want_listening = not refuse
        if flip:
            self._change_listener()
        if refuse:
            self._abort_connections()

    # --- the listening socket, owned by the accept thread once started -----------------------

    def _change_listener(self) -> None:
        """Open or close the listener as asked, and return only once that is done."""
        if self._thread is None or not self._thread.is_alive():  # no thread to race with
            with self._lock:
                self._apply_listener()
        else:
            with self._lock:
                self._asked += 1
                asked = self._asked
            self._wake_w.send(b"x")
            with self._lock:
                if not self._listen_changed.wait_for(lambda: self._applied >= asked, 5):
                    raise RuntimeError("fault proxy: accept thread did not answer")
        if self._listen_error is not None:
            raise RuntimeError(f"fault proxy: cannot re-open port {self.port}") from (
                self._listen_error
            )

    def _apply_listener(self) -> socket.socket | None:
        """With the lock held: make the listener match the mode; return it."""
        if self._want_listening and self._listener is None and not self._stopping:
            try:
                self._listener = _listen(self.port)
                self._listen_error = None
            except OSError as err:  # another process took the port while it was closed
                self._listen_error = err
        elif not self._want_listening and self._listener is not None:
            self._listener.close()  # pending and new connects now get ECONNREFUSED
            self._listener = None
        self._applied = self._asked
        self._listen_changed.notify_all()
        return self._listener

    def _accept_loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                listener = self._apply_listener()
            ready = _readable([self._wake_r, *([listener] if listener else [])])
            if self._wake_r in ready:
                self._wake_r.recv(4096)
            elif listener is not None:
                self._accept(listener)

    def _accept(self, listener: socket.socket) -> None:
        try:
            client, _ = listener.accept()
        except OSError:  # the client gave up before we got to it
            return
        conn = _Conn(self, client)
        with self._lock:
            self._conns.add(conn)
        conn.thread.start()

    def _abort_connections(self) -> list[_Conn]:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.abort()
        return conns

    # --- shared state for the connection threads ----------------------------------------------

    def _forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _count_request(self) -> None:
        with self._lock:
            self.requests_seen += 1

    def _take(
        self, name: str, applies: Callable[[dict[str, float]], bool] = lambda _: True
    ) -> _Mode | None:
        """Mode `name` if it is on, has count left and applies to this message; counts it."""
        with self._lock:
            mode = self._mode
            counted = "count" in mode.params
            if mode.name != name or (counted and mode.left <= 0) or not applies(mode.params):
                return None
            if counted:
                mode.left -= 1
            self.faults_injected += 1
            return mode


class _Conn:
    """One client connection and its upstream twin: this thread pumps responses, a second one
    pumps requests. Only this thread closes the sockets, so a fault's RST or FIN is the last
    thing the client sees."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        # A latch both pumps poll next to their socket: one byte in it stops them both.
        self.wake_r, self.wake_w = socket.socketpair()
        self.stopped = threading.Event()
        self.methods: deque[bytes] = deque()  # methods of requests still awaiting a response
        self.close_as = "fin"  # how the client is closed: "fin", "rst" or "abort"
        self._lock = threading.Lock()
        self._closed = False
        self.thread = threading.Thread(target=self._run, name="fault-proxy-conn", daemon=True)

    def stop(self) -> None:
        """Stop both pumps; the upstream is shut so a blocked send to it returns at once."""
        with self._lock:
            if self.stopped.is_set() or self._closed:
                return
            self.stopped.set()
            self.wake_w.send(b"x")
            if self.upstream is not None:
                _shutdown(self.upstream)

    def abort(self) -> None:
        """Close from outside (refuse, proxy stop): also unblock a send to the client."""
        self.close_as = "abort"
        self.stop()
        with self._lock:
            if not self._closed:
                _shutdown(self.client)

    def _run(self) -> None:
        requests: threading.Thread | None = None
        try:
            self.upstream = _connect(self.proxy._upstream)
            if self.stopped.is_set():  # aborted while connecting: stop() could not shut it
                return
            requests = threading.Thread(target=self._pump_requests, daemon=True)
            requests.start()
            self._pump_responses()
        except _ENDS:
            pass  # the client sees the connection end below
        finally:
            self.stop()
            if requests is not None:
                requests.join(timeout=5)
            self._close()

    def _close(self) -> None:
        with self._lock:
            self._closed = True
        if self.upstream is not None:
            self.upstream.close()
        if self.close_as == "rst":
            _reset(self.client)
        elif self.close_as == "fin":
            _close_gracefully(self.client)
        else:
            self.client.close()
        self.wake_r.close()
        self.wake_w.close()
        self.proxy._forget(self)

    # --- client -> upstream -------------------------------------------------------------------

    def _pump_requests(self) -> None:
        assert self.upstream is not None
        src = _Stream(self.client, self.wake_r)
        try:
            while (head := src.read_head()) is not None:
                self._forward_request(src, head, self.upstream)
            # The client closed: pass its FIN on, the upstream finishes and closes its side.
            self.upstream.shutdown(socket.SHUT_WR)
        except _ENDS:
            self.stop()

    def _forward_request(self, src: _Stream, head: bytes, upstream: socket.socket) -> None:
        start, headers = _parse_head(head)
        self.proxy._count_request()
        if self.proxy._take("http_503") is not None:
            # Right after the head: a client that sent Expect: 100-continue waits for this
            # instead of its body. What it sends anyway is drained before the FIN close.
            self.client.sendall(_SLOW_DOWN)
            raise _Stop
        strip = self.proxy._take("strip_conditional", lambda _: _has_conditional(headers))
        if strip is not None:
            head = _strip_conditional(head, strip.secret)
        # Queued before the head goes out, so the response pump always finds its method.
        self.methods.append(start.split(b" ", 1)[0].upper())
        upstream.sendall(head)
        _copy_body(src, _request_framing(headers), upstream.sendall)

    # --- upstream -> client -------------------------------------------------------------------

    def _pump_responses(self) -> None:
        assert self.upstream is not None
        src = _Stream(self.upstream, self.wake_r)
        while (head := src.read_head()) is not None:
            start, headers = _parse_head(head)
            status = int(start.split(b" ", 2)[1])
            if 100 <= status < 200:  # interim (100 Continue): the final response follows
                _Sink(self.client, self.stopped, self._delay()).send(head)
                continue
            method = self.methods.popleft() if self.methods else b""
            framing = _response_framing(method, status, headers)
            try:
                self._forward_response(src, head, framing, self._sink(method, len(head), framing))
            except _Cut as cut:
                self.close_as = cut.close_as
                raise _Stop from None
            if framing == UNTIL_EOF:
                return  # the body ended with the upstream's close: close the client too

    def _forward_response(self, src: _Stream, head: bytes, framing: int, sink: _Sink) -> None:
        sink.send(head)
        _copy_body(src, framing, sink.send)
        sink.finish()

    def _delay(self) -> float:
        mode = self.proxy._take("delay")
        return mode.params["seconds"] if mode is not None else 0.0

    def _sink(self, method: bytes, head_len: int, framing: int) -> _Sink:
        """Where this response goes: straight to the client, or through this mode's fault."""
        delay = self._delay()
        if (mode := self.proxy._take("reset")) is not None:
            return _Sink(self.client, self.stopped, delay, int(mode.params["after_bytes"]), "rst")

        def truncatable(p: dict[str, float]) -> bool:
            return method == b"GET" and framing > max(p["min_body"], p["after_bytes"])

        if (mode := self.proxy._take("truncate", truncatable)) is not None:
            limit = head_len + int(mode.params["after_bytes"])
            return _Sink(self.client, self.stopped, delay, limit, "fin")
        return _Sink(self.client, self.stopped, delay)


class _Sink:
    """Sends one response to the client, delayed per chunk and cut after `limit` bytes."""

    def __init__(
        self, sock: socket.socket, stopped: threading.Event, delay: float = 0.0,
        limit: int | None = None, close_as: str = "fin",
    ) -> None:  # fmt: skip
        self.sock, self.stopped, self.delay = sock, stopped, delay
        self.limit, self.close_as, self.sent = limit, close_as, 0

    def send(self, data: bytes) -> None:
        if self.delay and self.stopped.wait(self.delay):  # a stop cuts the delay short
            raise _Stop
        if self.limit is not None and self.sent + len(data) >= self.limit:
            self.sock.sendall(data[: self.limit - self.sent])
            raise _Cut(self.close_as)
        self.sock.sendall(data)
        self.sent += len(data)

    def finish(self) -> None:
        if self.limit is not None:  # a budget longer than the response: the fault still fires
            raise _Cut(self.close_as)


class _Stream:
    """Buffered reads from one socket that end as soon as the connection's latch is set."""

    def __init__(self, sock: socket.socket, wake: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.wake_fd = wake.fileno()
        self.poll = select.poll()
        self.poll.register(sock, select.POLLIN)
        self.poll.register(wake, select.POLLIN)

    def _recv(self, size: int) -> bytes:
        if any(fd == self.wake_fd for fd, _ in self.poll.poll()):
            raise _Stop
        return self.sock.recv(size)

    def _fill_until(self, marker: bytes) -> int:
        """Index of `marker` in the buffer, reading more until it shows up."""
        start = 0
        while (end := self.buf.find(marker, start)) < 0:
            if len(self.buf) > MAX_HEAD:
                raise ValueError("no end of HTTP head or chunk line")
            start = max(0, len(self.buf) - len(marker) + 1)
            data = self._recv(CHUNK)
            if not data:
                raise _Stop if self.buf else EOFError
            self.buf += data
        return end + len(marker)

    def _take(self, size: int) -> bytes:
        data = bytes(self.buf[:size])
        del self.buf[:size]
        return data

    def read_head(self) -> bytes | None:
        """The next HTTP head (through the blank line), or None if the peer closed before it."""
        try:
            return self._take(self._fill_until(b"\r\n\r\n"))
        except EOFError:
            return None

    def read_line(self) -> bytes:
        try:
            return self._take(self._fill_until(b"\n"))
        except EOFError:
            raise _Stop from None

    def read_some(self, limit: int) -> bytes:
        """Up to `limit` bytes (b"" at EOF); buffered bytes first, then straight from recv."""
        return self._take(limit) if self.buf else self._recv(limit)


def _parse_head(head: bytes) -> tuple[bytes, Headers]:
    lines = head[:-4].split(b"\r\n")
    headers: Headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise ValueError(f"bad HTTP header line {line!r}")
        headers.append((name.strip().lower(), value.strip()))
    return lines[0], headers


def _header(headers: Headers, name: bytes) -> bytes | None:
    return next((value for key, value in headers if key == name), None)


def _framing(headers: Headers) -> int:
    if b"chunked" in (_header(headers, b"transfer-encoding") or b"").lower():
        return CHUNKED
    length = _header(headers, b"content-length")
    return int(length) if length is not None else UNTIL_EOF


def _request_framing(headers: Headers) -> int:
    framing = _framing(headers)
    return 0 if framing == UNTIL_EOF else framing  # a request without framing has no body


def _response_framing(method: bytes, status: int, headers: Headers) -> int:
    if method == b"HEAD" or status in (204, 304):  # a HEAD's Content-Length has no body
        return 0
    return _framing(headers)


def _has_conditional(headers: Headers) -> bool:
    return any(name in _CONDITIONAL for name, _ in headers)


def _strip_conditional(head: bytes, secret: str | None) -> bytes:
    lines = head[:-4].split(b"\r\n")
    kept = [line for line in lines[1:] if _name(line) not in _CONDITIONAL]
    # botocore signs every header it sends, these two included: without a new signature the
    # server would answer SignatureDoesNotMatch instead of ignoring the condition.
    auth = _sigv4_authorization(lines[0], kept, secret) if secret is not None else None
    if auth is not None:
        kept = [b"Authorization: " + auth if _name(line) == b"authorization" else line
                for line in kept]  # fmt: skip
    return b"\r\n".join([lines[0], *kept]) + b"\r\n\r\n"


def _name(line: bytes) -> bytes:
    return line.partition(b":")[0].strip().lower()


def _sigv4_authorization(start: bytes, lines: list[bytes], secret: str) -> bytes | None:
    """A new AWS4-HMAC-SHA256 Authorization value for the request with these header lines,
    signing those of its signed headers that are left; None if it is not such a request."""
    _, headers = _parse_head(b"\r\n".join([start, *lines]) + b"\r\n\r\n")
    auth = _header(headers, b"authorization") or b""
    date, payload = _header(headers, b"x-amz-date"), _header(headers, b"x-amz-content-sha256")
    if not auth.startswith(b"AWS4-HMAC-SHA256 ") or date is None or payload is None:
        return None
    fields = dict(part.strip().partition(b"=")[::2] for part in auth[17:].split(b","))
    signed = [name for name in fields[b"SignedHeaders"].split(b";") if name not in _CONDITIONAL]
    canonical = _canonical_request(start, headers, signed, payload)
    scope = fields[b"Credential"].split(b"/", 1)[1]  # date/region/service/aws4_request
    to_sign = b"\n".join([b"AWS4-HMAC-SHA256", date, scope, _sha256_hex(canonical)])
    key = b"AWS4" + secret.encode()
    for part in scope.split(b"/"):  # the SigV4 key chain, one HMAC per scope part
        key = hmac.digest(key, part, "sha256")
    signature = hmac.new(key, to_sign, "sha256").hexdigest().encode()
    return b"AWS4-HMAC-SHA256 Credential=%s, SignedHeaders=%s, Signature=%s" % (
        fields[b"Credential"], b";".join(signed), signature)  # fmt: skip


def _canonical_request(
    start: bytes, headers: Headers, signed: list[bytes], payload: bytes
) -> bytes:
    """As botocore's S3 signer builds it: the path as sent, the query sorted, values trimmed."""
    method, target = start.split(b" ")[:2]
    path, _, query = target.partition(b"?")
    pairs = sorted(pair.partition(b"=")[::2] for pair in query.split(b"&") if pair)
    values = {name: b",".join(b" ".join(v.split()) for k, v in headers if k == name)
              for name in signed}  # fmt: skip
    return b"\n".join([method, path, b"&".join(k + b"=" + v for k, v in pairs),
                       *(name + b":" + values[name] for name in signed),
                       b"", b";".join(signed), payload])  # fmt: skip


def _sha256_hex(data: bytes) -> bytes:
    return hashlib.sha256(data).hexdigest().encode()


def _copy_body(src: _Stream, framing: int, send: Callable[[bytes], None]) -> None:
    if framing == CHUNKED:
        _copy_chunked(src, send)
    elif framing == UNTIL_EOF:
        while data := src.read_some(CHUNK):
            send(data)
    else:
        _copy_exact(src, framing, send)


def _copy_exact(src: _Stream, size: int, send: Callable[[bytes], None]) -> None:
    while size > 0:
        data = src.read_some(min(size, CHUNK))
        if not data:
            raise _Stop  # the sender closed mid-body
        send(data)
        size -= len(data)


def _copy_chunked(src: _Stream, send: Callable[[bytes], None]) -> None:
    """Pass a chunked body on chunk by chunk, up to and including the trailers' blank line."""
    while True:
        line = src.read_line()
        send(line)
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            break
        _copy_exact(src, size + 2, send)  # the data and its CRLF
    while (line := src.read_line()) not in (b"\r\n", b"\n"):
        send(line)
    send(line)


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Re-binding the same port after refuse: accepted connections may still be in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return sock


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=5)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _readable(socks: list[socket.socket]) -> list[socket.socket]:
    poll = select.poll()  # poll, not select: no FD_SETSIZE limit in a busy test process
    by_fd = {sock.fileno(): sock for sock in socks}
    for fd in by_fd:
        poll.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poll.poll()]


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected any more: nothing left to wake
        pass


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the kernel sends RST instead of FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _close_gracefully(sock: socket.socket) -> None:
    """FIN, then read until the client closes too: closing with unread bytes would send RST
    (e.g. a PUT body still arriving after an early 503), and the client would miss the end."""
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + DRAIN_S
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(CHUNK):
                break
    except OSError:  # timeout, or the client reset: either way we are done
        pass
    sock.close()
