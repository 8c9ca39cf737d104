"""The fault proxy (drill/fault_proxy.py) in front of a real S3 server (SeaweedFS): every mode as
boto3 sees it, and the proxy's HTTP framing against a stdlib server that speaks chunked, HEAD,
204 and 100-continue on one keep-alive connection."""

from __future__ import annotations

import http.client
import io
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ResponseStreamingError,
)

from bench.s3_server import S3Server
from drill.fault_proxy import FaultProxy

MIB = 1 << 20


def s3_client(s3: S3Server, endpoint_url: str) -> Any:
    # total_max_attempts=1: botocore does not retry, so each fault reaches the test. Not
    # retries={"max_attempts": 1}: that legacy key counts retries, and its one retry would
    # quietly succeed after a count=1 fault.
    return boto3.client(
        "s3", endpoint_url=endpoint_url, region_name=s3.env["AWS_REGION"],
        aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"],
        config=Config(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=5),
    )  # fmt: skip


@pytest.fixture(scope="module")
def direct(s3: S3Server) -> Any:
    return s3_client(s3, s3.endpoint_url)


@pytest.fixture()
def client(s3: S3Server, proxy: FaultProxy) -> Any:
    return s3_client(s3, proxy.endpoint_url)


@pytest.fixture()
def key() -> str:
    return f"fault-proxy/{uuid.uuid4().hex[:8]}"


def error_of(err: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    response = err.value.response
    return response["Error"]["Code"], response["ResponseMetadata"]["HTTPStatusCode"]


def test_pass_round_trips_put_get_head_list(
    s3: S3Server, proxy: FaultProxy, client: Any, key: str
) -> None:
    body = os.urandom(3 * MIB)
    client.put_object(Bucket=s3.bucket, Key=key, Body=body)
    assert client.head_object(Bucket=s3.bucket, Key=key)["ContentLength"] == len(body)
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == body
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=key)
    assert [item["Key"] for item in listed["Contents"]] == [key]
    assert (proxy.requests_seen, proxy.faults_injected) == (4, 0)


def test_refuse_closes_port_and_reopens_it(
    s3: S3Server, proxy: FaultProxy, client: Any, key: str
) -> None:
    client.put_object(Bucket=s3.bucket, Key=key, Body=b"x")  # leaves a pooled connection open
    proxy.set_mode("refuse")
    # The pooled connection was closed too, so urllib3 reconnects, and is refused.
    with pytest.raises(EndpointConnectionError):
        client.get_object(Bucket=s3.bucket, Key=key)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    proxy.set_mode("pass")
    assert proxy.endpoint_url == f"http://127.0.0.1:{proxy.port}"
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"x"


def test_reset_in_head_in_body_and_after_a_put(
    s3: S3Server, proxy: FaultProxy, direct: Any, client: Any, key: str
) -> None:
    body = os.urandom(MIB)
    direct.put_object(Bucket=s3.bucket, Key=key, Body=body)
    proxy.set_mode("reset", after_bytes=10, count=1)
    # RST inside the response head: urllib3's ProtocolError(ConnectionResetError), which
    # botocore raises as ConnectionClosedError.
    with pytest.raises(ConnectionClosedError):
        client.get_object(Bucket=s3.bucket, Key=key)
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == body  # count used up

    proxy.set_mode("reset", after_bytes=64 * 1024, count=1)
    response = client.get_object(Bucket=s3.bucket, Key=key)  # the head got through
    # RST inside the body: ResponseStreamingError around urllib3's ProtocolError.
    with pytest.raises(ResponseStreamingError, match="Connection reset by peer"):
        response["Body"].read()

    proxy.set_mode("reset", after_bytes=0, count=1)
    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket=s3.bucket, Key=f"{key}-put", Body=b"p" * 1000)
    # The server had stored the object before the client lost the response.
    assert direct.get_object(Bucket=s3.bucket, Key=f"{key}-put")["Body"].read() == b"p" * 1000
    assert proxy.faults_injected == 3


