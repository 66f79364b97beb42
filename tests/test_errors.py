"""Bad input gets a clear RuntimeError naming the argument; nothing crashes the interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import relpos_ext

CASES = [
    # (description, callable, regex the message must match)
    ("rel_gather: table 1-D", lambda: relpos_ext.rel_gather(torch.randn(5), 3, 3, 2), r"table must be"),
    ("rel_gather: rows != 2K+1", lambda: relpos_ext.rel_gather(torch.randn(4, 8), 3, 3, 2), r"table must have 2\*max_distance\+1 = 5 rows"),
    ("rel_gather: negative K", lambda: relpos_ext.rel_gather(torch.randn(1, 8), 3, 3, -1), r"max_distance must be >= 0"),
    ("rel_gather: negative length", lambda: relpos_ext.rel_gather(torch.randn(5, 8), -1, 3, 2), r"q_len and k_len must be >= 0"),
    ("rel_gather: integer table", lambda: relpos_ext.rel_gather(torch.ones(5, 8, dtype=torch.int32), 3, 3, 2), r"table must be float32"),
    ("rel_gather_backward: grad 2-D", lambda: relpos_ext.rel_gather_backward(torch.randn(3, 8), 2), r"grad must be \[Lq, Lk, D\]"),
    ("skew: 1-D", lambda: relpos_ext.skew(torch.randn(5)), r"x must have at least 2 dims"),
    ("skew: too narrow", lambda: relpos_ext.skew(torch.randn(6, 3)), r"x must be \[\.\.\., Lq, Lq\+Lk-1\]"),
    ("skew: causal not square", lambda: relpos_ext.skew(torch.randn(4, 5), causal=True), r"causal skew needs a square x"),
    ("skew_backward: causal not square", lambda: relpos_ext.skew_backward(torch.randn(4, 5), causal=True), r"needs a square grad"),
    ("rel_logits: q 3-D", lambda: relpos_ext.rel_logits(torch.randn(2, 4, 8), torch.randn(5, 8), 2, 4), r"q must be \[B, H, Lq, D\]"),
    ("rel_logits: table rows", lambda: relpos_ext.rel_logits(torch.randn(1, 2, 4, 8), torch.randn(6, 8), 2, 4), r"table must have 2\*max_distance\+1 = 5 rows"),
    ("rel_logits: negative K", lambda: relpos_ext.rel_logits(torch.randn(1, 2, 4, 8), torch.randn(5, 8), -2, 4), r"max_distance must be >= 0"),
    ("rel_logits: dtype mismatch", lambda: relpos_ext.rel_logits(torch.randn(1, 2, 4, 8), torch.randn(5, 8, dtype=torch.float64), 2, 4), r"table dtype must match q dtype"),
    ("rel_logits: D mismatch", lambda: relpos_ext.rel_logits(torch.randn(1, 2, 4, 8), torch.randn(5, 7), 2, 4), r"table's last dim must equal q's head dim"),
    ("rel_logits: heads mismatch", lambda: relpos_ext.rel_logits(torch.randn(1, 2, 4, 8), torch.randn(3, 5, 8), 2, 4), r"per-head table .* must have H equal to q.size\(1\)=2"),
    ("rel_logits: negative k_len", lambda: relpos_ext.rel_logits(torch.randn(1, 2, 4, 8), torch.randn(5, 8), 2, -4), r"k_len must be >= 0"),
    ("rel_logits: device mismatch", lambda: relpos_ext.rel_logits(torch.randn(1, 2, 4, 8), torch.randn(5, 8, device="meta"), 2, 4), r"table must be on the device of q"),
    ("rel_logits_backward: grad shape", lambda: relpos_ext.rel_logits_backward(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 4, 8), torch.randn(5, 8), 2), r"grad must be \[B, H, Lq, Lk\]"),
]


@pytest.mark.parametrize("desc,fn,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(desc, fn, pattern):
    with pytest.raises((RuntimeError, ValueError), match=pattern):
        fn()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for a cpu/cuda mix")
def test_cpu_cuda_mismatch():
    with pytest.raises(RuntimeError, match="must be on"):
        relpos_ext.rel_logits(torch.randn(1, 2, 4, 8, device="cuda"), torch.randn(5, 8), 2, 4)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_number_in_error_message_in_fresh_process(device):
    """An error message with a number in it ("got -1") raises in a fresh interpreter instead of
    crashing it. A module holding its own copy of libstdc++ beside torch's (linked from
    libstdc++.a; CMakeLists.txt links torch's libstdc++.so to prevent it) segfaulted here, on a
    lent GPU machine's build, CPU and CUDA alike; on the CI machines such a module drops the
    number from the message instead ("got "), so the whole message is checked."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    code = ("import torch, relpos_ext\n"
            f"relpos_ext.rel_gather(torch.randn(5, 8, device='{device}'), 4, 4, -1)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert "RuntimeError: max_distance must be >= 0; got -1" in run.stderr


