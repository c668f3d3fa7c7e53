"""Units are sharded as soon as their last tensor arrives, in whatever order files come."""

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from tests.dist import run_ranks, values

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _shuffled_copy(src, dst, seed):
    """Link ``src``'s files into ``dst`` with the index's entries (and so its files) reordered."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "model.safetensors.index.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        index = json.load(f)
    items = list(index["weight_map"].items())
    random.Random(seed).shuffle(items)
    index["weight_map"] = dict(items)
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return [name for name in dict.fromkeys(v for _, v in items)]


def _load_and_gather(rank, world_size, path, read_mode):
    from torch.distributed.tensor import DTensor

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    loaded = load_hsdp_model(path, HSDPInferenceConfig(), read_mode=read_mode)
    full = {}
    for name, p in loaded.model.named_parameters():
        full[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach()  # all-gather on every rank
    return full, loaded.stats.events


def _unit_of(name, units):
    owners = [u for u in units if u and (name == u or name.startswith(u + "."))]
    return max(owners, key=len) if owners else ""


def _in_subtree(owner, unit):
    return not unit or owner == unit or owner.startswith(unit + ".")


@pytest.mark.parametrize("arch,seed", [("llama", 1), ("qwen2", 2)])
def test_shuffled_files_give_identical_weights_and_shard_on_last_tensor(tmp_path, checkpoints, arch, seed):
    path = str(tmp_path / "shuffled")
    _shuffled_copy(checkpoints[arch], path, seed)
    reference = {}
    for name in os.listdir(checkpoints[arch]):
        if name.endswith(".safetensors"):
            reference.update(load_file(os.path.join(checkpoints[arch], name)))

    results = values(run_ranks(_load_and_gather, 2, tmp_path, path, "sliced", timeout=180))
    for full, events in results:
        for name, tensor in reference.items():
            assert torch.equal(full[name], tensor), name
        if "lm_head.weight" not in reference:  # tied: the head is the embedding
            assert torch.equal(full.get("lm_head.weight", full["model.embed_tokens.weight"]),
                               reference["model.embed_tokens.weight"])

        shards = [name for kind, name in events if kind == "shard"]
        assert len(shards) == len(set(shards)), "a unit was sharded twice"
        assert shards[-1] == "", "the root must be sharded last"
        assert len(shards) > 2
        tensors = [(i, name) for i, (kind, name) in enumerate(events) if kind == "tensor"]
        assert sorted(n for _, n in tensors) == sorted(n for n in reference if n in full)
        for unit in shards:
            shard_at = events.index(("shard", unit))
            # A unit completes with its own tensors and those of the units nested in it (the
            # root's subtree is every tensor).
            own = [i for i, name in tensors if _in_subtree(_unit_of(name, shards), unit)]
            last = max(own) if own else -1
            # Nothing but the completion of nested units may come between that last tensor and its shard.
            between = events[last + 1 : shard_at]
            assert all(kind == "shard" for kind, _ in between), (unit, between)
            assert all(i < shard_at for i in own), f"{unit} sharded before all its tensors arrived"


def test_files_are_read_in_index_order(tmp_path, checkpoints):
    path = str(tmp_path / "shuffled")
    file_order = _shuffled_copy(checkpoints["llama"], path, 7)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    _, events = values(run_ranks(_load_and_gather, 1, tmp_path, path, "full", timeout=120))[0]
    seen = [weight_map[name] for kind, name in events if kind == "tensor"]
    assert list(dict.fromkeys(seen)) == file_order


def _load_mapped(rank, world_size, path, map_files, cold):
    """Load ``path`` (its files taken for cold ones where ``cold``: :func:`test_is_cold_asks_the_page_cache`
    checks that verdict on a real file); return the full weights, the stats, whether each local shard lies in a mapping of a checkpoint file, and,
    after writing zeros into those shards, whether the files' bytes changed."""
    import hashlib

    from torch.distributed.tensor import DTensor

    from loaders import load_hsdp_model
    from shard_engine import HSDPInferenceConfig

    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))

    def digest():
        h = hashlib.sha256()
        for name in files:
            with open(name, "rb") as f:
                h.update(f.read())
        return h.hexdigest()

    before = digest()
    if cold:  # (these files are too small to stay cold: reading a header reads the whole file ahead)
        import loaders.streaming

        loaders.streaming.is_cold = lambda fd, spans: True
    loaded = load_hsdp_model(path, HSDPInferenceConfig(), map_files=map_files)
    regions = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] in files:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                regions.append((low, high))
    locals_ = {n: p.to_local() for n, p in loaded.model.named_parameters() if isinstance(p, DTensor)}
    in_file = {n: any(lo <= t.data_ptr() < hi for lo, hi in regions) for n, t in locals_.items() if t.numel()}
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
            for n, p in loaded.model.named_parameters()}
    with torch.no_grad():
        for t in locals_.values():
            t.zero_()  # a write into a mapped shard: copy-on-write, never into the file
    zeroed = all(not t.any() for t in locals_.values())
    return full, loaded.stats.bytes_read, loaded.stats.bytes_mapped, in_file, zeroed, digest() == before