def test_truncate_cuts_big_get_bodies_only(
    s3: S3Server, proxy: FaultProxy, direct: Any, client: Any, key: str
) -> None:
    body = os.urandom(MIB)
    direct.put_object(Bucket=s3.bucket, Key=key, Body=body)
    direct.put_object(Bucket=s3.bucket, Key=f"{key}-small", Body=b"s" * 100)
    proxy.set_mode("truncate", after_bytes=1000, count=1, min_body=1024)
    assert client.head_object(Bucket=s3.bucket, Key=key)["ContentLength"] == len(body)  # no GET
    small = client.get_object(Bucket=s3.bucket, Key=f"{key}-small")  # not above min_body
    assert small["Body"].read() == b"s" * 100
    response = client.get_object(Bucket=s3.bucket, Key=key)
    assert response["ContentLength"] == len(body)
    # urllib3 enforces Content-Length: ProtocolError("Connection broken: IncompleteRead(...)"),
    # which botocore raises as ResponseStreamingError (not IncompleteReadError).
    with pytest.raises(ResponseStreamingError, match=r"IncompleteRead\(1000 bytes read"):
        response["Body"].read()
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == body  # count used up
    assert proxy.faults_injected == 1


def test_http_503_answers_count_requests_then_passes(
    s3: S3Server, proxy: FaultProxy, direct: Any, client: Any, key: str
) -> None:
    proxy.set_mode("http_503", count=2)
    puts = [
        io.BytesIO(b"x" * MIB),  # a file: botocore sends Expect: 100-continue, holds the body
        b"y" * MIB,  # bytes: no Expect, the body follows the head at once
    ]
    for body in puts:
        with pytest.raises(ClientError) as err:
            client.put_object(Bucket=s3.bucket, Key=key, Body=body)
        assert error_of(err) == ("SlowDown", 503)
    with pytest.raises(ClientError) as missing:  # nothing reached the server
        direct.head_object(Bucket=s3.bucket, Key=key)
    assert error_of(missing)[1] == 404
    client.put_object(Bucket=s3.bucket, Key=key, Body=b"z")
    assert direct.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"z"
    assert (proxy.requests_seen, proxy.faults_injected) == (3, 2)


def test_strip_conditional_makes_preconditions_pass(
    s3: S3Server, proxy: FaultProxy, direct: Any, client: Any, key: str
) -> None:
    direct.put_object(Bucket=s3.bucket, Key=key, Body=b"first")
    conditions = [{"IfNoneMatch": "*"}, {"IfMatch": '"not-the-etag"'}]
    for s3_client_ in (direct, client):  # SeaweedFS enforces both; pass mode forwards them
        for condition in conditions:
            with pytest.raises(ClientError) as err:
                s3_client_.put_object(Bucket=s3.bucket, Key=key, Body=b"no", **condition)
            assert error_of(err) == ("PreconditionFailed", 412)
    proxy.set_mode("strip_conditional", secret_key=s3.env["AWS_SECRET_ACCESS_KEY"])
    client.put_object(Bucket=s3.bucket, Key=key, Body=b"second", IfNoneMatch="*")
    client.put_object(Bucket=s3.bucket, Key=key, Body=b"third", IfMatch='"not-the-etag"')
    assert direct.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"third"
    assert proxy.faults_injected == 2