def test_bad_isa_override(monkeypatch):
    monkeypatch.setenv("RELPOS_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError, match="RELPOS_CPU_ISA must be one of"):
        relpos_ext.rel_gather(torch.randn(5, 8), 3, 3, 2)


def test_positions_out_of_range(cpu_isa):
    """Offsets beyond +-2^60 and K beyond 2^60 (where the index math could overflow int64 and
    index out of bounds) are errors; window bounds below -1 too. K = 2^60 without tables and a
    window of 2^62 or more (wider than any distance: no bound) run."""
    q, table = torch.randn(1, 1, 5, 8), torch.randn(7, 8)
    for kw in (dict(q_offset=2**60 + 1), dict(k_offset=-2**60 - 1), dict(q_offset=2**63 - 4)):
        with pytest.raises(RuntimeError, match=r"q_offset and k_offset must be within "
                                               r"\[-2\^60, 2\^60\]"):
            relpos_ext.rel_attention(q, q, q, table, table, 3, **kw)
        with pytest.raises(RuntimeError, match="q_offset and k_offset must be within"):
            relpos_ext.rel_logits(q, table, 3, 5, **kw)
        with pytest.raises(RuntimeError, match="q_offset and k_offset must be within"):
            relpos_ext.rel_gather(table, 5, 5, 3, **kw)
    with pytest.raises(RuntimeError, match=r"max_distance must be at most 2\^60"):
        relpos_ext.rel_attention(q, q, q, None, None, 2**60 + 1)
    for kw in (dict(window_left=-2), dict(window_right=-5)):
        with pytest.raises(RuntimeError, match="window_left and window_right must be >= 0, or -1"):
            relpos_ext.rel_attention(q, q, q, table, table, 3, **kw)
    want = relpos_ext.rel_attention(q, q, q, None, None, 2, q_offset=-100)
    for window in (2**62, 2**63 - 1):
        got = relpos_ext.rel_attention(q, q, q, None, None, 2, q_offset=-100, window_left=window,
                                       window_right=window)
        assert torch.equal(got, want)
    for dtype in (torch.float32, torch.float64):
        x = q.to(dtype).requires_grad_()
        out = relpos_ext.rel_attention(x, x, x, None, None, 2**60, causal=True)
        out.sum().backward()
        ref = relpos_ext.rel_attention(x, x, x, None, None, 4, causal=True)
        torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_meta_argument_with_cpu_inputs():
    """One argument on the meta device and the rest on the CPU: the dispatcher runs the fake
    kernel then, which must refuse (not return uninitialised CPU memory). All on meta: shapes."""
    q, table = torch.randn(1, 2, 5, 8), torch.randn(7, 8)
    meta_mask = torch.zeros(1, 5, dtype=torch.bool, device="meta")
    with pytest.raises(RuntimeError, match=r"key_padding_mask must be on the device of q \(cpu\)"):
        relpos_ext.rel_attention(q, q, q, table, table, 3, key_padding_mask=meta_mask)
    with pytest.raises(RuntimeError, match=r"rel_v must be on the device of q \(cpu\); got meta"):
        relpos_ext.rel_attention(q, q, q, table, table.to("meta"), 3)
    out = relpos_ext.rel_attention(q.to("meta"), q.to("meta"), q.to("meta"), table.to("meta"),
                                   None, 3, key_padding_mask=meta_mask)
    assert out.device.type == "meta" and out.shape == q.shape


def test_module_bad_config():
    with pytest.raises(ValueError, match="divisible"):
        relpos_ext.nn.ShawRelativeAttention(30, 4, 2)
    with pytest.raises(ValueError, match="max_distance"):
        relpos_ext.nn.ShawRelativeAttention(32, 4, -1)
    for cls in (relpos_ext.nn.ShawRelativeAttention, relpos_ext.nn.RelativeMultiheadAttention):
        with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\]"):
            cls(32, 4, 2, dropout=1.5)
        with pytest.raises(ValueError, match=r"divisible by num_heads \(0\) > 0"):
            cls(32, 0, 2)
    for window in ((1, 2, 3), (4,), (-5, 0), (0, -2)):
        with pytest.raises(ValueError, match=r"window must be \(left, right\), each >= 0 or -1"):
            relpos_ext.nn.RelativeMultiheadAttention(32, 4, 2, window=window)
    with pytest.raises(ValueError, match=r"x must be \[B, L, E\] with E = embed_dim = 32; got "
                                         r"\(5, 32\)"):
        relpos_ext.nn.ShawRelativeAttention(32, 4, 2)(torch.randn(5, 32))


