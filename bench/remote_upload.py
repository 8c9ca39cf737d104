"""P7: the object-store tier's upload throughput ÷ the server's raw PUT throughput, one run.

A real S3 server (SeaweedFS, bench/s3_server.py) on this machine; a synthetic committed step of
``files`` × ``file_mib`` random bytes. Raw: the same files PUT with boto3 by the same number of
threads, no checks (the most a client gets from this server). Upload: ``upload_step`` as the
uploader runs it, the whole protocol included: the local step re-hashed against its manifest
first, Content-MD5 on every PUT, If-None-Match, a HEAD before and after each object, then the
manifest and COMMITTED. Raw and upload repetitions are interleaved, each into a fresh prefix.

    python bench/remote_upload.py [--files 32] [--file-mib 16] [--reps 3] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.s3_server import running_s3_server  # noqa: E402
from resiliency.storage.checksum import describe_files  # noqa: E402
from resiliency.storage.layout import RunLayout, payload_files  # noqa: E402
from resiliency.storage.manifest import Manifest  # noqa: E402
from resiliency.storage.object_store import ObjectStore  # noqa: E402
from resiliency.storage.publish import begin_step, publish, write_manifest_and_commit  # noqa: E402
from resiliency.storage.remote import upload_step  # noqa: E402


def write_step(root: Path, files: int, file_mib: int) -> Path:
    layout = RunLayout(root, "bench")
    tmp = begin_step(layout, 1, 1)
    rng = random.Random(1)
    for i in range(files):
        path = tmp / "model" / f"__{i}_0.distcp"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(file_mib << 20))
    files_ = describe_files(tmp, payload_files(tmp), fsync=False)
    write_manifest_and_commit(tmp, Manifest(run_id="bench", attempt=1, step=1, world_size=1,
                                            files=files_))  # fmt: skip
    return publish(layout, tmp, 1)


def raw_put(store: ObjectStore, step_dir: Path, workers: int) -> float:
    paths = sorted((step_dir / "model").iterdir())

    def put(path: Path) -> None:
        with open(path, "rb") as body:
            store.client.put_object(Bucket=store.bucket, Key=store.key(path.name), Body=body)

    started = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(put, paths))
    return time.perf_counter() - started


def bench_remote(work: Path, files: int, file_mib: int, reps: int, workers: int) -> dict:
    step_dir = write_step(work / "runs", files, file_mib)
    total = files * (file_mib << 20)
    raw: list[float] = []
    upload: list[float] = []
    with running_s3_server(work / "s3") as server:
        os.environ.update(server.env)
        for rep in range(reps):
            raw_store = ObjectStore(server.url(f"raw-{rep}"), server.endpoint_url, workers)
            raw.append(total / raw_put(raw_store, step_dir, workers))
            store = ObjectStore(server.url(f"up-{rep}"), server.endpoint_url, workers)
            report = upload_step(store, step_dir, "bench", workers)
            upload.append(total / report.seconds)
    ratios = [u / r for u, r in zip(upload, raw)]
    return {
        "bytes": total,
        "files": files,
        "workers": workers,
        "raw_MiBps": _stats([r / 2**20 for r in raw]),
        "upload_MiBps": _stats([u / 2**20 for u in upload]),
        "P7": _stats(ratios),
    }


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=32)
    parser.add_argument("--file-mib", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        result = bench_remote(Path(tmp), args.files, args.file_mib, args.reps, args.workers)
    print(json.dumps(result, indent=1))
    return 0


def rows(result: dict[str, Any]) -> tuple[dict[str, float], str]:
    note = (
        f"upload {result['upload_MiBps']['median']:.0f} MiB/s vs raw PUT "
        f"{result['raw_MiBps']['median']:.0f} MiB/s ({result['files']} objects, "
        f"{result['bytes'] / 2**20:.0f} MiB, {result['workers']} threads; SeaweedFS, this host)"
    )
    return result["P7"], note


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