def test_strip_conditional_needs_the_secret_to_resign(
    s3: S3Server, proxy: FaultProxy, client: Any, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # botocore signs If-None-Match: stripped and not re-signed, SeaweedFS rejects the signature.
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    proxy.set_mode("strip_conditional")
    with pytest.raises(ClientError) as err:
        client.put_object(Bucket=s3.bucket, Key=key, Body=b"x", IfNoneMatch="*")
    assert error_of(err) == ("SignatureDoesNotMatch", 403)
    # The secret from the environment (how boto3 itself finds it) is read by set_mode.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env["AWS_SECRET_ACCESS_KEY"])
    proxy.set_mode("strip_conditional")
    client.put_object(Bucket=s3.bucket, Key=key, Body=b"y", IfNoneMatch="*")
    client.put_object(Bucket=s3.bucket, Key=key, Body=b"z", IfNoneMatch="*")


def test_delay_slows_responses(
    s3: S3Server, proxy: FaultProxy, direct: Any, client: Any, key: str
) -> None:
    direct.put_object(Bucket=s3.bucket, Key=key, Body=b"d" * 1000)
    client.head_object(Bucket=s3.bucket, Key=key)  # the delay also hits a pooled connection
    proxy.set_mode("delay", seconds=0.3)
    start = time.monotonic()
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"d" * 1000
    assert time.monotonic() - start >= 0.3
    assert proxy.faults_injected == 1  # one per response (each of its chunks waits)


# --- framing against a stdlib server: one keep-alive connection, every kind of body -----------

CHUNKS = [b"alpha-", b"b" * 70000, b"-omega"]


class _Framing(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, chunked, and 100 Continue for Expect
    peers: set[tuple[str, int]] = set()  # upstream connections seen: the proxy's, one per client

    def do_HEAD(self) -> None:
        self.peers.add(self.client_address)
        self._head(200, [("Content-Length", "1000")])

    def do_GET(self) -> None:
        self.peers.add(self.client_address)
        if self.path == "/chunked":
            self._head(200, [("Transfer-Encoding", "chunked")])
            for chunk in CHUNKS:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\nX-Trailer: t\r\n\r\n")
        elif self.path == "/empty":
            self._head(204, [])
        else:
            self._body(b"f" * 5000)

    def do_PUT(self) -> None:
        self.peers.add(self.client_address)
        if self.headers.get("Transfer-Encoding") == "chunked":
            received = b"".join(iter(self._read_chunk, b""))  # http.client sends no trailers
        else:
            received = self.rfile.read(int(self.headers["Content-Length"]))
        self._body(b"got %d" % len(received))

    def _read_chunk(self) -> bytes:
        size = int(self.rfile.readline(), 16)
        data = self.rfile.read(size)
        self.rfile.readline()
        return data

    def _head(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()

    def _body(self, body: bytes) -> None:
        self._head(200, [("Content-Length", str(len(body)))])
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


@pytest.fixture()
def framing_proxy() -> Iterator[FaultProxy]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Framing)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with FaultProxy(f"http://127.0.0.1:{server.server_port}") as proxy:
            yield proxy
    finally:
        server.shutdown()
        server.server_close()


def request(conn: http.client.HTTPConnection, method: str, path: str, **kwargs: Any) -> bytes:
    conn.request(method, path, **kwargs)
    return conn.getresponse().read()


def test_framing_on_one_keep_alive_connection(framing_proxy: FaultProxy) -> None:
    _Framing.peers.clear()
    conn = http.client.HTTPConnection("127.0.0.1", framing_proxy.port, timeout=5)
    assert request(conn, "HEAD", "/x") == b""  # Content-Length 1000, but no body follows
    assert request(conn, "GET", "/chunked") == b"".join(CHUNKS)
    assert request(conn, "GET", "/empty") == b""
    assert request(conn, "PUT", "/up", body=iter(CHUNKS), encode_chunked=True) == b"got 70012"
    # The server answers 100 Continue first; the proxy passes it on and then the final response.
    expect = {"Expect": "100-continue"}
    assert request(conn, "PUT", "/up", body=b"e" * 3000, headers=expect) == b"got 3000"
    assert request(conn, "GET", "/fixed") == b"f" * 5000
    conn.close()
    assert len(_Framing.peers) == 1 and framing_proxy.requests_seen == 6


def test_truncate_skips_responses_without_content_length(framing_proxy: FaultProxy) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", framing_proxy.port, timeout=5)
    framing_proxy.set_mode("truncate", after_bytes=100, count=1)
    assert request(conn, "GET", "/chunked") == b"".join(CHUNKS)
    conn.request("GET", "/fixed")
    with pytest.raises(http.client.IncompleteRead) as short:
        conn.getresponse().read()
    assert len(short.value.partial) == 100
    conn.close()