def test_build_info():
    info = relpos_ext.build_info()
    assert info["version"] == relpos_ext.__version__
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert "scalar" in info["cpu_kernels"]
    assert info["cpu_kernel_in_use"] in info["cpu_kernels"]
    assert info["cuda_archs"] is None or all(a.isdigit() for a in info["cuda_archs"])


def test_build_info_float64_attention(monkeypatch):
    """float64 attention runs the scalar kernels on the scalar path, and on a vector path either
    their AVX2/FMA build (GCC and clang builds for x86) or the scalar ones again."""
    info = relpos_ext.build_info()
    assert info["cpu_float64_attention"] in ("scalar", "avx2")
    if info["cpu_float64_attention"] == "avx2":
        assert "avx2" in info["cpu_kernels"] and info["cpu_kernel_in_use"] != "scalar"
    monkeypatch.setenv("RELPOS_CPU_ISA", "scalar")
    assert relpos_ext.build_info()["cpu_float64_attention"] == "scalar"


def test_fma_peak(monkeypatch):
    """The benchmarks' roofline peak: a plausible rate where the AVX2 (or AVX-512) kernels run,
    None where they cannot (forced scalar path)."""
    from relpos_ext import _C

    if relpos_ext.build_info()["cpu_kernel_in_use"] != "scalar":
        rate = _C._fma_peak_gflops(1, 0.05)
        # 8 or 16 lanes x 2 FLOP x 2 FMA units at 0.5-6 GHz: far outside means the loop was
        # optimised away or miscounted
        assert 5 < rate < 400
    monkeypatch.setenv("RELPOS_CPU_ISA", "scalar")
    assert _C._fma_peak_gflops(1, 0.05) is None


def test_nested_tensors_say_what_to_do():
    """Nested (jagged) tensors: a message pointing at segment ids or padding, not the
    dispatcher's bare 'NotImplementedError: relpos.rel_attention.default'."""
    def jagged(*lengths):
        return torch.nested.nested_tensor([torch.randn(2, n, 8) for n in lengths],
                                          layout=torch.jagged)

    q, table = jagged(3, 5), torch.randn(5, 8)
    with pytest.raises(NotImplementedError, match="nested .* q_segment_ids"):
        relpos_ext.rel_attention(q, q, q, table, table, 2)
    with pytest.raises(NotImplementedError, match="relpos::rel_logits does not take nested"):
        relpos_ext.rel_logits(q, table, 2, 5)
    with pytest.raises(NotImplementedError, match=r"rope does not take nested .* x\.values\(\)"):
        relpos_ext.rope(q, table, table)
