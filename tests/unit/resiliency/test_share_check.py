"""Who checks which file of a step before a restore: the share each rank re-hashes (its own
shard files first) and the hand-over between the streaming read and the re-hash thread."""

from __future__ import annotations

import threading
import time

from resiliency.checkpoint.restore.share_check import ShareCheck
from resiliency.storage.checksum import FileEntry
from resiliency.storage.verify import balanced_share

FILES = [
    FileEntry("model/__0_0.distcp", 700, "0"),
    FileEntry("model/__1_0.distcp", 900, "0"),
    FileEntry("model/__2_0.distcp", 800, "0"),
    FileEntry("model/common.pt", 10, "0"),
    FileEntry("model/.metadata", 40, "0"),
    FileEntry("train_state.json", 5, "0"),
]


def _paths(entries: list[FileEntry]) -> set[str]:
    return {e.path for e in entries}


def test_each_rank_re_hashes_its_own_shard_files() -> None:
    shares = [_paths(balanced_share(FILES, r, 3)) for r in range(3)]
    for rank in range(3):
        assert f"model/__{rank}_0.distcp" in shares[rank]
    assert set().union(*shares) == _paths(FILES)  # every file, once
    assert sum(len(s) for s in shares) == len(FILES)


def test_shards_of_ranks_that_no_longer_exist_are_spread_by_size() -> None:
    shares = [_paths(balanced_share(FILES, r, 2)) for r in range(2)]
    assert "model/__0_0.distcp" in shares[0] and "model/__1_0.distcp" in shares[1]
    assert "model/__2_0.distcp" in shares[0]  # rank 0 had fewer bytes (700 < 900)
    assert shares[0] | shares[1] == _paths(FILES) and not shares[0] & shares[1]


def _check(reads: bool = True) -> ShareCheck:
    return ShareCheck({e.path: e for e in FILES[:2] + FILES[3:4]}, reads_shards=reads)


def test_the_re_hash_skips_what_the_read_checked_and_takes_what_it_did_not() -> None:
    check = _check()
    assert check.rehash_takes("model/common.pt")  # a small file: at once
    assert check.claim("model/common.pt") is None  # never the read's
    assert check.claim("model/__2_0.distcp") is None  # not this rank's share
    assert check.claim("model/__0_0.distcp") is not None
    assert check.claim("model/__1_0.distcp") is not None
    check.checked("model/__0_0.distcp", None)  # __1_0: the read failed before its end
    taken: dict[str, bool] = {}
    waiter = threading.Thread(
        target=lambda: taken.update({p: check.rehash_takes(p) for p in ("model/__0_0.distcp",
                                                                          "model/__1_0.distcp")})
    )  # fmt: skip
    waiter.start()
    time.sleep(0.3)
    assert not taken, "a shard file waits for the read to end"
    check.release()
    waiter.join(timeout=5)
    assert taken == {"model/__0_0.distcp": False, "model/__1_0.distcp": True}
    assert check.claim("model/__1_0.distcp") is None  # the read is over


def test_without_a_read_the_re_hash_takes_every_file_at_once() -> None:
    check = _check(reads=False)
    assert check.claim("model/__0_0.distcp") is None
    assert check.rehash_takes("model/__0_0.distcp")


def test_the_read_keeps_the_first_mismatch() -> None:
    check = _check()
    check.claim("model/__0_0.distcp")
    check.checked("model/__0_0.distcp", "first")
    check.checked("model/__1_0.distcp", "second")
    assert check.problem == "first"
