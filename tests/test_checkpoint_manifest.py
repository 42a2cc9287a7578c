"""The checkpoint manifest: checksums split over the ranks on save and on load, every file read once."""

import os
import random

import pytest

from checkpoint_harness import gather_checksums_reads
from mimo.checkpoint import manifest


def test_shares_give_every_file_to_one_rank_balanced_and_order_free():
    rng = random.Random(0)
    sizes = {f"__{i}_0.distcp": rng.randrange(1, 10**9) for i in range(37)}
    sizes.update({"common.pt": 10, "metadata.json": 10, ".metadata": 10**4})
    split = manifest.shares(sizes, 4)
    assert sorted(n for s in split for n in s) == sorted(sizes)  # each file exactly once
    loads = [sum(sizes[n] for n in s) for s in split]
    assert max(loads) - min(loads) <= max(sizes.values())  # LPT: within one file of each other
    shuffled = dict(sorted(sizes.items(), key=lambda kv: rng.random()))
    assert manifest.shares(shuffled, 4) == split  # every rank computes the same split
    assert manifest.shares(sizes, 1) == [sorted(sizes, key=lambda n: (-sizes[n], n))]
    assert manifest.shares({"a": 5}, 3) == [["a"], [], []]  # more ranks than files


def test_gather_checksums_reads_each_file_once_over_the_ranks(tmp_path):
    rng = random.Random(1)
    os.makedirs(tmp_path / "sub")
    for i in range(7):
        (tmp_path / f"__{i}_0.distcp").write_bytes(rng.randbytes(rng.randrange(1000, 200_000)))
    (tmp_path / "sub" / "rng_0.pt").write_bytes(b"x" * 30)
    (tmp_path / manifest.MANIFEST).write_text("{}")  # an old manifest is not one of the files
    ckpt = str(tmp_path)
    oracle = manifest.checksum_files(ckpt, list(manifest.listing(ckpt)))  # one process reads everything
    assert len(oracle) == 8 and manifest.MANIFEST not in oracle

    results = gather_checksums_reads(ckpt, 3)
    assert results[0][0] == oracle  # rank 0, which writes the manifest, gets every entry
    assert [files for files, _ in results[1:]] == [{}, {}]  # the others receive nothing back
    reads = [read for _, read in results]
    assert sorted(n for r in reads for n in r) == sorted(oracle)  # each file read by exactly one rank
    assert reads == manifest.shares(manifest.listing(ckpt), 3)  # each rank read only its own share
    assert all(reads)


def test_verify_share_checks_only_its_share_and_the_shares_cover_every_file(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}").write_bytes(bytes([i]) * (100 * (i + 1)))
    ckpt = str(tmp_path)
    manifest.write_manifest(ckpt)
    victim = "f2"
    data = bytearray((tmp_path / victim).read_bytes())
    data[50] ^= 0xFF
    (tmp_path / victim).write_bytes(bytes(data))
    owner = [r for r, s in enumerate(manifest.shares(manifest.listing(ckpt), 3)) if victim in s]
    assert len(owner) == 1
    for rank in range(3):
        if rank == owner[0]:
            with pytest.raises(manifest.CheckpointError) as err:
                manifest.verify_share(ckpt, rank, 3)
            assert str(err.value) == f"{os.path.join(ckpt, victim)}: corrupt (CRC32 differs from the manifest)"
        else:
            manifest.verify_share(ckpt, rank, 3)  # not its file


def test_bench_manifest_tool_prints_one_line_per_rank_count(tmp_path, capsys):
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
    import bench_manifest

    assert bench_manifest.main(["--dir", str(tmp_path), "--files", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert bench_manifest.main(["--dir", str(tmp_path), "--files", "3", "--mib", "1", "--ranks", "2",
                                "--repeat", "1"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    row = json.loads(line)
    assert row["ranks"] == 2 and row["files"] == 3 and row["seconds"] > 0
    assert len(os.listdir(tmp_path)) == 3


def test_a_manifest_of_the_wrong_shape_is_one_error(tmp_path):
    from mimo.checkpoint.manifest import MANIFEST, read_manifest
    from mimo.checkpoint.paths import CheckpointError

    path = tmp_path / MANIFEST
    for text in ("[1, 2]", '{"files": [1]}', '{"files": {"a": {"bytes": "x", "crc32": 1}}}', '{"files": {"a": 3}}',
                 "{}", "not json"):
        path.write_text(text)
        with pytest.raises(CheckpointError, match=f"^{path}: unreadable"):
            read_manifest(str(tmp_path))
    path.write_text('{"files": {"a": {"bytes": 3, "crc32": 7}}}')
    assert read_manifest(str(tmp_path)) == {"a": {"bytes": 3, "crc32": 7}}