def test_warm_files_rows_are_views_of_a_private_mapping_and_cold_ones_are_read(tmp_path, checkpoints):
    path = checkpoints["llama"]
    reference = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            reference.update(load_file(os.path.join(path, name)))
    mapped = values(run_ranks(_load_mapped, 2, tmp_path, path, True, False, timeout=180))
    read = values(run_ranks(_load_mapped, 2, tmp_path, path, False, False, timeout=180))
    for (full, bytes_read, bytes_mapped, in_file, zeroed, unchanged), (full_read, read_bytes, none_mapped, in_file_read,
                                                                       _, _) in zip(mapped, read):
        for name, tensor in reference.items():
            assert torch.equal(full[name], tensor) and torch.equal(full_read[name], tensor), name
        assert bytes_mapped == bytes_read == read_bytes > 0 and none_mapped == 0
        assert in_file and all(in_file.values()), in_file  # every shard is the file's own pages
        assert not any(in_file_read.values())
        assert zeroed and unchanged  # written privately: the checkpoint's bytes are as they were
    # a file not in the page cache is read: its pages come from the device either way
    [(full, bytes_read, bytes_mapped, in_file, _, _)] = values(run_ranks(_load_mapped, 1, tmp_path, path, True, True,
                                                                          timeout=120))
    assert bytes_read > 0 and bytes_mapped == 0 and not any(in_file.values())
    for name, tensor in reference.items():
        assert torch.equal(full[name], tensor), name


