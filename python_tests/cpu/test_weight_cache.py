"""Tests of the fp16 weight copies kept on disk (specdec_kernels/cpu/weight_cache.py): a copy is
used only when it holds its weight's values bit for bit, whatever the file says; the decoder's
tokens do not depend on the cache; a directory that cannot be written falls back to memory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from specdec_kernels.cpu import weight_cache
from specdec_kernels.cpu.weight_cache import clear, fingerprint, fp16_copy, resolve
from specdec_kernels.ops.extension import HAS_EXT


def _exact(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half().float()


def _files(d):
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_a_copy_is_written_once_then_mapped(tmp_path):
    w = _exact(96, 80)
    a = fp16_copy(w, tmp_path)
    assert a is not None and torch.equal(a, w.half()) and a.shape == w.shape
    [name] = _files(tmp_path)
    assert name == fingerprint(w) + ".f16"
    before = (tmp_path / name).stat().st_mtime_ns
    b = fp16_copy(w.clone(), tmp_path)  # another tensor with the same values: the file is mapped, not rewritten
    assert torch.equal(b, w.half()) and (tmp_path / name).stat().st_mtime_ns == before
    assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


def test_the_fingerprint_samples_inside_the_weight():
    """Sizes where a float32 spacing of the samples would round the last index past the end."""
    for n in (1, 2, 4095, 4097, 233_373_696):
        w = torch.empty(n)  # uninitialised: only the sampled values are read
        assert len(fingerprint(w)) == 40


def test_a_file_that_differs_in_one_bit_is_not_used(tmp_path):
    """The fingerprint samples the weight; the full check on use catches a difference anywhere:
    a damaged file, or a weight changed where no sample looks."""
    w = _exact(3000, 7)
    fp16_copy(w, tmp_path)
    [path] = list(tmp_path.iterdir())
    raw = bytearray(path.read_bytes())
    raw[2 * 10_001] ^= 1  # the low bit of value 10,001's fp16: not a sampled position
    path.write_bytes(bytes(raw))
    assert fingerprint(w) + ".f16" == path.name
    c = fp16_copy(w, tmp_path)
    assert torch.equal(c.view(torch.int16), w.half().view(torch.int16))
    assert path.read_bytes() != bytes(raw)  # written again
    # and a weight changed off the samples: same name, another copy
    v = w.clone()
    v.view(-1)[10_001] = 0.125
    assert fingerprint(v) == fingerprint(w)
    d = fp16_copy(v, tmp_path)
    assert torch.equal(d, v.half()) and not torch.equal(d, w.half())


def test_a_weight_fp16_does_not_hold_writes_nothing(tmp_path):
    w = torch.randn(200, 300)  # not fp16-exact from its first values
    assert fp16_copy(w, tmp_path) is None and _files(tmp_path) == []
    late = _exact(200, 400)
    late.view(-1)[-1] = 1 / 3  # inexact only past the precheck: the file is made, then removed
    assert fp16_copy(late, tmp_path) is None and _files(tmp_path) == []


def test_shapes_the_cache_leaves_to_memory(tmp_path):
    for w in (torch.empty(0, 4), _exact(8, 6).T):  # empty; not contiguous
        c = fp16_copy(w, tmp_path)
        assert c is not None and torch.equal(c, w.half())
    assert _files(tmp_path) == []


def test_an_unwritable_directory_falls_back_to_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    weight_cache._warned.discard(str(blocker / "sub"))
    with pytest.warns(RuntimeWarning, match="cannot be used"):
        c = fp16_copy(_exact(16, 16), blocker / "sub")
    assert torch.equal(c, _exact(16, 16).half())


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"^fp16_copy: w must be a float32 CPU tensor, got torch.float16 on cpu$"):
        fp16_copy(torch.zeros(4, dtype=torch.float16), tmp_path)
    with pytest.raises(TypeError, match=r"^fp16_copy: directory must be a str or os.PathLike, got int$"):
        fp16_copy(torch.zeros(4), 3)


def test_resolve_and_clear(tmp_path, monkeypatch):
    monkeypatch.delenv(weight_cache.ENV, raising=False)
    assert resolve(None) is None and resolve(False) is None
    assert resolve(tmp_path) == tmp_path and resolve(str(tmp_path)) == tmp_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert resolve(True) == tmp_path / "specdec-kernels" / "fp16-weights"
    for off in ("", "0", "off"):
        monkeypatch.setenv(weight_cache.ENV, off)
        assert resolve(None) is None
    monkeypatch.setenv(weight_cache.ENV, str(tmp_path / "c"))
    assert resolve(None) == tmp_path / "c"
    with pytest.raises(TypeError, match="weight_cache must be a directory .* got int"):
        resolve(3)
    fp16_copy(_exact(10, 10), tmp_path / "c")
    fp16_copy(_exact(10, 10, seed=1), tmp_path / "c")
    assert clear(tmp_path / "c") == 2 and _files(tmp_path / "c") == []


@pytest.mark.skipif(not HAS_EXT, reason="needs the C++ extension: pip install --no-build-isolation -e .")
def test_the_decoder_gives_the_same_tokens_with_the_cache(tmp_path):
    """A pair whose weights are fp16-exact: tokens with the cache cold, warm and off are the same,
    the copies are on disk after the first, and a new process maps them (its layers stream the
    files' pages)."""
    from specdec_kernels import SpeculativeDecoder
    from specdec_kernels.models.tiny import tiny_random_pair

    draft, target, _ = tiny_random_pair(seed=0)
    for m in (draft, target):
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p.half().float())
    prompt = [[1, 5, 9, 2]]
    outs = []
    for cache in (False, tmp_path, tmp_path):
        dec = SpeculativeDecoder(draft=draft, target=target, cpu_linear="skinny", weight_cache=cache)
        outs.append(dec.generate(prompt, max_new_tokens=12).token_ids)
        if cache is not False:
            n_linear = sum(type(m) is nn.Linear for mod in (draft, target) for m in mod.modules())
            assert len(_files(tmp_path)) == n_linear
        from specdec_kernels.cpu.skinny_linear import forget_weight_copies

        forget_weight_copies(draft), forget_weight_copies(target)
    assert outs[0] == outs[1] == outs[2] and len(outs[0][0]) == 12
    with pytest.raises(ValueError, match="pass either accelerator= or cpu_linear/lean_forward/weight_cache"):
        from specdec_kernels.cpu import CpuAccelerator

        SpeculativeDecoder(draft=draft, target=target, accelerator=CpuAccelerator(), weight_cache=tmp_path)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings from /proc")
def test_a_new_process_maps_the_files(tmp_path):
    """The point of the cache: a second process finds the files and uses them (no new file, the
    copy's storage is the file's mapping)."""
    code = (
        "import sys, torch\n"
        "from specdec_kernels.cpu.weight_cache import fp16_copy\n"
        "w = torch.randn(512, 256, generator=torch.Generator().manual_seed(3)).half().float()\n"
        "c = fp16_copy(w, sys.argv[1])\n"
        "mapped = any(l.rstrip().endswith('.f16') for l in open('/proc/self/maps'))\n"
        "print(int(torch.equal(c, w.half())), mapped)\n"
    )
    written = None
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                           env={**os.environ, "PYTHONWARNINGS": "error::RuntimeWarning"})
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["1", "True"]
        [f] = list(tmp_path.iterdir())
        assert written in (None, f.stat().st_mtime_ns)  # the second process wrote nothing
        written = f.stat().st_mtime_ns