def test_rows_at_an_offset_their_dtype_cannot_view_are_read_instead(tmp_path):
    """safetensors does not promise aligned offsets: a float32 tensor 3 bytes in is read, not viewed."""
    import struct

    from loaders.safetensors_io import map_file, mapped_rows, read_header, read_rows

    values_ = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    header = json.dumps({"pad": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "w": {"dtype": "F32", "shape": [4, 2], "data_offsets": [3, 35]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"abc" + values_.numpy().tobytes())
    infos = read_header(str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        mapping = map_file(fd)
        assert mapping is not None
        assert mapped_rows(mapping, infos["w"], 1, 3, path=str(path)) is None
        assert torch.equal(read_rows(fd, infos["w"], 1, 3, path=str(path)), values_[1:3])
        assert bytes(mapped_rows(mapping, infos["pad"], 0, 3, path=str(path)).numpy()) == b"abc"
        assert mapped_rows(mapping, infos["pad"], 2, 2, path=str(path)) is None  # no rows: nothing to view
    finally:
        os.close(fd)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    fd = os.open(empty, os.O_RDONLY)
    assert map_file(fd) is None
    os.close(fd)


def test_is_cold_asks_the_page_cache(tmp_path):
    """The kernel's account of a rank's pages (mincore): a file is cold where more than a quarter of
    them are not in the page cache; the pages it asks about are not read in by asking."""
    from loaders.safetensors_io import resident_fraction
    from loaders.streaming import is_cold

    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    mib = 1 << 20
    try:
        if resident_fraction(fd, [(0, mib)]) is None:
            pytest.skip("no mincore here: is_cold falls back to RWF_NOWAIT probes")
        assert resident_fraction(fd, [(0, 8 * mib)]) == 1.0 and not is_cold(fd, [(0, 8 * mib)])  # just written
        os.fdatasync(fd)  # (a dirty page is not dropped)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert resident_fraction(fd, [(0, 8 * mib)]) == 0.0 and is_cold(fd, [(6 * mib, mib)])
        assert resident_fraction(fd, [(0, 8 * mib)]) == 0.0  # asking read nothing in
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # (no readahead beyond what is read)
        os.pread(fd, 7 * mib, 0)
        assert not is_cold(fd, [(0, 8 * mib)])  # 7/8 in
        assert is_cold(fd, [(0, mib), (7 * mib, mib)])  # half of these in
        assert not is_cold(fd, [(mib + 100, 2 * mib)])  # (offsets inside pages)
        exact = resident_fraction(fd, [(0, 8 * mib)])
        assert exact == pytest.approx(7 / 8, abs=0.01)
        with pytest.MonkeyPatch.context() as patch:  # beyond RESIDENCY_PAGES: windows of them, evenly spaced
            import loaders.safetensors_io

            patch.setattr(loaders.safetensors_io, "RESIDENCY_PAGES", 512)
            patch.setattr(loaders.safetensors_io, "RESIDENCY_WINDOW", 16)
            assert resident_fraction(fd, [(0, 8 * mib)]) == pytest.approx(exact, abs=0.02)
            assert resident_fraction(fd, [(7 * mib, mib), (0, mib)]) == pytest.approx(0.5, abs=0.02)
    finally:
        os.close(fd)


def test_is_cold_without_mincore_probes_each_span(tmp_path, monkeypatch):
    import loaders.streaming
    from loaders.streaming import is_cold

    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT: is_cold cannot ask, and says warm")
    monkeypatch.setattr(loaders.streaming, "resident_fraction", lambda fd, spans: None)
    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not is_cold(fd, [(0, 1 << 20), (4 << 20, 1 << 20)])  # just written: in the page cache
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert is_cold(fd, [(6 << 20, 1 << 20)])
        os.pread(fd, 1 << 20, 6 << 20)
        assert not is_cold(fd, [(6 << 20, 1 << 20)])
        spans = [(i << 20, 4096) for i in range(8)]  # one of eight first bytes absent: not more than a quarter
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for offset, _ in spans[1:]:
            os.pread(fd, 1, offset)
        assert not is_cold(fd, spans)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert is_cold(fd, spans)
    finally:
        os.close(fd)


_NOT_OWNER = """
import os, sys
sys.path.insert(0, sys.argv[2])
from loaders.safetensors_io import resident_fraction
from loaders.streaming import is_cold
fd = os.open(sys.argv[1], os.O_RDONLY)
os.setgid(65534); os.setuid(65534)  # (after the imports and the open: the folders above may be root's alone)
print(resident_fraction(fd, [(0, 8 << 20)]), is_cold(fd, [(0, 8 << 20)]))
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switches to another user: needs root")
def test_is_cold_for_a_file_this_process_does_not_own(tmp_path):
    """mincore calls every page of a file resident to a process that neither owns it nor may write it
    (Linux >= 5.0; a read-only model volume, an image's root-owned files): resident_fraction says it
    cannot tell, and is_cold probes instead, so a cold file is still read as cold."""
    import subprocess
    import sys

    path = tmp_path / "big.bin"
    path.write_bytes(os.urandom(8 << 20))
    path.chmod(0o644)
    fd = os.open(path, os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    out = subprocess.run([sys.executable, "-c", _NOT_OWNER, str(path), REPO], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "True"], out.stdout
