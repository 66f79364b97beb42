"""rel_attention (fused Shaw attention): backend x dtype x case against relpos_ext.reference."""

from __future__ import annotations

import contextlib
import random

import hypothesis
import pytest
import torch
from hypothesis import strategies as st

import relpos_ext
from relpos_ext import reference as ref
from _emu import emu_seed
from conftest import (ASAN_FORWARD_BACKWARD_ONLY, Backend, assert_close,
                      assert_concurrent_calls_match, skip_unless_amx, skip_unless_avx512,
                      skip_unless_bf16_dot)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _attention_backend(backend):
    if backend.name == "cuda-emu" and not torch._C._dispatch_has_kernel_for_dispatch_key(
        "relpos_emu::rel_attention", "CPU"
    ):
        pytest.skip("no CUDA rel_attention kernel in this build yet")
    return backend


# (B, H, Hkv, Lq, Lk, D, K, q_offset, k_offset, per_head, causal, padding, rel_k?, rel_v?)
CASES = {
    "basic": (2, 2, 2, 5, 5, 16, 2, 0, 0, False, False, False, True, True),
    "causal": (1, 2, 2, 7, 7, 16, 3, 0, 0, False, True, False, True, True),
    "cross_lq_ne_lk": (2, 2, 2, 4, 9, 64, 3, 0, 0, True, False, False, True, True),
    "decode_offset": (1, 2, 2, 3, 8, 16, 2, 5, 0, False, True, False, True, True),
    "padding": (2, 2, 2, 6, 7, 80, 2, 0, 0, False, False, True, True, True),
    "K0": (1, 2, 2, 5, 6, 16, 0, 0, 0, False, True, False, True, True),
    "K_ge_L": (1, 1, 1, 6, 6, 16, 8, 0, 0, True, False, False, True, True),
    "only_rel_k": (1, 2, 2, 5, 5, 16, 2, 0, 0, False, True, False, True, False),
    "only_rel_v": (1, 2, 2, 5, 5, 16, 2, 0, 0, False, False, False, False, True),
    "no_rel": (1, 2, 2, 5, 5, 16, 2, 0, 0, False, False, False, False, False),
    "gqa": (1, 4, 2, 5, 6, 16, 2, 0, 0, True, True, True, True, True),
    "D128": (1, 1, 1, 4, 5, 128, 2, 0, 0, False, False, False, True, True),
    "fully_masked_rows": (1, 2, 2, 4, 6, 16, 1, 0, 2, False, True, False, True, True),
    "L1": (1, 1, 1, 1, 1, 16, 0, 0, 0, False, True, False, True, True),
    # several query and key tiles (the AVX2 kernel tiles by 64, CUDA kernels by smaller tiles)
    "tiles_causal_padding": (1, 2, 2, 70, 150, 16, 5, 0, 0, False, True, True, True, True),
    "tiles_unclipped": (1, 1, 1, 80, 80, 24, 100, 0, 0, True, False, False, True, True),
    # K beyond every distance, with offsets: the backward runs on the slice of the tables the
    # distances reach (r in [-23, 25]: K' = 25, rows 75..125 of 201); the other rows get 0
    "unclipped_offsets_gqa": (2, 4, 2, 20, 30, 16, 100, 7, 3, True, True, True, True, True),
    # not causal: rows of the second query tile have keys clamped to both bucket 0 and bucket 2K
    "tiles_two_sided": (1, 2, 2, 70, 150, 16, 5, 0, 0, False, False, False, True, True),
    "tiles_decode_gqa": (2, 2, 1, 65, 130, 8, 3, 40, 0, True, True, False, True, True),
    "D200_gqa4": (2, 4, 1, 19, 23, 200, 3, 0, 0, False, True, True, True, True),
    "odd_D_offsets": (1, 2, 2, 17, 35, 37, 4, 3, 1, True, True, False, True, True),
    "D1_negative_offset": (1, 1, 1, 6, 7, 1, 2, -3, 0, False, False, False, True, True),
    # the offsets' bounds, +-2^60: positions near 2^60 (distances -4..5, causal), and positions
    # 2^61 apart (every key clamped to bucket 0; the kernels' spans must not wrap around)
    "offsets_at_2_60": (1, 2, 2, 6, 9, 16, 3, 2**60, 2**60 - 3, False, True, False, True, True),
    "offsets_2_61_apart": (1, 2, 1, 5, 7, 16, 3, 2**60, -2**60, True, False, True, True, True),
    # what relpos_ext.hf makes of Transformer-XL attention: per-head tables for every distance
    # (K = L - 1), D + 2 = 66 features, keys only, padding
    "transformer_xl": (2, 4, 4, 70, 70, 66, 69, 0, 0, True, False, True, True, False),
    # a few query rows against a long cache (the AVX2 forward scores them from the key rows),
    # and more than 32 rows with an odd D (from transposed key tiles)
    "decode_gqa_odd_D": (2, 4, 2, 2, 75, 37, 4, 73, 0, True, True, True, True, True),
    "prefill_odd_D": (1, 2, 1, 40, 45, 13, 3, 0, 0, False, True, True, True, True),
    # one new row (the AVX2 kernel's single-row P V: 32 columns at a time, then 8, then masked)
    "decode_one_row_D45": (1, 2, 1, 1, 150, 45, 4, 149, 0, True, True, True, True, True),
    # a cache long enough for the AVX2 decoding path to prefetch it (>= 512 KiB of keys per kv
    # head, in every dtype)
    "decode_long_cache": (1, 2, 1, 1, 4200, 64, 8, 4199, 0, False, True, False, True, True),
    # decoding few heads against 2200 keys: the AVX2 forward splits the keys into two chunks of
    # 1152 and merges them; inside buckets straddling the chunks, padding, both clamped sides
    "decode_split_keys": (2, 4, 2, 5, 2200, 32, 40, 1136, 0, True, False, True, True, True),
    # ... causal, the second chunk invisible to every row
    "decode_split_hidden_chunk": (1, 2, 1, 3, 2200, 32, 6, 300, 0, False, True, True, True, True),
    # a few rows (float16/bfloat16 keys converted a tile at a time from 4 rows on)
    "decode_five_rows": (1, 2, 2, 5, 130, 24, 3, 125, 0, False, True, False, True, True),
    # 16 rows against 2200 keys in two chunks, K small: most key tiles are one-pass uniform
    # tiles of 8 rows (the AVX2 forward's stale maximum) inside a split decode
    "decode_split_uniform": (1, 2, 1, 16, 2200, 32, 6, 2184, 0, False, True, False, True, True),
    # enough keys per kv head (and batch * kv heads >= 8, so they are not split into chunks)
    # for the AVX2 backward to sweep them in three runs (512 keys at D = 64), each run's dK / dV
    # summed over the two query heads of its kv head: the first query tile sees none of the
    # last run, the second one's inside buckets straddle runs 1 and 2
    "bwd_key_runs": (2, 8, 4, 70, 1100, 64, 5, 960, 0, False, True, False, True, True),
    # most key tiles wholly on one clamped side of every row of a query tile: the AVX2 kernels'
    # one-pass uniform tiles, 8 rows at a time (also under dropout)
    "tiles_uniform": (1, 2, 1, 130, 300, 16, 3, 0, 0, False, False, False, True, True),
    # ... with padding in the first and last key tiles: the tiles between keep those paths
    "tiles_uniform_padding": (2, 2, 1, 130, 300, 16, 3, 0, 0, False, False, True, True, True),
    # no padding and more than 32 rows: the AVX2 forward's wide tiles (128 x 128, kernels.h), with
    # rows and keys just past one and two of them, the band across their edges, uniform tiles
    "wide_tiles": (1, 2, 1, 129, 257, 16, 40, 0, 0, False, False, False, True, True),
    # ... causal, offsets, GQA, per-head tables, 8-row groups of a partial last tile
    "wide_tiles_causal": (2, 4, 2, 200, 260, 24, 3, 60, 0, True, True, False, True, True),
    "all_keys_padded": (2, 2, 2, 5, 6, 16, 2, 0, 0, False, False, "all", True, True),
    "no_keys": (1, 2, 2, 3, 0, 16, 2, 0, 0, False, False, False, True, True),
    "no_queries": (1, 2, 2, 0, 5, 16, 2, 0, 0, False, True, False, True, True),
    "no_heads": (2, 0, 0, 3, 5, 16, 2, 0, 0, False, True, True, True, True),
    # no tables: max_distance only clips buckets nobody reads, however large
    "huge_K_no_tables": (1, 2, 1, 3, 70, 16, 2**40, 0, 0, False, True, False, False, False),
}


def make_inputs(case, dtype, requires_grad=False, q_scale=1.0):
    b, h, hk, lq, lk, d, k, qo, ko, per_head, causal, padding, has_k, has_v = case

    def t(*shape, s=1.0):
        return (torch.randn(*shape, dtype=torch.float64) * s).to(dtype).requires_grad_(requires_grad)

    q, kk, v = t(b, h, lq, d, s=q_scale), t(b, hk, lk, d), t(b, hk, lk, d)
    table_shape = ((h,) if per_head else ()) + (2 * k + 1, d)
    rel_k = t(*table_shape) if has_k else None
    rel_v = t(*table_shape) if has_v else None
    mask = None
    if padding:
        mask = torch.zeros(b, lk, dtype=torch.bool)
        mask[0, -2:] = True
        mask[-1, 0] = True
        if padding == "all":  # every key of batch 0 padded: all its rows see nothing
            mask[0, :] = True
    return (q, kk, v, rel_k, rel_v), dict(max_distance=k, causal=causal, q_offset=qo,
                                          k_offset=ko, key_padding_mask=mask)


@contextlib.contextmanager
def deterministic():
    """torch.use_deterministic_algorithms(True) within: the CUDA backward then adds its table
    gradients in a fixed order (serial_q_tiles), which tests of bitwise equality need on a real
    GPU, where float atomics land in any order (the emulator and the CPU are deterministic
    anyway)."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _f64(x):
    return None if x is None else x.detach().double().requires_grad_()


def _extra_args(backend, kw):
    """The op's trailing (dropout_p, dropout_seed, attn_mask, q_segment_ids, k_segment_ids,
    window_left, window_right, rel_bias, rel_q) from kw (the seed a CPU int64 tensor), as far
    as kw sets them."""
    p = kw.get("dropout_p", 0.0)
    seed = torch.tensor([kw["dropout_seed"]], dtype=torch.int64) if p > 0 else None
    args = [p, seed] + [None if kw.get(n) is None else backend.tensor(kw[n])
                        for n in ("attn_mask", "q_segment_ids", "k_segment_ids")]
    args += [kw.get("window_left", -1), kw.get("window_right", -1)]
    args += [None if kw.get(n) is None else backend.tensor(kw[n].detach())
             for n in ("rel_bias", "rel_q")]
    defaults = [0.0, None, None, None, None, -1, -1, None, None]
    n = len(args)
    while n > 0 and (args[n - 1] is None if defaults[n - 1] is None else
                     isinstance(args[n - 1], (int, float)) and args[n - 1] == defaults[n - 1]):
        n -= 1
    return tuple(args[:n])


def _call(backend, tensors, kw):
    q, k, v, rk, rv = (None if x is None else backend.tensor(x.detach()) for x in tensors)
    mask = kw["key_padding_mask"]
    return backend.op("rel_attention")(
        q, k, v, rk, rv, kw["max_distance"], kw["causal"], kw.get("scale"), kw["q_offset"],
        kw["k_offset"], None if mask is None else backend.tensor(mask), *_extra_args(backend, kw),
    )


def _call_backward(backend, grad, tensors, out, lse, kw):
    """rel_attention_backward of `_call`'s inputs (tensors, kw) and its results out, lse."""
    q, k, v, rk, rv = (None if x is None else backend.tensor(x.detach()) for x in tensors)
    mask = kw["key_padding_mask"]
    return backend.op("rel_attention_backward")(
        backend.tensor(grad), q, k, v, rk, rv, out, lse, kw["max_distance"], kw["causal"],
        kw.get("scale"), kw["q_offset"], kw["k_offset"],
        None if mask is None else backend.tensor(mask), *_extra_args(backend, kw),
    )


def _kw64(kw):
    """kw for the float64 reference: a rel_bias and a rel_q become float64 leaves."""
    return {**kw, "rel_bias": _f64(kw.get("rel_bias")), "rel_q": _f64(kw.get("rel_q"))}


def _reference(tensors, kw):
    """The float64 reference of the op's inputs: the leaves (q, k, v, rel_k, rel_v, rel_bias,
    rel_q; None where absent) and its out and lse, which keep their graph to the leaves."""
    t64 = [_f64(x) for x in tensors]
    kw64 = _kw64(kw)
    t64 += [kw64["rel_bias"], kw64["rel_q"]]  # the sixth and seventh gradients
    exp_out, exp_lse = ref.shaw_attention(*t64[:5], **kw64, return_lse=True)
    return t64, exp_out, exp_lse


def _assert_forward(dtype, out, lse, exp_out, exp_lse):
    assert out.shape == exp_out.shape and lse.shape == exp_lse.shape
    assert torch.isfinite(out).all()
    assert_close(out, exp_out.detach(), dtype, scale=4)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert_close(lse, exp_lse.detach().to(lse_dtype), lse_dtype,
                 scale=4 if dtype == lse_dtype else 1000)


def _assert_backward(backend, dtype, tensors, kw, out, lse, t64, exp_out):
    """The op's seven gradients for a random output gradient against the reference's."""
    grad = torch.randn(exp_out.shape, dtype=torch.float64).to(dtype)
    wrt = [x for x in t64 if x is not None]
    expected = iter(torch.autograd.grad(exp_out, wrt, grad.double()))
    grads = _call_backward(backend, grad, tensors, out, lse, kw)
    assert len(grads) == 7
    for got, x in zip(grads, t64):
        if x is None:
            assert got.numel() == 0
            continue
        assert torch.isfinite(got).all()
        # the bias gradient of a bucket sums dS over up to B x H x Lq x Lk pairs
        n = tensors[0].shape[:3].numel() if x is t64[5] else x.shape[-2]
        assert_close(got, next(expected), dtype, scale=8 * (n ** 0.5))


def _check_forward(backend, dtype, case, extra=None, q_scale=1.0):
    """extra: more keyword arguments of the op and the reference (dropout_p, dropout_seed);
    q_scale: the queries' scale (make_inputs)."""
    tensors, kw = make_inputs(case, dtype, q_scale=q_scale)
    kw.update(extra or {})
    out, lse = _call(backend, tensors, kw)
    _, exp_out, exp_lse = _reference(tensors, kw)
    _assert_forward(dtype, out, lse, exp_out, exp_lse)


def _check_backward(backend, dtype, case, extra=None, q_scale=1.0):
    tensors, kw = make_inputs(case, dtype, q_scale=q_scale)
    kw.update(extra or {})
    t64, exp_out, _ = _reference(tensors, kw)
    out, lse = _call(backend, tensors, kw)
    _assert_backward(backend, dtype, tensors, kw, out, lse, t64, exp_out)


def _check_forward_backward(backend, dtype, case, extra=None, q_scale=1.0):
    """_check_forward and _check_backward on one draw of inputs: one forward of the op and of the
    float64 reference serve both (the reference was most of these tests' time)."""
    tensors, kw = make_inputs(case, dtype, q_scale=q_scale)
    kw.update(extra or {})
    t64, exp_out, exp_lse = _reference(tensors, kw)
    out, lse = _call(backend, tensors, kw)
    _assert_forward(dtype, out, lse, exp_out, exp_lse)
    _assert_backward(backend, dtype, tensors, kw, out, lse, t64, exp_out)


def test_asan_forward_backward_only_cases_are_long_key_cases():
    """The cases the AddressSanitizer step runs on cuda-emu in the forward and backward tests
    only (conftest.py) exist, and are the long-key ones it describes."""
    assert ASAN_FORWARD_BACKWARD_ONLY <= set(CASES)
    assert {n for n, c in CASES.items() if c[4] >= 1000} == ASAN_FORWARD_BACKWARD_ONLY


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_rel_attention_forward(backend, dtype, name):
    _attention_backend(backend)
    _check_forward(backend, dtype, CASES[name])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_rel_attention_backward(backend, dtype, name):
    _attention_backend(backend)
    _check_backward(backend, dtype, CASES[name])


# Shapes the CUDA tensor-core forward takes (csrc/cuda/rel_attention_tc.cuh: float16/bfloat16,
# D a multiple of 8 up to 128; CASES has few): several 64-row query tiles and 64-key tiles, tile
# pairs inside, across and beyond the band on both sides, a partial last tile. Every backend runs
# them. The tuple is CASES's.
TC_CASES = {
    "two_sided": (1, 2, 2, 130, 200, 64, 5, 0, 0, False, False, False, True, True),
    "causal_padding_gqa": (2, 4, 2, 100, 140, 64, 20, 0, 0, True, True, True, True, True),
    "D128_offsets": (1, 2, 1, 70, 90, 128, 40, 3, 1, True, False, False, True, True),
    "K0": (1, 1, 1, 70, 130, 64, 0, 0, 0, False, False, False, True, True),
    "K_ge_L": (1, 1, 1, 70, 80, 64, 200, 0, 0, False, False, False, True, True),
    "only_rel_k": (1, 1, 1, 80, 200, 64, 40, 0, 0, False, False, True, True, False),
    "only_rel_v": (1, 1, 1, 80, 200, 64, 40, 0, 0, False, False, True, False, True),
    "decode": (1, 2, 2, 3, 300, 64, 8, 297, 0, False, True, False, True, True),
    # head dims zero-padded to the kernel's 32, 96 and 128
    "D24_causal": (1, 2, 2, 100, 100, 24, 10, 0, 0, False, True, False, True, True),
    "D40_offsets": (1, 2, 1, 70, 140, 40, 12, 5, 2, True, False, True, True, True),
    "D80_gqa": (2, 4, 2, 70, 130, 80, 30, 0, 0, True, False, True, True, True),
    "D120": (1, 1, 1, 65, 70, 120, 6, 0, 0, False, True, False, True, True),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(TC_CASES))
def test_rel_attention_forward_tensor_core_shapes(backend, dtype, name):
    _attention_backend(backend)
    _check_forward(backend, dtype, TC_CASES[name])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(TC_CASES))
def test_rel_attention_backward_tensor_core_shapes(backend, dtype, name):
    """The shapes of the tensor-core forward through the backward (on CUDA the tensor-core
    backward, csrc/cuda/rel_attention_tc_bwd.cuh, for all of them)."""
    _attention_backend(backend)
    _check_backward(backend, dtype, TC_CASES[name])


TC_EXTRAS = {
    "window": ("two_sided", {"window_left": 30, "window_right": 70}),
    "attn_mask": ("two_sided", {"attn_mask": "band"}),
    "rel_bias": ("two_sided", {"rel_bias": "per_head"}),
    "dropout": ("two_sided", {"dropout_p": 0.3, "dropout_seed": 2**40 + 7}),
    "bias_dropout_causal_padding_gqa": ("causal_padding_gqa",
                                        {"rel_bias": "shared", "dropout_p": 0.2,
                                         "dropout_seed": 12345}),
    "rel_q": ("two_sided", {"rel_q": "per_head"}),
    "rel_q_K0": ("K0", {"rel_q": "shared"}),
    "rel_q_bias_causal_padding_gqa": ("causal_padding_gqa",
                                      {"rel_q": "shared", "rel_bias": "per_head"}),
    "rel_q_D40": ("D40_offsets", {"rel_q": "per_head"}),
    # D = 128: the CUDA dq kernel's 32-key tiles (TcBwdTile) with the per-element options
    "D128_bias_dropout_window": ("D128_offsets", {"rel_bias": "per_head", "dropout_p": 0.2,
                                                  "dropout_seed": 4242, "window_left": 20,
                                                  "window_right": 50}),
    "D128_attn_mask": ("D128_offsets", {"attn_mask": "band"}),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(TC_EXTRAS))
def test_rel_attention_tensor_core_options(backend, dtype, name):
    """The options the tensor-core forward handles beyond the tables (masks checked per element,
    rel_bias along the skew, dropout, the key-side table rel_q), and the backward from its out
    and lse."""
    _attention_backend(backend)
    case_name, extra = TC_EXTRAS[name]
    case = TC_CASES[case_name]
    extra = dict(extra)
    if extra.get("attn_mask") == "band":  # hides a diagonal band and the whole last key tile
        i = torch.arange(case[3])[:, None]
        j = torch.arange(case[4])[None, :]
        extra["attn_mask"] = ((j - i).abs() < 3) | (j >= 192)
    if "rel_bias" in extra:
        extra["rel_bias"] = random_bias(case, extra["rel_bias"] == "per_head").to(dtype)
    if "rel_q" in extra:
        extra["rel_q"] = random_rel_q(case, extra["rel_q"] == "per_head").to(dtype)
    _check_forward_backward(backend, dtype, case, extra)


class _Misaligned(Backend):
    """The backend's tensors as contiguous views one element past the start of a buffer (as
    slices of a packed buffer give): 2 or 4 bytes off a 16-byte boundary."""

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = super().tensor(t)
        view = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
        return view.copy_(t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["two_sided", "D128_offsets"])
def test_rel_attention_misaligned_inputs(backend, dtype, name):
    """Inputs off a 16-byte boundary are no case for the tensor-core kernels, whose cp.async and
    ldmatrix take aligned addresses only (on a GPU a misaligned one is an error; the emulator
    checks every one): the other kernels give the reference's results, forward and backward
    (with rel_q where the tensor-core kernels take it)."""
    _attention_backend(backend)
    odd = _Misaligned(backend.name, backend.device, backend.namespace)
    case = TC_CASES[name]
    extra = {"rel_q": random_rel_q(case, True).to(dtype)} if case[5] <= 64 else {}
    assert odd.tensor(torch.ones(8, dtype=dtype)).data_ptr() % 16 != 0
    _check_forward_backward(odd, dtype, case, extra)


def test_rel_attention_wide_logits(backend):
    """Queries scaled by 20 spread a row's logits over hundreds of units, so that many
    probabilities and dS entries fall below float32's normal range. The AVX2 kernels flush those
    to 0 on the threads they run on (FlushDenormals): the results still match the reference, and
    the calling thread gets its own floating-point mode back (denormals kept)."""
    _attention_backend(backend)
    tiny = torch.tensor([1e-39])  # a float32 denormal
    assert (tiny * 1.5).item() != 0
    _check_forward_backward(backend, torch.float32, CASES["tiles_two_sided"], q_scale=20.0)
    assert (tiny * 1.5).item() != 0, "the op left flush-to-zero on in the calling thread"


# scale: T5's 1 (no 1/sqrt(D)), a small one, a negative one (keys that match the query least
# weigh most) and 0 (every visible key weighs the same)
SCALES = [1.0, 0.3, -0.5, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", ["tiles_causal_padding", "wide_tiles", "decode_split_keys",
                                  "tiles_uniform_padding"])
def test_rel_attention_explicit_scale(backend, dtype, scale, name):
    """An explicit ``scale`` in place of 1/sqrt(D), forward and backward against the reference
    (the kernels fold the scale into exp2's argument and into dS, so a sign or a zero shows)."""
    _attention_backend(backend)
    _check_forward_backward(backend, dtype, CASES[name], dict(scale=scale))


@pytest.mark.parametrize("scale", [1.0, -0.5])
@pytest.mark.parametrize("name", ["two_sided", "D128_offsets"])
def test_rel_attention_explicit_scale_tensor_core_shapes(backend, scale, name):
    """The same on the CUDA tensor-core kernels' shapes (bfloat16, D = 64 and 128)."""
    _attention_backend(backend)
    _check_forward_backward(backend, torch.bfloat16, TC_CASES[name], dict(scale=scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rel_attention_cuda_tc_env(backend, dtype, monkeypatch):
    """RELPOS_CUDA_TC takes 0 or 1, read at every CUDA call (float32 too, which the tensor cores
    never take): any other value is an error naming both, not a silent default."""
    _attention_backend(backend)
    if not backend.name.startswith("cuda"):
        pytest.skip("RELPOS_CUDA_TC is read by the CUDA kernels only")
    tensors, kw = make_inputs(TC_CASES["two_sided"], dtype)
    out, lse = _call(backend, tensors, kw)
    grad = torch.randn(out.shape).to(dtype)
    for value in ("0", "1"):
        monkeypatch.setenv("RELPOS_CUDA_TC", value)
        _call_backward(backend, grad, tensors, *_call(backend, tensors, kw), kw)
    monkeypatch.setenv("RELPOS_CUDA_TC", "off")
    with pytest.raises(RuntimeError, match="RELPOS_CUDA_TC must be 0 or 1; got 'off'"):
        _call(backend, tensors, kw)
    with pytest.raises(RuntimeError, match="RELPOS_CUDA_TC must be 0 or 1; got 'off'"):
        _call_backward(backend, grad, tensors, out, lse, kw)


def random_case(seed: int) -> tuple:
    """A seeded random CASES entry around the kernels' tile and block edges (query rows 32/33 for
    the AVX2 forward's two score paths, 8 for the scalar backward's row blocks, 64 for tiles)."""
    r = random.Random(seed)
    hk = r.choice([1, 2])
    lk = r.choice([1, 5, 63, 64, 65, 129])
    tables = r.choice([(True, True), (True, False), (False, True)])
    return (r.choice([1, 2]), hk * r.choice([1, 2]), hk,
            r.choice([1, 2, 7, 8, 9, 31, 32, 33, 63, 64, 65, 100]), lk,
            r.choice([1, 8, 13, 16, 33, 64, 72]), r.choice([0, 1, 3, 16, 200]),
            r.randint(-3, lk), r.randint(0, 3), r.random() < 0.5, r.random() < 0.5,
            r.random() < 0.3, *tables)


@pytest.mark.parametrize("seed", range(16))
def test_rel_attention_random_cases(backend, seed):
    """Forward and backward of 16 seeded random configurations (float32) against the reference."""
    _attention_backend(backend)
    case = random_case(seed)
    _check_forward_backward(backend, torch.float32, case)


def random_long_case(seed: int, max_size: int = 12_000_000) -> tuple:
    """A seeded random CASES entry with a long key side: up to 33 query rows against 1000-2700
    keys (the AVX2 forward's decoding split into key chunks) or up to 140 rows against 200-1400
    keys (the AVX2 backward's key runs, and its key chunks when batch x kv heads < 8), with
    random offsets, masks, GQA, tables and D; B x H x Lq x Lk x D is kept under `max_size`, as
    the float64 reference holds a [B, H, Lq, Lk, D] gather."""
    r = random.Random(seed)
    while True:
        b, hk, group = r.choice([1, 1, 2, 3]), r.choice([1, 2]), r.choice([1, 2, 4])
        d = r.choice([8, 16, 32, 37, 64, 80, 128])
        if r.random() < 0.5:
            lq, lk = r.choice([1, 2, 5, 16, 32, 33]), r.randint(1000, 2700)
        else:
            lq, lk = r.randint(1, 140), r.randint(200, 1400)
        if b * hk * group * lq * lk * d <= max_size:
            break
    tables = r.choice([(True, True), (True, True), (True, False), (False, True)])
    return (b, hk * group, hk, lq, lk, d, r.choice([0, 1, 5, 40, 64, 130, 700, 3000]),
            r.choice([0, r.randint(-5, lk), lk - lq]), r.choice([0, r.randint(0, 5)]),
            r.random() < 0.4, r.random() < 0.5, r.random() < 0.3, *tables)


@pytest.mark.parametrize("seed", range(8))
def test_rel_attention_random_long_cases(backend, seed):
    """Forward and backward of 8 seeded random long-key configurations (float32) against the
    reference. (A local fuzz of 7500 such cases over the CPU backends and the emulator, a half
    of them float16/bfloat16, found no failure.)"""
    _attention_backend(backend)
    case = random_long_case(seed)
    _check_forward_backward(backend, torch.float32, case)


# ----------------------------------------------------------------------------------- rel_bias
# A scalar per bucket after the scale (T5, ALiBi): every kernel path (tiles on both clamped
# sides, the uniform tiles, decoding and the AVX2 split of a long cache, the backward's key
# runs), bias with and without the tables, offsets, K edges, empty and fully masked inputs.
BIAS_CASES = ["basic", "causal", "cross_lq_ne_lk", "decode_offset", "padding", "K0", "K_ge_L",
              "only_rel_k", "only_rel_v", "no_rel", "gqa", "fully_masked_rows", "L1",
              "tiles_causal_padding", "tiles_unclipped", "unclipped_offsets_gqa",
              "tiles_two_sided", "tiles_decode_gqa", "D200_gqa4", "odd_D_offsets",
              "D1_negative_offset", "transformer_xl", "decode_one_row_D45", "decode_split_keys",
              "decode_split_hidden_chunk", "decode_five_rows", "bwd_key_runs", "tiles_uniform",
              "tiles_uniform_padding", "all_keys_padded", "no_keys", "no_queries", "no_heads",
              "wide_tiles", "wide_tiles_causal"]


def random_bias(case, per_head: bool, seed: int = 0) -> torch.Tensor:
    """A float64 bias for `case`, [2K+1] or [H, 2K+1], of the size of the logits' spread."""
    h, k = case[1], case[6]
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(((h,) if per_head else ()) + (2 * k + 1,), generator=g,
                           dtype=torch.float64)


def test_rel_attention_bias_is_a_logit_offset():
    """A bias constant over the buckets shifts every logit of a row equally: the output is
    unchanged and the log-sum-exp moves by that constant; a bias that is -inf-like far away
    (-1e4 beyond distance 1) is a window of 1 on each side."""
    tensors, kw = make_inputs(CASES["tiles_two_sided"], torch.float64)
    out, lse = relpos_ext.rel_attention(*tensors, **kw, return_lse=True)
    k = kw["max_distance"]
    out2, lse2 = relpos_ext.rel_attention(*tensors, **kw, return_lse=True,
                                          rel_bias=torch.full((2 * k + 1,), 3.0, dtype=torch.float64))
    torch.testing.assert_close(out2, out)
    torch.testing.assert_close(lse2, lse + 3.0)
    far = torch.full((2 * k + 1,), -1e4, dtype=torch.float64)
    far[k - 1:k + 2] = 0.0
    windowed = relpos_ext.rel_attention(*tensors, **kw, rel_bias=far)
    torch.testing.assert_close(windowed, relpos_ext.rel_attention(*tensors, **kw, window_left=1,
                                                                  window_right=1))


# ------------------------------------------------------------------------------------ dropout
# cases that reach every kernel path: tiles on both clamped sides, padding, GQA, fully masked
# rows, decoding rows and the AVX2 split of a long cache, the AVX2 backward's key runs
DROPOUT_CASES = ["basic", "gqa", "fully_masked_rows", "tiles_causal_padding", "tiles_two_sided",
                 "tiles_unclipped", "unclipped_offsets_gqa", "D200_gqa4", "odd_D_offsets",
                 "decode_one_row_D45", "decode_split_keys", "bwd_key_runs", "tiles_uniform",
                 "tiles_uniform_padding", "only_rel_v", "no_rel", "L1", "no_keys",
                 "wide_tiles_causal"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_rel_attention_dropout(backend, dtype, name):
    """dropout_p = 0.3: forward and backward against the reference drawing the same mask
    (reference.dropout_keep) from the same seed."""
    _attention_backend(backend)
    kw = dict(dropout_p=0.3, dropout_seed=2**40 + 12345 + len(name))
    _check_forward_backward(backend, dtype, CASES[name], kw)


@pytest.mark.parametrize("seed", range(8))
def test_rel_attention_dropout_random_cases(backend, seed):
    """Seeded random configurations (float32) with a random dropout_p in (0, 1] and seed."""
    _attention_backend(backend)
    r = random.Random(1000 + seed)
    kw = dict(dropout_p=r.choice([0.05, 0.5, 0.9, 1.0]), dropout_seed=r.randint(-2**63, 2**63 - 1))
    case = random_case(100 + seed)
    _check_forward_backward(backend, torch.float32, case, kw)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_rel_attention_dropout_mask_is_the_reference_mask(backend, p):
    """The kept set itself, bit for bit: with q = k = 0 and no key table every visible key has
    probability 1 / Lk, and with v_j the j-th unit vector (D = Lk), out[i, j] (1 - p) Lk is 1 for a
    kept key and 0 for a dropped one; it must equal reference.dropout_keep everywhere. Two
    batches, two heads, several query and key tiles."""
    _attention_backend(backend)
    b, h, lq, lk, seed = 2, 2, 70, 130, 987654321
    q = torch.zeros(b, h, lq, lk)
    v = torch.eye(lk).expand(b, h, lk, lk).contiguous()
    rel_v = torch.zeros(5, lk)  # the value term's buckets on top, with zero rows
    out, _ = backend.op("rel_attention")(
        backend.tensor(q), backend.tensor(torch.zeros(b, h, lk, lk)), backend.tensor(v), None, backend.tensor(rel_v), 2, False, None, 0, 0, None, p,
        torch.tensor([seed]))
    got = (out.cpu().double() * (1 - p) * lk).round()
    keep = ref.dropout_keep(seed, b, h, lq, lk, p)
    assert torch.equal(got, keep.double())
    assert abs(keep.double().mean().item() - (1 - p)) < 0.02  # 36400 draws: 7 sigma


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [4, 300])
def test_rel_attention_dropout_factor_beyond_float16(backend, dtype, k):
    """dropout_p = 1 - 2^-16: a kept probability takes the factor 2^16, beyond float16's largest
    value (65504). With one key every probability is 1, and seed 1643 keeps rows 61 (head 0) and
    161 (head 1); small v, rel_v and dO keep the true outputs and gradients finite. They must be
    finite and match the reference: the CUDA tensor-core kernels used to round P times the factor
    to float16 for their products (inf). k = 300: every pair inside the band (P' along the skew);
    k = 4: the kept rows in the clamped bucket (the masses)."""
    _attention_backend(backend)
    b, h, lq, lk, d, seed, p = 1, 2, 256, 1, 64, 1643, 1 - 2.0**-16
    keep = ref.dropout_keep(seed, b, h, lq, lk, p)
    assert keep.nonzero().tolist() == [[0, 0, 61, 0], [0, 1, 161, 0]]
    g = torch.Generator().manual_seed(5)

    def t(*shape, s=1.0):
        return (torch.randn(*shape, dtype=torch.float64, generator=g) * s).to(dtype)

    tensors = (t(b, h, lq, d), t(b, h, lk, d), t(b, h, lk, d, s=1e-3), t(2 * k + 1, d),
               t(2 * k + 1, d, s=1e-3))
    kw = dict(max_distance=k, causal=False, q_offset=0, k_offset=0, key_padding_mask=None,
              dropout_p=p, dropout_seed=seed)
    t64, exp_out, exp_lse = _reference(tensors, kw)
    out, lse = _call(backend, tensors, kw)
    assert torch.isfinite(out).all() and out.abs().max() > 10  # the factor was applied
    _assert_forward(dtype, out, lse, exp_out, exp_lse)
    grad = t(b, h, lq, d, s=1e-3)
    wrt = [x for x in t64 if x is not None]
    expected = dict(zip(map(id, wrt), torch.autograd.grad(exp_out, wrt, grad.double())))
    # the reference's out and lse, so that the backward is checked apart from the forward
    grads = _call_backward(backend, grad, tensors, exp_out.detach().to(dtype),
                           exp_lse.detach().float(), kw)
    for got, x in zip(grads, t64):
        if x is not None:
            assert torch.isfinite(got).all()
            assert_close(got, expected[id(x)], dtype, scale=8 * x.shape[-2] ** 0.5)


# ------------------------------------------------------------------------------- attn_mask
def random_attn_mask(case, form: str, seed: int) -> torch.Tensor:
    """A random bool attention mask for `case` (True = ignore, a third of the keys) in one of the
    accepted shapes: "2d" [Lq, Lk], "b1" [B, 1, Lq, Lk], "1h" [1, H, Lq, Lk], "bh" [B, H, Lq, Lk];
    the first query row of every head and batch entry is hidden from all keys. "docs": [Lq, Lk]
    block diagonal (three packed documents), where the kernels skip the tiles it hides whole.
    "sparse": [B, 1, Lq, Lk] hiding one pair in 5000, so that most tiles are clear (the AVX2
    kernels' unmasked paths) and a few mixed. "docs_bh": [B, H, Lq, Lk] block diagonal with 1 to
    4 documents depending on (b, h), so that a tile is hidden, clear or mixed by head."""
    b, h, lq, lk = case[0], case[1], case[3], case[4]

    def blocks(n):  # n packed documents: n blocks on the diagonal, whole tiles hidden
        return (torch.arange(lq)[:, None] * n // max(lq, 1)) != (torch.arange(lk)[None, :] * n // max(lk, 1))

    if form == "docs":
        return blocks(3)
    if form == "docs_bh":
        return torch.stack([blocks(1 + (i * 7 + seed) % 4) for i in range(b * h)]).view(b, h, lq, lk)
    shape = {"2d": (lq, lk), "b1": (b, 1, lq, lk), "1h": (1, h, lq, lk), "bh": (b, h, lq, lk),
             "sparse": (b, 1, lq, lk)}[form]
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < (
        1 / 5000 if form == "sparse" else 1 / 3)
    if lq > 0:
        mask[..., 0, :] = True
    return mask


ATTN_MASK_CASES = ["basic", "gqa", "fully_masked_rows", "tiles_causal_padding", "tiles_two_sided",
                   "unclipped_offsets_gqa", "odd_D_offsets", "decode_one_row_D45",
                   "decode_split_keys", "bwd_key_runs", "tiles_uniform_padding", "L1", "no_keys"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["2d", "b1", "1h", "bh", "docs", "sparse", "docs_bh"])
@pytest.mark.parametrize("name", ATTN_MASK_CASES)
def test_rel_attention_attn_mask(backend, dtype, form, name):
    """A random attention mask in each accepted shape, on top of the case's causal limit and
    padding: forward and backward against the reference."""
    _attention_backend(backend)
    extra = dict(attn_mask=random_attn_mask(CASES[name], form, len(name)))
    _check_forward_backward(backend, dtype, CASES[name], extra)


@pytest.mark.parametrize("seed", range(6))
def test_rel_attention_attn_mask_random_cases(backend, seed):
    """Seeded random configurations (float32 or bfloat16) with a random mask shape, and dropout
    on half of them."""
    _attention_backend(backend)
    r = random.Random(2000 + seed)
    case = random_case(200 + seed)
    extra = dict(attn_mask=random_attn_mask(case, r.choice(["2d", "b1", "1h", "bh", "docs"]), seed))
    if seed % 2:
        extra.update(dropout_p=0.2, dropout_seed=seed)
    dtype = torch.bfloat16 if seed % 3 == 2 else torch.float32
    _check_forward_backward(backend, dtype, case, extra)


# ------------------------------------------------------------------------------ segment ids
def random_segment_ids(case, form: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_segment_ids [B, Lq], k_segment_ids [B, Lk])`` for `case`. "packed" (int32): each
    batch entry a run of documents of random lengths (about 70 positions on average, so some
    tiles lie in one document, some straddle two and some see none), the id of a position its
    document's, query i at position q_offset + i and key j at k_offset + j; "random" (int64): ids
    from {0, 1, 2} in no order, so that overlapping id ranges do not decide a tile."""
    b, lq, lk, qo, ko = case[0], case[3], case[4], case[7], case[8]
    g = torch.Generator().manual_seed(seed)
    if form == "random":
        return torch.randint(0, 3, (b, lq), generator=g), torch.randint(0, 3, (b, lk), generator=g)
    lo, hi = min(qo, ko), max(qo + lq, ko + lk)
    doc = (torch.rand(b, hi - lo, generator=g) < 1 / 70).cumsum(-1, dtype=torch.int32)
    return doc[:, qo - lo:qo - lo + lq], doc[:, ko - lo:ko - lo + lk]


def _segments(case, form, seed):
    q_seg, k_seg = random_segment_ids(case, form, seed)
    return dict(q_segment_ids=q_seg, k_segment_ids=k_seg)


SEGMENT_CASES = ["basic", "gqa", "fully_masked_rows", "tiles_causal_padding", "tiles_two_sided",
                 "unclipped_offsets_gqa", "odd_D_offsets", "decode_one_row_D45",
                 "decode_split_keys", "bwd_key_runs", "tiles_uniform_padding", "L1", "no_keys",
                 "no_queries"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["packed", "random"])
@pytest.mark.parametrize("name", SEGMENT_CASES)
def test_rel_attention_segment_ids(backend, dtype, form, name):
    """Segment ids (packed documents, or unordered ids) on top of the case's causal limit and
    padding: forward and backward against the reference."""
    _attention_backend(backend)
    extra = _segments(CASES[name], form, len(name))
    _check_forward_backward(backend, dtype, CASES[name], extra)


@pytest.mark.parametrize("name", ["tiles_causal_padding", "decode_split_keys", "bwd_key_runs",
                                  "tiles_uniform_padding"])
def test_rel_attention_segment_ids_are_their_attn_mask(backend, name):
    """Packed segment ids give bitwise the outputs and gradients of the [B, 1, Lq, Lk] attention
    mask they stand for (the same tiles skipped, the same ones clear)."""
    _attention_backend(backend)
    tensors, kw = make_inputs(CASES[name], torch.float32)
    q_seg, k_seg = random_segment_ids(CASES[name], "packed", 7)
    mask = (q_seg[:, None, :, None] != k_seg[:, None, None, :])
    grad = torch.randn(tensors[0].shape)
    results = []
    for extra in (dict(q_segment_ids=q_seg, k_segment_ids=k_seg), dict(attn_mask=mask)):
        kw2 = dict(kw, **extra)
        with deterministic():
            out, lse = _call(backend, tensors, kw2)
            results.append((out, lse, *_call_backward(backend, grad, tensors, out, lse, kw2)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(6))
def test_rel_attention_segment_ids_random_cases(backend, seed):
    """Seeded random configurations (float32 or bfloat16) with packed or unordered segment ids,
    an attention mask on a third of them and dropout on half."""
    _attention_backend(backend)
    case = random_case(300 + seed)
    extra = _segments(case, "packed" if seed < 4 else "random", seed)
    if seed % 3 == 1:
        extra.update(attn_mask=random_attn_mask(case, "b1", seed))
    if seed % 2:
        extra.update(dropout_p=0.2, dropout_seed=seed)
    dtype = torch.bfloat16 if seed % 3 == 2 else torch.float32
    _check_forward_backward(backend, dtype, case, extra)


# ------------------------------------------------------------------------------ local window
WINDOW_CASES = ["basic", "gqa", "tiles_causal_padding", "tiles_two_sided", "unclipped_offsets_gqa",
                "odd_D_offsets", "decode_one_row_D45", "decode_split_keys", "bwd_key_runs",
                "tiles_uniform_padding", "L1", "no_keys"]
# (window_left, window_right): narrow, wider than a tile on one side (whole tiles clear and
# hidden), left only, right only
WINDOWS = [(3, 2), (100, -1), (-1, 0), (0, 70)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("name", WINDOW_CASES)
def test_rel_attention_window(backend, dtype, window, name):
    """A local window on top of the case's causal limit, offsets and padding: forward and
    backward against the reference."""
    _attention_backend(backend)
    extra = dict(window_left=window[0], window_right=window[1])
    _check_forward_backward(backend, dtype, CASES[name], extra)


def test_rel_attention_window_tile_edges(backend):
    """Every window bound from 0 to 65 on each side, alone, so that the first and last visible
    keys of a query tile (and the first and last query rows of a key tile) fall on every
    position relative to the kernels' tiles of 16, 32 and 64: forward and backward against the
    reference (two query tiles of the AVX2 kernels, three key tiles)."""
    _attention_backend(backend)
    case = (1, 2, 1, 70, 150, 8, 3, 0, 0, False, False, False, True, True)
    for w in range(66):
        for extra in (dict(window_left=w), dict(window_right=w)):
            _check_forward_backward(backend, torch.float32, case, extra)


def _call_window(backend, tensors, kw, grad):
    """(out, lse, grads...) of `_call` with kw's window passed positionally after the other
    trailing arguments (None where kw has none)."""
    q, k, v, rk, rv = (None if x is None else backend.tensor(x.detach()) for x in tensors)
    mask = None if kw["key_padding_mask"] is None else backend.tensor(kw["key_padding_mask"])
    am = kw.get("attn_mask")
    trailing = (0.0, None, None if am is None else backend.tensor(am), None, None,
                kw.get("window_left", -1), kw.get("window_right", -1))
    head = (kw["max_distance"], kw["causal"], None, kw["q_offset"], kw["k_offset"], mask)
    out, lse = backend.op("rel_attention")(q, k, v, rk, rv, *head, *trailing)
    grads = backend.op("rel_attention_backward")(backend.tensor(grad), q, k, v, rk, rv, out, lse,
                                                 *head, *trailing)
    return (out, lse, *grads)


@pytest.mark.parametrize("name", ["tiles_causal_padding", "decode_split_keys", "bwd_key_runs",
                                  "tiles_uniform_padding"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_rel_attention_window_is_its_attn_mask(backend, name, window):
    """A window gives bitwise the outputs and gradients of the [Lq, Lk] attention mask it stands
    for (the same tiles skipped, the same ones clear)."""
    _attention_backend(backend)
    tensors, kw = make_inputs(CASES[name], torch.float32)
    lq, lk = tensors[0].shape[2], tensors[1].shape[2]
    visible = ref.visible_keys(1, lq, lk, False, kw["q_offset"], kw["k_offset"],
                               window_left=window[0], window_right=window[1])[0, 0]
    grad = torch.randn(tensors[0].shape)
    with deterministic():
        got = _call_window(backend, tensors, dict(kw, window_left=window[0], window_right=window[1]),
                           grad)
        want = _call_window(backend, tensors, dict(kw, attn_mask=~visible), grad)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("seed", range(6))
def test_rel_attention_window_random_cases(backend, seed):
    """Seeded random configurations (float32 or bfloat16) with a random window, segment ids on
    a third of them and dropout on half."""
    _attention_backend(backend)
    case = random_case(400 + seed)
    r = random.Random(seed)
    extra = dict(window_left=r.choice([-1, 0, 1, 7, 40, 64, 65]),
                 window_right=r.choice([-1, 0, 2, 63, 100]))
    if seed % 3 == 0:
        extra.update(_segments(case, "packed", seed))
    if seed % 2:
        extra.update(dropout_p=0.2, dropout_seed=seed)
    dtype = torch.bfloat16 if seed % 3 == 2 else torch.float32
    _check_forward_backward(backend, dtype, case, extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rel_attention_non_contiguous_inputs(backend, dtype):
    """Strided views (q as a [B, L, H, D] buffer transposed, k / v every other column of a wider
    buffer, tables and mask transposed, grad_out transposed) give bitwise the results of their
    contiguous copies, forward and backward."""
    _attention_backend(backend)
    tensors, kw = make_inputs(CASES["tiles_decode_gqa"], dtype)
    q, k, v, rk, rv = (backend.tensor(x) for x in tensors)
    b, h, lq, d = q.shape
    views = (
        q.transpose(1, 2).contiguous().transpose(1, 2),
        torch.stack([k, torch.zeros_like(k)], -1).flatten(-2)[..., ::2],
        torch.stack([v, torch.zeros_like(v)], -1).flatten(-2)[..., ::2],
        rk.transpose(-1, -2).contiguous().transpose(-1, -2),
        rv.transpose(-1, -2).contiguous().transpose(-1, -2),
    )
    mask = torch.zeros(b, k.shape[2], dtype=torch.bool)
    mask[0, -3:] = True
    mask_view = backend.tensor(mask.t().contiguous().t())
    grad = backend.tensor(torch.randn(b, lq, h, d, dtype=dtype)).transpose(1, 2)
    assert not any(x.is_contiguous() for x in (*views, mask_view, grad))
    args = (kw["max_distance"], kw["causal"], None, kw["q_offset"], kw["k_offset"])
    results = []
    for ts, m, g in [(views, mask_view, grad),
                     ([x.contiguous() for x in views], mask_view.contiguous(), grad.contiguous())]:
        with deterministic():
            out, lse = backend.op("rel_attention")(*ts, *args, m)
            grads = backend.op("rel_attention_backward")(g, *ts, out, lse, *args, m)
        results.append((out, lse, *grads))
    for got, want in zip(*results):
        assert torch.equal(got, want)


# (B, H, Hkv, new rows, cached keys, capacity, D): one decoding step, a few rows against a cache
# long enough for the AVX2 decoding split, a prefill of several query tiles, and one kv head
KV_CACHE_VIEWS = [(2, 4, 2, 1, 150, 200, 32), (1, 4, 2, 5, 2200, 2300, 64),
                  (2, 2, 2, 70, 130, 131, 16), (3, 2, 1, 3, 40, 64, 8)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", KV_CACHE_VIEWS, ids=["step", "decode_split", "prefill", "hkv1"])
def test_rel_attention_reads_kv_cache_views_in_place(backend, dtype, shape):
    """k and v as the first T positions of a preallocated [B, Hkv, capacity, D] cache (slabs
    capacity * D apart): the forward reads them where they are (no copy_ in the op; the unused
    positions hold NaN, which must not leak) and gives bitwise the result of packed copies."""
    _attention_backend(backend)
    b, h, hk, lq, t, cap, d = shape
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, h, lq, d, generator=g).to(dtype)
    store = [torch.full((b, hk, cap, d), float("nan"), dtype=dtype) for _ in range(2)]
    for s in store:
        s[:, :, :t] = torch.randn(b, hk, t, d, generator=g).to(dtype)
    rk, rv = (torch.randn(h, 2 * 6 + 1, d, generator=g).to(dtype) for _ in range(2))
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[-1, :2] = True
    q, rk, rv, mask = (backend.tensor(x) for x in (q, rk, rv, mask))
    k, v = (backend.tensor(s)[:, :, :t] for s in store)
    assert not k.is_contiguous() or hk * b == 1
    args = (rk, rv, 6, True, None, t - lq, 0, mask)
    with torch.profiler.profile() as prof:
        out, lse = backend.op("rel_attention")(q, k, v, *args)
    assert not [e.name for e in prof.events() if e.name in ("aten::copy_", "aten::clone")]
    want_out, want_lse = backend.op("rel_attention")(q, k.contiguous(), v.contiguous(), *args)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


LOW_PRECISION_CASES = ["padding", "gqa", "D200_gqa4", "tiles_causal_padding", "tiles_two_sided",
                       "decode_gqa_odd_D", "decode_one_row_D45", "decode_five_rows",
                       "decode_split_keys", "wide_tiles"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", LOW_PRECISION_CASES + ["long0", "long1", "long2"])
def test_rel_attention_low_precision_rounds_float32_once(backend, dtype, name, monkeypatch):
    """float16/bfloat16 run the float32 arithmetic: the outputs, the log-sum-exp and all five
    gradients equal, bitwise, those of the float32 kernel on the same (rounded) inputs, rounded
    once to the dtype. The backward is handed the rounded `out` in both runs, as it reads D_i =
    dO_i . O_i from it (FlashAttention does the same; against a float64 reference this rounding
    dominates gradients that cancel, such as a K = 0 table's). The AVX-512 forward's bfloat16
    dot products (test_rel_attention_bf16_dot) are switched off here, and so is the CUDA
    tensor-core forward, which rounds the probabilities to the dtype for its products as
    FlashAttention does (the tensor_core tests compare it with the reference): on cuda-emu the
    forward runs the SIMT kernels of csrc/cuda/rel_attention_simt.cuh."""
    _attention_backend(backend)
    monkeypatch.setenv("RELPOS_CPU_BF16_DOT", "0")
    monkeypatch.setenv("RELPOS_CUDA_TC", "0")
    case = CASES[name] if name in CASES else random_long_case(100 + int(name[4:]), 4_000_000)
    tensors, kw = make_inputs(case, dtype)
    out, lse = _call(backend, tensors, kw)
    out32, lse32 = _call(backend, [None if x is None else x.float() for x in tensors], kw)
    assert torch.equal(out, out32.to(dtype)) and torch.equal(lse, lse32)
    grad = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    # On a GPU the table gradients are float atomics, summed in the order the blocks happen to
    # run: two calls agree bitwise only on the ordered path (the emulator's schedule is seeded)
    with deterministic():
        got = _call_backward(backend, grad, tensors, out, lse, kw)
        want = _call_backward(backend, grad.float(),
                              [None if x is None else x.float() for x in tensors],
                              out.float(), lse, kw)
    for g, w in zip(got, want):
        assert g.dtype == dtype or g.numel() == 0
        assert torch.equal(g, w.to(dtype))


# (bfloat16 stops at 30: at 1000 its rounding of `out`, which the backward reads, times q's size
# swamps the gradients of the reference too)
@pytest.mark.parametrize("dtype, sharpness", [(torch.float32, 30.0), (torch.float32, 1000.0),
                                              (torch.bfloat16, 30.0)])
def test_rel_attention_sharp_logits(backend, dtype, sharpness):
    """Logits of magnitude ~sharpness (peaked softmax, far-underflowing exponentials, running
    maxima that jump between key tiles) over several query and key tiles, forward and backward."""
    _attention_backend(backend)
    tensors, kw = make_inputs(CASES["tiles_causal_padding"], torch.float64)
    q = tensors[0] * (sharpness / tensors[0].shape[-1] ** 0.5)
    tensors = (q.to(dtype), *(None if x is None else x.to(dtype) for x in tensors[1:]))
    t64 = [_f64(x) for x in tensors]
    exp_out, exp_lse = ref.shaw_attention(*t64, **kw, return_lse=True)
    out, lse = _call(backend, tensors, kw)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_close(out, exp_out, dtype, scale=4)
    assert_close(lse, exp_lse.float(), torch.float32, scale=4 * sharpness)
    grad = torch.randn(exp_out.shape, dtype=torch.float64).to(dtype)
    expected = torch.autograd.grad(exp_out, [x for x in t64 if x is not None], grad.double())
    grads = _call_backward(backend, grad, tensors, out, lse, kw)
    for got, want in zip(grads, expected):
        assert torch.isfinite(got).all()
        # rounding errors of the logits grow with their magnitude
        assert_close(got, want, dtype, scale=8 * sharpness**0.5)


@pytest.mark.parametrize("step", [2.0, 7.0, 20.0])
def test_rel_attention_rising_logits(backend, step):
    """Logits that rise by about `step` (natural units) from one 64-key tile to the next along
    every row, so each row's running maximum keeps growing: the AVX2 forward's one-pass rows take
    the exponentials against a maximum that is behind by less than 2^8 (step 2) and fall back to
    recomputing a row when it is behind by more (steps 7 and 20)."""
    _attention_backend(backend)
    g = torch.Generator().manual_seed(11)
    lq, lk, d = 70, 300, 16
    q = torch.randn(1, 2, lq, d, generator=g, dtype=torch.float64) * 0.3
    q[..., 0] = 1.0
    k = torch.randn(1, 2, lk, d, generator=g, dtype=torch.float64) * 0.3
    k[..., 0] = torch.arange(lk, dtype=torch.float64) * (step / 64) * d**0.5
    v = torch.randn(1, 2, lk, d, generator=g, dtype=torch.float64)
    rk, rv = (torch.randn(9, d, generator=g, dtype=torch.float64) * 0.3 for _ in range(2))
    kw = dict(max_distance=4, causal=False, q_offset=0, k_offset=0, key_padding_mask=None)
    tensors = (q, k, v, rk, rv)
    exp_out, exp_lse = ref.shaw_attention(*tensors, **kw, return_lse=True)
    out, lse = _call(backend, tuple(x.float() for x in tensors), kw)
    assert_close(out, exp_out, torch.float32, scale=4)
    assert_close(lse, exp_lse.float(), torch.float32, scale=4 * step)


def _one_hot_rows(t64, kw):
    """[B, H, Lq] bool: rows whose largest float64 logit exceeds the next by more than 1000, so
    that P is one-hot in float32 and float64 alike (rows with fewer than two visible keys too)."""
    q, k, rel_k = t64[0].detach(), t64[1].detach(), t64[3]
    lq, lk, d = q.shape[2], k.shape[2], q.shape[3]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2)
    if rel_k is not None:
        logits = logits + ref.rel_logits(q, rel_k.detach(), kw["max_distance"], lk,
                                         kw["q_offset"], kw["k_offset"])
    visible = ref.visible_keys(q.shape[0], lq, lk, kw["causal"], kw["q_offset"], kw["k_offset"],
                               kw["key_padding_mask"])
    top = (logits * d**-0.5).masked_fill(~visible, float("-inf")).topk(2, dim=-1).values
    return ~(top[..., 1] > top[..., 0] - 1000)  # -inf (no second visible key): one-hot


@pytest.mark.parametrize("size", [1e5, 1e9])
@pytest.mark.parametrize("name", ["tiles_two_sided", "tiles_causal_padding", "decode_split_keys"])
def test_rel_attention_backward_at_huge_logits(backend, name, size):
    """Logits of about `size`, where one key lies far above the others in most rows: there P is
    one-hot, and the reference's dv and drel_v are sums of dO rows, which float32 holds to its
    rounding (the other rows, near ties that float32 logits cannot resolve, get dO = 0). The
    backward recomputes P = e^(s - lse) from the forward's lse, which only works when its
    logits match the forward's to the last bit: the AVX2 kernels once kept their logits in base
    2 and the lse in base e (the round trip cost up to 3 ulp of the lse: dv 5% off at 1e5, inf
    and NaN at 1e9), precombined the key term with the lse, and took a few rows' scores by other sums
    than the forward's. dq, dk and drel_k are 0 in the reference; here their rounding (dS's,
    times the other operand) must stay finite and within float32's rounding of its terms.
    The CUDA SIMT kernels had the base-2 round trip too, hidden where the scale is a power of 2
    (D = 16 here); decode_split_keys has D = 32."""
    _attention_backend(backend)
    _check_huge_logits(backend, name, size)


def _check_huge_logits(backend, name, size, bf16_values=False):
    """test_rel_attention_backward_at_huge_logits's check; bf16_values: inputs and upstream
    gradient that are bfloat16 values, which the bfloat16 dots take exactly."""
    torch.manual_seed(5)
    tensors, kw = make_inputs({**CASES, **TC_CASES}[name], torch.float32, q_scale=size)
    if bf16_values:
        tensors = tuple(None if x is None else x.to(torch.bfloat16).float() for x in tensors)
    t64 = [_f64(x) for x in tensors]
    exp_out, exp_lse = ref.shaw_attention(*t64, **kw, return_lse=True)
    one_hot = _one_hot_rows(t64, kw)
    assert one_hot.float().mean() > 0.8
    out, lse = _call(backend, tensors, kw)
    assert_close(out.cpu()[one_hot], exp_out.detach()[one_hot], torch.float32, scale=4)
    assert_close(lse.cpu()[one_hot], exp_lse.detach().float()[one_hot], torch.float32, scale=4)
    grad = torch.randn(exp_out.shape, dtype=torch.float64).float() * one_hot[..., None]
    if bf16_values:
        grad = grad.to(torch.bfloat16).float()
    leaves = [x for x in t64 if x is not None]
    expected = torch.autograd.grad(exp_out, leaves, grad.double())
    got = [g.cpu() for g in _call_backward(backend, grad, tensors, out, lse, kw)[:5]]
    q, k, v = tensors[:3]
    for i in (2, 4):  # dv, drel_v
        assert_close(got[i], expected[i], torch.float32, scale=4)
    d = q.shape[-1]
    terms = 8 * d * torch.finfo(torch.float32).eps * grad.abs().max() * v.abs().max() / d**0.5
    # the dS terms each gradient entry sums: keys per dq entry, query rows of the kv head's
    # group per dk entry, every query row per drel_k entry (a table shared by the heads)
    group = q.shape[1] // k.shape[1]
    for i, other, n in ((0, k, k.shape[2]), (1, q, q.shape[2] * group), (3, q, q.numel() // d)):
        assert torch.isfinite(got[i]).all(), f"gradient {i} not finite"
        bound = terms * n * other.abs().max()
        assert (got[i] - expected[i]).abs().max() <= bound, (i, bound)


@pytest.mark.parametrize("where", ["q", "q_first_rows", "k", "rel_k"])
def test_rel_attention_nan_propagates(backend, where):
    """A NaN input gives NaN where the reference has NaN, and finite values elsewhere: never
    silently dropped (a NaN query row poisons that row; a NaN key or table row, every row that
    sees it). q_first_rows: a NaN in query row 3, whose visible logits (causal: keys 0-3) are
    then all NaN, once taken by the AVX2 forward for a row that sees no key (zeros)."""
    _attention_backend(backend)
    tensors, kw = make_inputs(CASES["tiles_causal_padding"], torch.float32)
    tensors = [None if x is None else x.clone() for x in tensors]
    kw["key_padding_mask"] = None
    target = {"q": (0, 0, 0, 65, 3), "q_first_rows": (0, 0, 1, 3, 5), "k": (0, 0, 0, 30, 1),
              "rel_k": (1, 0, 7)}[where]
    i = {"q": 0, "q_first_rows": 0, "k": 1, "rel_k": 3}[where]
    tensors[i][target[1:]] = float("nan")
    out, _ = _call(backend, tensors, kw)
    exp_out = ref.shaw_attention(*(_f64(x) for x in tensors), **kw)
    out = out.cpu()
    assert torch.equal(out.isnan(), exp_out.isnan().any(-1, keepdim=True).expand_as(out))
    assert out.isnan().any() and not out.isnan().all()



@pytest.mark.parametrize("nan_row", [None, 290, 263])
def test_rel_attention_far_rows_first_tile(backend, nan_row):
    """Query rows whose first key tile lies wholly in one clamped bucket (here rows 256-299 over
    keys 0-127 with K = 4): the AVX2 forward takes their maximum in a pass of its own and then
    the one-pass rows of 8, where it once took the general path. A NaN query row (290; 263, one
    of a group of 8 that also has rows of finite logits) must still come out NaN, and the rows
    beside it as the reference's."""
    _attention_backend(backend)
    g = torch.Generator().manual_seed(21)
    lq, lk, d, h = 300, 600, 16, 2
    q, k, v = (torch.randn(1, h, n, d, generator=g, dtype=torch.float64) for n in (lq, lk, lk))
    rk, rv = (torch.randn(9, d, generator=g, dtype=torch.float64) for _ in range(2))
    if nan_row is not None:
        q[0, 1, nan_row, 5] = float("nan")
    kw = dict(max_distance=4, causal=False, q_offset=0, k_offset=0, key_padding_mask=None)
    tensors = (q, k, v, rk, rv)
    exp_out, exp_lse = ref.shaw_attention(*tensors, **kw, return_lse=True)
    out, lse = _call(backend, tuple(x.float() for x in tensors), kw)
    out, lse = out.cpu(), lse.cpu()
    nan = exp_out.isnan().any(-1, keepdim=True).expand_as(out)
    assert torch.equal(out.isnan(), nan)
    assert nan.any() == (nan_row is not None)
    assert_close(out.nan_to_num(0.0), exp_out.nan_to_num(0.0), torch.float32)
    keep = ~nan[..., 0]
    assert_close(lse[keep], exp_lse.float()[keep], torch.float32)

# ---------------------------------------------------------------------------------------- rel_q
# The key-side table (DeBERTa's position-to-content term, k_j . rel_q[b] before the scale):
# every kernel path as for the bias, alone and with the other tables.
# ... plus decoding paths of the AVX2 forward the bias cases do not combine with it: a cache
# long enough to be prefetched, and uniform tiles of 8 rows in a split decode
REL_Q_CASES = BIAS_CASES + ["decode_long_cache", "decode_split_uniform"]


def random_rel_q(case, per_head: bool, seed: int = 0) -> torch.Tensor:
    """A float64 key-side table for `case`: [2K+1, D] or [H, 2K+1, D]."""
    h, d, k = case[1], case[5], case[6]
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(((h,) if per_head else ()) + (2 * k + 1, d), generator=g,
                       dtype=torch.float64)


def _random_term(term, case, per_head, seed=0):
    return {"rel_bias": random_bias, "rel_q": random_rel_q}[term](case, per_head, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
@pytest.mark.parametrize("term,name", [("rel_bias", n) for n in BIAS_CASES] +
                         [("rel_q", n) for n in REL_Q_CASES])
def test_rel_attention_bias_and_rel_q(backend, dtype, per_head, term, name):
    """Forward and backward (all seven gradients) with a rel_bias, or with a key-side table,
    against the reference."""
    _attention_backend(backend)
    kw = {term: _random_term(term, CASES[name], per_head).to(dtype)}
    _check_forward_backward(backend, dtype, CASES[name], kw)


@pytest.mark.parametrize("term", ["rel_bias", "rel_q"])
@pytest.mark.parametrize("seed", range(12))
def test_rel_attention_bias_and_rel_q_random_cases(backend, seed, term):
    """Seeded random configurations (float32, long-key ones among them) with a bias, or a
    key-side table and at random a bias, and at random dropout, a window and an attention
    mask."""
    _attention_backend(backend)
    base = 300 if term == "rel_bias" else 500
    r = random.Random(10 * base + seed)
    case = random_long_case(base + seed, max_size=4_000_000) if seed % 3 == 2 else random_case(base + seed)
    kw = {term: _random_term(term, case, r.random() < 0.5, seed).float()}
    if term == "rel_q" and r.random() < 0.5:
        kw.update(rel_bias=random_bias(case, r.random() < 0.5, seed).float())
    if r.random() < 0.4:
        kw.update(dropout_p=r.choice([0.1, 0.5]), dropout_seed=r.randint(0, 2**62))
    if r.random() < 0.4:
        kw.update(window_left=r.choice([-1, 0, 3, 40]), window_right=r.choice([-1, 0, 2, 70]))
    if r.random() < 0.3:
        kw.update(attn_mask=torch.rand(case[3], case[4], generator=torch.Generator().manual_seed(seed)) < 0.2)
    _check_forward_backward(backend, torch.float32, case, kw)


@pytest.mark.parametrize("mask", ["dropout", "window", "segments", "attn_mask"])
@pytest.mark.parametrize("name", ["tiles_uniform_padding", "tiles_two_sided", "decode_split_keys",
                                  "bwd_key_runs"])
def test_rel_attention_rel_q_with_masks(backend, name, mask):
    """A key-side table with each of the masks that make tiles mixed or hidden (and dropout,
    which takes the uniform rows off their one-pass path), over several key tiles and chunks."""
    _attention_backend(backend)
    case = CASES[name]
    kw = dict(rel_q=random_rel_q(case, True, 2).float())
    if mask == "dropout":
        kw.update(dropout_p=0.3, dropout_seed=77)
    elif mask == "window":
        kw.update(window_left=40, window_right=3)
    elif mask == "segments":
        kw.update(zip(("q_segment_ids", "k_segment_ids"), random_segment_ids(case, "packed", 3)))
    else:
        kw.update(attn_mask=torch.rand(case[3], case[4], generator=torch.Generator().manual_seed(5)) < 0.1)
    _check_forward_backward(backend, torch.float32, case, kw)


def test_rel_attention_rel_q_is_the_transposed_key_term():
    """With q and k swapped and the distances reversed, the key-side term is the query-side one:
    rel_attention(q, k, ..., rel_q=E) has the logits of rel_attention(k, q, ..., rel_k=E) read
    transposed. Checked on lse-free quantities: the logits through a one-key-at-a-time probe
    (Lk = 1 per call) of both forms."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    e = torch.randn(2, 7, 8, generator=g, dtype=torch.float64)
    kmax = 3
    # a one-hot value per key turns the output into the probabilities; with one query row at a
    # time the log-sum-exp gives the logits up to a constant per row
    v = torch.eye(6, 8, dtype=torch.float64).expand(1, 2, 6, 8)
    out, lse = relpos_ext.rel_attention(q, k, v, None, None, kmax, rel_q=e, scale=1.0,
                                        return_lse=True)
    logits = (out[..., :6].clamp_min(1e-300)).log() + lse[..., None]
    # the transposed problem: k as queries, q as keys, reversed distances (bucket 2K - b)
    out_t, lse_t = relpos_ext.rel_attention(k, q, v, e.flip(-2), None, kmax, scale=1.0,
                                            return_lse=True)
    logits_t = (out_t[..., :6].clamp_min(1e-300)).log() + lse_t[..., None]
    qk = q @ k.transpose(-1, -2)
    torch.testing.assert_close(logits - qk, (logits_t - qk.transpose(-1, -2)).transpose(-1, -2))


@pytest.mark.parametrize("name", ["tiles_decode_gqa", "tiles_two_sided"])
def test_rel_attention_rel_q_deterministic_is_bitwise(backend, name):
    """Under torch.use_deterministic_algorithms the forward and backward with a key-side table
    (per head, with a bias and both tables) are bitwise the same from run to run. The CUDA dk/dv
    kernel adds drel_q from each key tile with atomics; in this mode it takes a (b, kv head)'s key
    tiles in order in one block (as the dq kernel its query tiles). On the emulator the two runs
    use different schedules (emu_seed: block order and thread interleaving, hence atomics order),
    which is how an unordered sum would show there."""
    _attention_backend(backend)
    case = CASES[name]
    tensors, kw = make_inputs(case, torch.float32)
    kw.update(rel_q=random_rel_q(case, True, 3).float(), rel_bias=random_bias(case, True, 3).float())
    grad = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(5))
    results = []
    for seed in (1, 2):
        schedule = emu_seed(seed) if backend.name == "cuda-emu" else contextlib.nullcontext()
        with deterministic(), schedule:
            out, lse = _call(backend, tensors, kw)
            results.append((out, lse, *_call_backward(backend, grad, tensors, out, lse, kw)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


# (B, H, Hkv, Lq, Lk, D, q_offset): tiles of GQA heads with a query offset; decoding 5 rows
# against 8200 keys (the AVX2 forward splits them into 8 chunks, the backward into chunks with
# partials); 70 rows against 1100 keys at D = 64 (the AVX2 backward's key runs)
THREAD_SHAPES = [(2, 4, 2, 300, 260, 32, 40), (1, 8, 2, 5, 8200, 64, 8195),
                 (1, 8, 8, 70, 1100, 64, 1030)]


def _per_thread_count(args, go, counts=(1, 2, 3)):
    """The op's outputs and gradients (rel_attention_backward's seven) on each torch thread
    count of `counts`, in order."""
    results = []
    before = torch.get_num_threads()
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            out, lse = torch.ops.relpos.rel_attention(*args)
            grads = torch.ops.relpos.rel_attention_backward(go, *args[:5], out, lse, *args[5:])
            results.append((out, lse, *grads))
    finally:
        torch.set_num_threads(before)
    return results


def _assert_all_equal(results):
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("bias", [False, True, "rel_q"])
@pytest.mark.parametrize("shape", THREAD_SHAPES, ids=["tiles", "decode_split", "bwd_runs"])
def test_rel_attention_cpu_results_do_not_depend_on_threads(monkeypatch, shape, bias):
    """The CPU kernels hand work chunks to whichever thread is free: the outputs and gradients
    must still be bitwise the same for any thread count (each item writes its own rows, and
    any split of the keys is chosen from the shapes alone), a bias's gradient included, and on
    each source of threads (csrc/cpu/parallel.h, test_threads.py)."""
    from relpos_ext import _C

    sources = ["aten", "std"] + (["gomp"] if _C._gomp_available() else [])
    b, h, hk, lq, lk, d, qo = shape
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, lq, d, generator=g)
    k, v = (torch.randn(b, hk, lk, d, generator=g) for _ in range(2))
    rk, rv = (torch.randn(h, 2 * 6 + 1, d, generator=g) for _ in range(2))
    go = torch.randn(b, h, lq, d, generator=g)
    args = (q, k, v, rk, rv, 6, True, None, qo, 0, None)
    if bias:
        args += (0.0, None, None, None, None, -1, -1, torch.randn(h, 13, generator=g))
    if bias == "rel_q":
        args += (torch.randn(h, 13, d, generator=g),)
    results = []
    for source in sources:
        monkeypatch.setenv("RELPOS_CPU_THREADS", source)
        results += _per_thread_count(args, go)
    _assert_all_equal(results)


@pytest.mark.parametrize("path", ["float64", "scalar"])
def test_rel_attention_cpu_row_blocks_do_not_depend_on_threads(monkeypatch, path):
    """The scalar kernels (float64 everywhere, in their AVX2/FMA build where there is one; every
    dtype on RELPOS_CPU_ISA=scalar) take query rows in blocks of 8: the blocks are fixed by the
    shapes (21 rows: 8, 8, 5; 3 rows: one block), not by where a thread's share of the rows
    starts, so 1, 2 and 3 threads give the same bits. (A block of one row sums differently in
    the FMA build: 3 rows split 2 + 1 over two threads gave other bits.)"""
    dtype = torch.float64 if path == "float64" else torch.float32
    if path == "scalar":
        monkeypatch.setenv("RELPOS_CPU_ISA", "scalar")
    g = torch.Generator().manual_seed(5)
    for b, h, lq, lk, q_offset in ((2, 2, 21, 300, 280), (1, 1, 3, 600, 0)):
        q, go = (torch.randn(b, h, lq, 16, generator=g, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(b, 1, lk, 16, generator=g, dtype=dtype) for _ in range(2))
        rk, rv = (torch.randn(13, 16, generator=g, dtype=dtype) for _ in range(2))
        args = (q, k, v, rk, rv, 6, q_offset > 0, None, q_offset, 0, None)
        _assert_all_equal(_per_thread_count(args, go))


@pytest.mark.parametrize("source", ["aten", "gomp", "std"])
def test_rel_attention_cpu_concurrent_calls(monkeypatch, cpu_isa, source):
    """Calls from several Python threads at once (a server's request threads, a data loader's
    workers), each on two torch threads of its own split: every call gets bitwise the results it
    gets alone. The shapes of the test above, float32 and bfloat16 (the AVX512-BF16 dots where
    the CPU has them), with and without the key-side table; each call is in flight twice."""
    g = torch.Generator().manual_seed(11)
    jobs = []
    for b, h, hk, lq, lk, d, qo in THREAD_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for rel_q in (False, True):
                def rnd(*size):
                    return torch.randn(*size, generator=g).to(dtype)
                args = (rnd(b, h, lq, d), rnd(b, hk, lk, d), rnd(b, hk, lk, d), rnd(h, 13, d),
                        rnd(13, d), 6, True, None, qo, 0, None)
                if rel_q:
                    args += (0.0, None, None, None, None, -1, -1, None, rnd(h, 13, d))

                def job(args=args, go=rnd(b, h, lq, d)):
                    out, lse = torch.ops.relpos.rel_attention(*args)
                    grads = torch.ops.relpos.rel_attention_backward(go, *args[:5], out, lse,
                                                                    *args[5:])
                    return (out, lse, *grads)
                jobs.append(job)
    assert_concurrent_calls_match(monkeypatch, source, jobs)


@pytest.mark.parametrize("shape", THREAD_SHAPES, ids=["tiles", "decode_split", "bwd_runs"])
def test_rel_attention_cpu_scratch_left_by_other_calls(cpu_isa, shape):
    """The AVX2 and AVX-512 kernels carve their buffers from a per-thread arena that outlives
    the call (rel_attention_avx2.cpp, Buffers; up to 1 MiB: the decoding shape's forward needs
    more and takes the rest from the heap), so a call finds what the calls before it left there.
    After calls on NaN inputs of the same shapes, float32 and bfloat16 (every buffer they touch
    left NaN), a call gives the bits it gave before them: no kernel reads a buffer before it
    writes it. One torch thread: the calls' buffers are all the calling thread's."""
    b, h, hk, lq, lk, d, qo = shape
    g = torch.Generator().manual_seed(7)

    def inputs(dtype, fill=None):
        sizes = [(b, h, lq, d), (b, hk, lk, d), (b, hk, lk, d), (h, 13, d), (13, d), (h, 13),
                 (h, 13, d), (b, h, lq, d)]
        xs = [torch.randn(*size, generator=g) for size in sizes]
        if fill is not None:
            xs = [x.fill_(fill) for x in xs]
        return [x.to(dtype) for x in xs]

    def run(q, k, v, rk, rv, bias, rq, go):
        args = (q, k, v, rk, rv, 6, True, None, qo, 0, None, 0.0, None, None, None, None, -1, -1,
                bias, rq)
        out, lse = torch.ops.relpos.rel_attention(*args)
        grads = torch.ops.relpos.rel_attention_backward(go, *args[:5], out, lse, *args[5:])
        return (out, lse, *grads)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for dtype in (torch.float32, torch.bfloat16):
            xs = inputs(dtype)
            first = run(*xs)
            for poison in (torch.float32, torch.bfloat16):
                nan = run(*inputs(poison, float("nan")))
                assert nan[0].isnan().all()  # (the poison reached the buffers)
            for got, want in zip(run(*xs), first):
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)


BF16_DOT_CASES = ["tiles_causal_padding", "tiles_two_sided", "wide_tiles", "wide_tiles_causal",
                  "transformer_xl", "tiles_uniform_padding", "bwd_key_runs", "prefill_odd_D",
                  "tiles_unclipped", "decode_five_rows", "decode_split_keys",
                  "decode_split_uniform"]


@pytest.mark.parametrize("rel_q", [False, True])
@pytest.mark.parametrize("name", BF16_DOT_CASES)
def test_rel_attention_bf16_dot(monkeypatch, name, rel_q):
    """On a CPU with AVX512-BF16 the AVX-512 kernels take bfloat16 inputs' big matmuls (forward
    S = Q K^T and P V; backward S, dP, dV, dK, dQ) by dot products of bfloat16 pairs, P and dS
    rounded to bfloat16 (cpu/isa.h bf16_dot_enabled). The forward: within the bfloat16 tolerance
    of the float64 reference (test_rel_attention_forward / _backward check both passes on the
    cpu-avx512 backend), a log-sum-exp within float32 rounding of the float32 matmuls'
    (RELPOS_CPU_BF16_DOT=0), outputs that differ from theirs; the backward, handed the same out
    and lse: gradients that differ too, so the dots ran. An odd head dim keeps the float32
    matmuls: bitwise their results. The relative terms' band matmuls take the dots too (QE,
    dO rel_v^T, KE^T exactly; W rel_v, W_ds rel_k and the tables' gradients from weights rounded
    to bfloat16): each case also with a key-side table (rel_q), and ``tiles_unclipped`` with every
    bucket inside the band (K >= L). From 2 query rows on, decoding too: ``decode_split_keys``
    and ``decode_split_uniform`` split the keys into chunks, packed per tile."""
    skip_unless_bf16_dot(monkeypatch)
    case = CASES[name]
    tensors, kw = make_inputs(case, torch.bfloat16)
    if rel_q:
        kw["rel_q"] = random_rel_q(case, True, 5).to(torch.bfloat16)
    cpu = Backend("cpu", "cpu", "relpos")
    grad = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    monkeypatch.setenv("RELPOS_CPU_BF16_DOT", "0")
    out_f, lse_f = _call(cpu, tensors, kw)
    grads_f = _call_backward(cpu, grad, tensors, out_f, lse_f, kw)
    monkeypatch.setenv("RELPOS_CPU_BF16_DOT", "1")
    out, lse = _call(cpu, tensors, kw)
    grads = _call_backward(cpu, grad, tensors, out_f, lse_f, kw)
    if case[5] % 2 == 1:
        assert torch.equal(out, out_f) and torch.equal(lse, lse_f)
        assert all(torch.equal(g, w) for g, w in zip(grads, grads_f))
        return
    exp_out, _ = ref.shaw_attention(*(_f64(x) for x in tensors), **_kw64(kw), return_lse=True)
    assert_close(out, exp_out, torch.bfloat16, scale=4)
    torch.testing.assert_close(lse, lse_f, atol=1e-4, rtol=1e-5)
    assert not torch.equal(out, out_f)
    for i in range(3):  # dq, dk, dv
        assert not torch.equal(grads[i], grads_f[i])


# The bfloat16 dots' cases, and head dims whose pairs are no whole number of AMX's 16-pair
# slices (40, 80, 120: the last 4, 8 or 12 pairs of Q K^T through a padded tile) or two of
# them (128).
AMX_CASES = {**{n: CASES[n] for n in BF16_DOT_CASES},
             **{n: TC_CASES[n] for n in ("D40_offsets", "D80_gqa", "D120", "D128_offsets")},
             # decoding 9 rows, per-head tables: every product's rows padded to the tile's 16
             "decode_nine_rows": (1, 2, 1, 9, 300, 32, 6, 291, 0, True, True, False, True, True)}


@pytest.mark.parametrize("name", list(AMX_CASES))
def test_rel_attention_amx(monkeypatch, name):
    """On a CPU with AMX the bfloat16 dots of test_rel_attention_bf16_dot run on tiles (cpu/isa.h
    amx_enabled), every entry of every product: whole 16 x 16 blocks straight from memory, the
    blocks at the edges (the last rows and columns, the pairs past the last whole 16) through
    zero-padded copies; from 8 query rows on (kernels.h kAttentionAmxMinRows). Forward and
    backward within the bfloat16 tolerance of the float64 reference. Against RELPOS_CPU_AMX=0
    (the AVX512-BF16 dots): a log-sum-exp within float32 rounding, and with an odd head dim
    (no dots, so no tiles) or under 8 query rows (decode_five_rows, decode_split_keys),
    bitwise the same results. The tiles sum the same products in another order, which
    bfloat16 outputs mostly round away: past 32 query rows the comparison takes float32 inputs
    under matmul precision "medium" (the same dots, float32 outputs), whose outputs or gradients
    must differ, so the tiles ran; 8-32 rows (decoding, which "medium" leaves in float32)
    compare the bfloat16 calls within bfloat16 rounding (there the tiles' sums often equal the
    dots' to the last bit)."""
    skip_unless_amx(monkeypatch)
    case = AMX_CASES[name]
    cpu = Backend("cpu", "cpu", "relpos")
    _check_forward_backward(cpu, torch.bfloat16, case)
    whole = case[5] % 2 == 0 and case[3] >= 8
    dtype = torch.float32 if case[3] > 32 and whole else torch.bfloat16
    tensors, kw = make_inputs(case, dtype)
    grad = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    with float32_matmul_precision("medium"):
        out, lse = _call(cpu, tensors, kw)
        grads = _call_backward(cpu, grad, tensors, out, lse, kw)
        monkeypatch.setenv("RELPOS_CPU_AMX", "0")
        assert relpos_ext.build_info()["cpu_amx"] is False
        out_d, lse_d = _call(cpu, tensors, kw)
        grads_d = _call_backward(cpu, grad, tensors, out, lse, kw)  # handed the same out and lse
    got = [out, lse, *(g for g in grads if g is not None)]
    want = [out_d, lse_d, *(g for g in grads_d if g is not None)]
    if not whole:
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        return
    torch.testing.assert_close(lse, lse_d, atol=1e-4, rtol=1e-5)
    if dtype == torch.float32:
        assert not all(torch.equal(g, w) for g, w in zip(got, want))
    else:
        for g, w in zip(got, want):
            assert_close(g, w.to(g.dtype), g.dtype, scale=4)


@pytest.mark.parametrize("size", [1e5, 1e9])
@pytest.mark.parametrize("name", ["tiles_two_sided", "bwd_key_runs", "two_sided", "causal_padding_gqa",
                                  "D128_offsets", "K0"])
def test_rel_attention_amx_backward_at_huge_logits(monkeypatch, name, size):
    """test_rel_attention_backward_at_huge_logits with the dots on AMX tiles (float32 inputs
    that are bfloat16 values, under matmul precision "medium"): the backward's logits must be
    bitwise the forward's, although it computes S, QE and KE^T in other blocks (other tiles and
    bands; the forward computes a row again after a one-pass attempt that went past the running
    maximum's slack). Every entry takes the tiles, edges through zero-padded copies, so its sum
    does not depend on the block. A first version sent the edges to the dots, so an entry's sum
    depended on where its block ended: bwd_key_runs, two_sided, causal_padding_gqa and
    D128_offsets failed here."""
    skip_unless_amx(monkeypatch)
    with float32_matmul_precision("medium"):
        _check_huge_logits(Backend("cpu", "cpu", "relpos"), name, size, bf16_values=True)


def test_rel_attention_amx_env(monkeypatch):
    """RELPOS_CPU_AMX takes 0 or 1 (read at every call; build_info rejects any other value on
    every path, even where the tiles could not run); 0 turns the tiles off, and without the
    dots there are no tiles."""
    monkeypatch.setenv("RELPOS_CPU_AMX", "yes")
    with pytest.raises(RuntimeError, match="RELPOS_CPU_AMX must be 0 or 1"):
        relpos_ext.build_info()
    monkeypatch.setenv("RELPOS_CPU_AMX", "0")
    assert relpos_ext.build_info()["cpu_amx"] is False
    monkeypatch.setenv("RELPOS_CPU_BF16_DOT", "0")
    monkeypatch.setenv("RELPOS_CPU_AMX", "1")
    assert relpos_ext.build_info()["cpu_amx"] is False  # no dots, no tiles


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    """torch.set_float32_matmul_precision for the block (the legacy API only: mixing it with
    torch.backends.*.fp32_precision makes torch.get_float32_matmul_precision raise)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("rel_q", [False, True])
@pytest.mark.parametrize("name", BF16_DOT_CASES)
def test_rel_attention_float32_takes_bf16_dots_under_medium_precision(monkeypatch, name, rel_q):
    """Under torch.set_float32_matmul_precision("medium") (CPU float32 matmuls may compute in
    bfloat16: torch.backends.mkldnn.matmul.fp32_precision is "bf16") float32 inputs take the
    bfloat16 dots of test_rel_attention_bf16_dot, q, k, v and dO rounded to bfloat16 tile by
    tile and the tables once per call, while everything else stays float32. On inputs that are
    bfloat16 values already, the float32 outputs and gradients rounded to bfloat16, and the
    log-sum-exp, must be bitwise those of the bfloat16 call (the backward handed the same rounded `out`, as
    it reads D_i = dO_i . O_i from it). With the dots off (RELPOS_CPU_BF16_DOT=0, an odd head
    dim, or decoding: at most 32 query rows, which read float32 keys in place faster than they
    could round them) "medium" changes nothing: bitwise the default precision's results."""
    skip_unless_bf16_dot(monkeypatch)
    case = CASES[name]
    tensors16, kw16 = make_inputs(case, torch.bfloat16)
    if rel_q:
        kw16["rel_q"] = random_rel_q(case, True, 5).to(torch.bfloat16)
    tensors = tuple(None if x is None else x.float() for x in tensors16)
    kw = dict(kw16, rel_q=kw16["rel_q"].float()) if rel_q else kw16
    cpu = Backend("cpu", "cpu", "relpos")
    grad16 = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    grad = grad16.float()
    out_d, lse_d = _call(cpu, tensors, kw)  # the default precision: float32 matmuls
    grads_d = _call_backward(cpu, grad, tensors, out_d, lse_d, kw)
    with float32_matmul_precision("medium"):
        out, lse = _call(cpu, tensors, kw)
        dots = case[5] % 2 == 0 and case[3] > 32
        if dots:
            out16, lse16 = _call(cpu, tensors16, kw16)
            out_r = out16.float()
            grads = _call_backward(cpu, grad, tensors, out_r, lse16, kw)
            grads16 = _call_backward(cpu, grad16, tensors16, out16, lse16, kw16)
        monkeypatch.setenv("RELPOS_CPU_BF16_DOT", "0")
        out_off, lse_off = _call(cpu, tensors, kw)
        grads_off = _call_backward(cpu, grad, tensors, out_d, lse_d, kw)
    assert torch.equal(out_off, out_d) and torch.equal(lse_off, lse_d)
    assert all(torch.equal(g, w) for g, w in zip(grads_off, grads_d))
    if not dots:
        assert torch.equal(out, out_d) and torch.equal(lse, lse_d)
        return
    assert out.dtype == torch.float32 and not torch.equal(out, out_d)
    assert torch.equal(out.to(torch.bfloat16), out16) and torch.equal(lse, lse16)
    for g, w in zip(grads, grads16):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.dtype == torch.float32 and torch.equal(g.to(torch.bfloat16), w)


@pytest.mark.parametrize("shape", KV_CACHE_VIEWS, ids=["step", "decode_split", "prefill", "hkv1"])
def test_rel_attention_float32_bf16_dots_read_kv_cache_views(monkeypatch, shape):
    """Under "medium" precision float32 k and v are rounded for the dots where they are: the
    cache's first T positions of each slab (capacity * D apart), not the NaN beyond; bitwise
    the result of packed copies. (Only ``prefill`` has more than 32 rows, and so the dots.)"""
    skip_unless_bf16_dot(monkeypatch)
    b, h, hk, lq, t, cap, d = shape
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, h, lq, d, generator=g)
    store = [torch.full((b, hk, cap, d), float("nan")) for _ in range(2)]
    for s in store:
        s[:, :, :t] = torch.randn(b, hk, t, d, generator=g)
    rk, rv = (torch.randn(h, 2 * 6 + 1, d, generator=g) for _ in range(2))
    k, v = (s[:, :, :t] for s in store)
    args = (rk, rv, 6, True, None, t - lq, 0, None)
    with float32_matmul_precision("medium"):
        out, lse = torch.ops.relpos.rel_attention(q, k, v, *args)
        want_out, want_lse = torch.ops.relpos.rel_attention(q, k.contiguous(), v.contiguous(), *args)
    default_out, _ = torch.ops.relpos.rel_attention(q, k, v, *args)
    assert torch.isfinite(out).all()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert torch.equal(out, default_out) == (lq <= 32)


# (batch, heads, kv heads, Lq, Lk, D, K, causal, q_offset, k_offset, tables, per-head tables,
# rel_q, [B, L, H, D] views) and the options each mix adds.
MEDIUM_MIXES = {
    "bias_dropout_gqa": ((2, 4, 2, 97, 150, 64, 5, False, 0, 0, "kv", True, False, False),
                         {"rel_bias": "head", "dropout_p": 0.2}),
    "masks_segments": ((2, 2, 2, 130, 130, 80, 64, False, 0, 0, "kv", False, False, False),
                       {"key_padding_mask": True, "attn_mask": True, "segments": 50}),
    "window_views_unclipped": ((1, 2, 1, 64, 64, 32, 400, True, 0, 0, "kv", True, False, True),
                               {"window_left": 20, "window_right": 0}),
    "rel_v_rel_q_offsets": ((1, 2, 2, 40, 300, 136, 64, False, 7, 3, "v", True, True, False),
                            {"rel_bias": "shared"}),
    "rel_k_causal_cross": ((1, 1, 1, 257, 300, 16, 1, True, 43, 0, "k", False, True, True),
                           {"key_padding_mask": True}),
}


@pytest.mark.parametrize("name", list(MEDIUM_MIXES))
def test_rel_attention_float32_bf16_dots_with_every_option(monkeypatch, name):
    """The bitwise agreement of test_rel_attention_float32_takes_bf16_dots_under_medium_precision
    holds with the options those cases leave out: a scalar bias (shared or per head, its
    gradient included), dropout, attn_mask, segment ids, a window, [B, L, H, D] views,
    grouped-query heads, rel_q, offsets and D = 16 ... 136. The float32 call under "medium" on
    bfloat16 values, rounded, is bitwise the bfloat16 call; and it differs from the default
    precision's, so the dots ran."""
    skip_unless_bf16_dot(monkeypatch)
    shape, opts = MEDIUM_MIXES[name]
    b, h, hk, lq, lk, d, K, causal, qo, ko, tables, per_head, with_rel_q, views = shape
    g = torch.Generator().manual_seed(11)

    def rand(*size):
        return torch.randn(*size, generator=g).to(torch.bfloat16)

    def heads_second(n, length):  # [B, n, L, D], a view of [B, L, n, D] where asked
        return rand(b, length, n, d).transpose(1, 2) if views else rand(b, n, length, d)

    q, k, v = heads_second(h, lq), heads_second(hk, lk), heads_second(hk, lk)
    table = (h, 2 * K + 1, d) if per_head else (2 * K + 1, d)
    rk = rand(*table) if "k" in tables else None
    rv = rand(*table) if "v" in tables else None
    kw = {"max_distance": K, "causal": causal, "q_offset": qo, "k_offset": ko,
          "rel_q": rand(*table) if with_rel_q else None}
    if opts.get("rel_bias"):
        kw["rel_bias"] = rand(h, 2 * K + 1) if opts["rel_bias"] == "head" else rand(2 * K + 1)
    if opts.get("dropout_p"):
        kw["dropout_p"] = opts["dropout_p"]
        kw["dropout_seed"] = torch.tensor([1234], dtype=torch.int64)
    if opts.get("key_padding_mask"):
        kw["key_padding_mask"] = torch.rand(b, lk, generator=g) < 0.3
    if opts.get("attn_mask"):
        kw["attn_mask"] = torch.rand(lq, lk, generator=g) < 0.2
    if opts.get("segments"):
        kw["q_segment_ids"] = (torch.arange(lq) // opts["segments"]).expand(b, lq).contiguous()
        kw["k_segment_ids"] = (torch.arange(lk) // opts["segments"]).expand(b, lk).contiguous()
    for n in ("window_left", "window_right"):
        if n in opts:
            kw[n] = opts[n]
    grad16 = rand(b, h, lq, d)

    def as_float(x):
        return None if x is None or not x.is_floating_point() else x.float()

    inputs16 = (q, k, v, rk, rv)
    inputs = tuple(as_float(x) for x in inputs16)
    kw32 = {n: (as_float(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in kw.items()}
    out_d, _ = relpos_ext.rel_attention(*inputs, return_lse=True, **kw32)
    with float32_matmul_precision("medium"):
        out, lse = relpos_ext.rel_attention(*inputs, return_lse=True, **kw32)
        out16, lse16 = relpos_ext.rel_attention(*inputs16, return_lse=True, **kw)
        grads = relpos_ext.rel_attention_backward(grad16.float(), *inputs, out16.float(), lse16, **kw32)
        grads16 = relpos_ext.rel_attention_backward(grad16, *inputs16, out16, lse16, **kw)
    assert torch.isfinite(out).all() and not torch.equal(out, out_d)
    assert torch.equal(out.to(torch.bfloat16), out16) and torch.equal(lse, lse16)
    assert sum(x is not None for x in grads) == 3 + len(tables) + ("rel_bias" in kw) + with_rel_q
    for x, want in zip(grads, grads16):
        assert (x is None) == (want is None)
        if x is not None:
            assert x.dtype == torch.float32 and torch.equal(x.to(torch.bfloat16), want)


def _cpu_vendor() -> str | None:
    """The CPU's vendor string from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def test_rel_attention_wide_rows_env(monkeypatch):
    """RELPOS_CPU_WIDE_ROWS takes 4 or 6 (read at every call, where the AVX-512 path runs; 0 on
    the others); unset, 6 on Intel CPUs and 4 on others."""
    skip_unless_avx512(monkeypatch)
    monkeypatch.delenv("RELPOS_CPU_WIDE_ROWS", raising=False)
    intel = _cpu_vendor() == "GenuineIntel"
    assert relpos_ext.build_info()["cpu_wide_rows"] == (6 if intel else 4)
    for rows in (4, 6):
        monkeypatch.setenv("RELPOS_CPU_WIDE_ROWS", str(rows))
        assert relpos_ext.build_info()["cpu_wide_rows"] == rows
    monkeypatch.setenv("RELPOS_CPU_ISA", "avx2")
    assert relpos_ext.build_info()["cpu_wide_rows"] == 0
    monkeypatch.setenv("RELPOS_CPU_ISA", "avx512")
    monkeypatch.setenv("RELPOS_CPU_WIDE_ROWS", "8")
    with pytest.raises(RuntimeError, match="RELPOS_CPU_WIDE_ROWS must be 4 or 6"):
        relpos_ext.build_info()


@pytest.mark.parametrize("name", ["tiles_two_sided", "decode_split_keys", "bwd_key_runs",
                                  "decode_five_rows"])
def test_rel_attention_bf16_dot_decode_only(monkeypatch, name):
    """Which calls take the bfloat16 dots by default (cpu/isa.h bf16_dot_decode_only): on Intel
    CPUs whose dots do not run on AMX tiles (here RELPOS_CPU_AMX=0) only decoding calls, at most 32
    query rows against at least 256 keys (decode_split_keys; not decode_five_rows, 130 keys),
    elsewhere (AMD, or on AMX tiles) every call; RELPOS_CPU_BF16_DOT=1 every call everywhere.
    Forward and backward are bitwise those of RELPOS_CPU_BF16_DOT=1 (the dots) or =0 (float32
    matmuls) accordingly, both passes deciding alike."""
    skip_unless_bf16_dot(monkeypatch)
    assert relpos_ext.build_info()["cpu_bf16_dot_decode_only"] is False  # RELPOS_CPU_BF16_DOT=1
    monkeypatch.setenv("RELPOS_CPU_AMX", "0")
    case = CASES[name]
    tensors, kw = make_inputs(case, torch.bfloat16)
    cpu = Backend("cpu", "cpu", "relpos")
    grad = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    results = {}
    for dot in ("0", "1", None):
        if dot is None:
            monkeypatch.delenv("RELPOS_CPU_BF16_DOT")
        else:
            monkeypatch.setenv("RELPOS_CPU_BF16_DOT", dot)
        out, lse = _call(cpu, tensors, kw)
        results[dot] = [out, lse, *_call_backward(cpu, grad, tensors, out, lse, kw)]
    decode_only = relpos_ext.build_info()["cpu_bf16_dot_decode_only"]
    assert decode_only == (_cpu_vendor() == "GenuineIntel")
    dots = not decode_only or (case[3] <= 32 and case[4] >= 256)
    want = results["1" if dots else "0"]
    assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(results[None], want))
    other = results["0" if dots else "1"]
    assert not all((g is None and w is None) or torch.equal(g, w) for g, w in zip(results[None], other))
    monkeypatch.delenv("RELPOS_CPU_AMX")
    if relpos_ext.build_info()["cpu_amx"]:  # on the tiles: every number of rows
        assert relpos_ext.build_info()["cpu_bf16_dot_decode_only"] is False


def test_rel_attention_bf16_dot_env(monkeypatch):
    """RELPOS_CPU_BF16_DOT takes 0 or 1 (read at every call, where the AVX-512 path runs)."""
    skip_unless_avx512(monkeypatch)
    monkeypatch.setenv("RELPOS_CPU_BF16_DOT", "0")
    assert relpos_ext.build_info()["cpu_bf16_dot"] is False
    monkeypatch.setenv("RELPOS_CPU_BF16_DOT", "yes")
    with pytest.raises(RuntimeError, match="RELPOS_CPU_BF16_DOT must be 0 or 1"):
        relpos_ext.build_info()


# The cases whose tables fit, and one whose last key tile has 24 keys that every row sees in one
# clamped bucket: the AVX-512 build's one-pass rows take 16 keys at a time, then 8.
BITWISE_CASES = {**{n: c for n, c in CASES.items() if c[6] < 2**20},
                 "uniform_tail_24": (1, 2, 2, 70, 152, 16, 5, 0, 0, False, False, False, True, True)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BITWISE_CASES))
def test_rel_attention_avx512_is_bitwise_avx2(monkeypatch, dtype, name):
    """The AVX-512 build of the attention kernels differs from the AVX2 build only in the width
    of its matmul blocks (32 or 64 columns instead of 16, masked tails; 64-column blocks of 4
    or 6 rows, both run here), whose entries are the same FMA chains, and of its one-pass
    softmax rows (16 keys at a time, the same exponentials, the
    same sums: the AVX2 rows sum even and odd 8-key chunks apart, the halves of a 16-lane sum,
    which ``uniform_tail_24`` ends with an even chunk alone): outputs and all seven gradients must be bitwise those of the
    AVX2 kernels, here with per-head tables, a bias and a key-side table on every case. (The
    bfloat16 dot products of test_rel_attention_bf16_dot are switched off.)"""
    skip_unless_avx512(monkeypatch)
    monkeypatch.setenv("RELPOS_CPU_BF16_DOT", "0")
    case = BITWISE_CASES[name]
    tensors, kw = make_inputs(case, dtype)
    kw.update(rel_q=random_rel_q(case, True, 4).to(dtype), rel_bias=random_bias(case, True, 4).to(dtype))
    cpu = Backend("cpu", "cpu", "relpos")
    grad = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    results = []
    for isa, rows in (("avx2", None), ("avx512", "4"), ("avx512", "6")):
        monkeypatch.setenv("RELPOS_CPU_ISA", isa)
        if rows is not None:
            monkeypatch.setenv("RELPOS_CPU_WIDE_ROWS", rows)
        out, lse = _call(cpu, tensors, kw)
        results.append((out, lse, *_call_backward(cpu, grad, tensors, out, lse, kw)))
    for got, *others in zip(*results):
        for other in others:
            assert torch.equal(got, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tables", [True, False, "rel_q"])
def test_rel_attention_backward_under_deterministic_algorithms(backend, tables, dtype):
    """The backward runs under torch.use_deterministic_algorithms(True) and gives the gradients
    it gives without: the CPU kernels are deterministic anyway; the CUDA backward (the emulator
    runs the same glue and kernels) then takes its dq kernel's serial_q_tiles form, one block per
    (b, h) over the query tiles in order, so that its table-gradient atomics add in a fixed
    order (bfloat16: the tensor-core dq kernel's form); with rel_q the dk/dv kernel's key tiles
    too."""
    _attention_backend(backend)
    tensors, kw = make_inputs(CASES["tiles_two_sided"], dtype)
    if not tables:
        tensors = (*tensors[:3], None, None)
    if tables == "rel_q":
        kw.update(rel_q=random_rel_q(CASES["tiles_two_sided"], True, 4).to(dtype))
    out, lse = _call(backend, tensors, kw)
    grad = torch.randn(out.shape, dtype=out.dtype)
    want = _call_backward(backend, grad, tensors, out, lse, kw)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True)
    try:
        got = _call_backward(backend, grad, tensors, out, lse, kw)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    for g, w in zip(got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(g.cpu(), w.cpu(), rtol=1e-5, atol=1e-6)
        else:  # the partials summed in another order may round to a neighbouring bfloat16
            torch.testing.assert_close(g.cpu(), w.cpu())


@pytest.mark.parametrize("isa", ["scalar", "auto"])
@pytest.mark.parametrize("bias", [False, True, "rel_q"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.4])
def test_gradcheck_rel_attention(dropout_p, bias, isa, monkeypatch):
    """gradcheck through the autograd wrapper; with dropout a fixed seed, so every call of the
    function draws the same mask. bias="rel_q": a bias and a key-side table. isa="auto": the
    default path, where float64 runs the AVX2/FMA build of the scalar kernels if there is one.
    The whole Jacobian on the scalar path; on "auto" (the same source, other compiler flags), and
    for the largest case (D=80: 7-8k inputs, half of the whole check's time), gradcheck's fast
    mode, which compares u^T J v for random u and v."""
    monkeypatch.setenv("RELPOS_CPU_ISA", isa)
    if isa == "auto" and relpos_ext.build_info()["cpu_float64_attention"] == "scalar":
        pytest.skip("float64 attention runs the scalar kernels on every path of this build")
    seed = torch.tensor([77], dtype=torch.int64)
    for name in ("basic", "causal", "padding", "gqa", "fully_masked_rows", "only_rel_v"):
        tensors, kw = make_inputs(CASES[name], torch.float64, requires_grad=True)
        tensors = (*tensors, random_bias(CASES[name], name == "gqa").requires_grad_() if bias else None,
                   random_rel_q(CASES[name], name != "gqa").requires_grad_() if bias == "rel_q" else None)
        args = [x for x in tensors if x is not None]
        has = [x is not None for x in tensors]

        def fn(*a, kw=kw, has=has):
            it = iter(a)
            full = [next(it) if h else None for h in has]
            rel_q = full.pop()
            rel_bias = full.pop()
            return relpos_ext.rel_attention(*full, **kw, dropout_p=dropout_p, dropout_seed=seed,
                                            rel_bias=rel_bias, rel_q=rel_q)

        fast = isa == "auto" or name == "padding"
        assert torch.autograd.gradcheck(fn, args, fast_mode=fast), name


@pytest.mark.parametrize("extra", ["none", "dropout", "attn_mask", "segment_ids", "window", "bias",
                                   "rel_q"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_rel_attention(requires_grad, extra):
    for name in ("basic", "gqa", "only_rel_k"):
        tensors, kw = make_inputs(CASES[name], torch.float32, requires_grad=requires_grad)
        lq, lk = tensors[0].shape[2], tensors[1].shape[2]
        trailing = {"none": (), "dropout": (0.25, torch.tensor([5])),
                    "attn_mask": (0.0, None, torch.eye(lq, lk, dtype=torch.bool)),
                    "segment_ids": (0.0, None, None,
                                    *random_segment_ids(CASES[name], "random", 3)),
                "window": (0.0, None, None, None, None, 1, 2),
                "bias": (0.0, None, None, None, None, -1, -1,
                         random_bias(CASES[name], name == "gqa").float()
                         .requires_grad_(requires_grad)),
                "rel_q": (0.0, None, None, None, None, -1, -1, None,
                          random_rel_q(CASES[name], name == "gqa").float()
                          .requires_grad_(requires_grad))}[extra]
        args = (*tensors, kw["max_distance"], kw["causal"], None, kw["q_offset"], kw["k_offset"],
                kw["key_padding_mask"], *trailing)
        torch.library.opcheck(torch.ops.relpos.rel_attention.default, args)
        out, lse = torch.ops.relpos.rel_attention.default(*args)
        # The backward op, with its own derivative (double backward) when the inputs need
        # gradients
        grad = torch.randn_like(out).requires_grad_(requires_grad)
        bargs = (grad, *tensors, out.detach(), lse, *args[5:])
        torch.library.opcheck(torch.ops.relpos.rel_attention_backward.default, bargs)


def test_rel_attention_dropout_seed_from_the_generator():
    """Without dropout_seed the wrapper draws one from torch's default generator: the same
    torch.manual_seed gives the same output, successive calls differ, and the output is the
    reference's with the seed drawn the same way. dropout_p = 0 gives the undropped output
    bitwise, seed or none."""
    tensors, kw = make_inputs(CASES["tiles_causal_padding"], torch.float32)
    torch.manual_seed(3)
    a = relpos_ext.rel_attention(*tensors, **kw, dropout_p=0.2)
    b = relpos_ext.rel_attention(*tensors, **kw, dropout_p=0.2)
    torch.manual_seed(3)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    torch.manual_seed(3)
    a2 = relpos_ext.rel_attention(*tensors, **kw, dropout_p=0.2)
    assert torch.equal(a, a2) and not torch.equal(a, b)
    exp = ref.shaw_attention(*(_f64(x) for x in tensors), **kw, dropout_p=0.2, dropout_seed=seed)
    assert_close(a, exp, torch.float32, scale=4)
    plain = relpos_ext.rel_attention(*tensors, **kw)
    zero = relpos_ext.rel_attention(*tensors, **kw, dropout_p=0.0, dropout_seed=seed)
    assert torch.equal(plain, zero)


@pytest.mark.parametrize("gqa", [False, True])
def test_module_gradient_penalty(cpu_isa, gqa):
    """A gradient penalty (R1, WGAN-GP: the squared norm of the gradient with respect to the
    input, create_graph=True) through the fused layer, causal with padding: its gradients for
    every parameter are the reference module's (float64, each CPU kernel path)."""
    m, r = _module_pair(gqa)
    m, r = m.double(), r.double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, :2] = True
    for layer in (m, r):
        xx = x.clone().requires_grad_()
        y, _ = layer(xx, key_padding_mask=mask, is_causal=True)
        (gx,) = torch.autograd.grad(y.tanh().sum(), xx, create_graph=True)
        gx.square().sum().backward()
    for (name, pm), pr in zip(m.named_parameters(), r.parameters()):
        assert pm.grad is not None and pm.grad.abs().max() > 0, name
        torch.testing.assert_close(pm.grad, pr.grad, atol=1e-10, rtol=1e-10, msg=name)


# ------------------------------------------------------------------------------------ module
def _module_pair(gqa, **extra):
    """The fused module (E=32, H=4, K=3; GQA with per-head tables or not; `extra` constructor
    arguments) and the reference module holding the same state."""
    kw = dict(embed_dim=32, num_heads=4, max_distance=3, num_kv_heads=2 if gqa else None,
              per_head_tables=gqa, **extra)
    m = relpos_ext.nn.RelativeMultiheadAttention(**kw)
    r = ref.RelativeMultiheadAttentionReference(**kw)
    r.load_state_dict(m.state_dict())
    return m, r


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_module_matches_reference_module(gqa, causal):
    m, r = _module_pair(gqa)
    x = torch.randn(2, 7, 32)
    mem = torch.randn(2, 9, 32)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, -3:] = True
    for args in ((x,), (x, mem, mem, mask)):
        got, weights = m(*args, is_causal=causal and len(args) == 1)
        exp, _ = r(*args, is_causal=causal and len(args) == 1)
        assert weights is None
        torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
        got.square().sum().backward()
        exp.square().sum().backward()
        for (name, pm), pr in zip(m.named_parameters(), r.parameters()):
            torch.testing.assert_close(pm.grad, pr.grad, atol=1e-4, rtol=1e-4, msg=name)
            pm.grad = pr.grad = None


def test_module_kdim_vdim_cross_attention():
    """kdim / vdim as in nn.MultiheadAttention: a memory of other widths, matched by the reference
    module with the same state; self-attention is refused with a clear error."""
    kw = dict(embed_dim=32, num_heads=4, max_distance=3, num_kv_heads=2, kdim=24, vdim=40)
    m = relpos_ext.nn.RelativeMultiheadAttention(**kw)
    r = ref.RelativeMultiheadAttentionReference(**kw)
    r.load_state_dict(m.state_dict())
    assert m.k_proj.in_features == 24 and m.v_proj.in_features == 40
    x, mem_k, mem_v = torch.randn(2, 7, 32), torch.randn(2, 9, 24), torch.randn(2, 9, 40)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, :2] = True
    got, _ = m(x, mem_k, mem_v, mask)
    exp, _ = r(x, mem_k, mem_v, mask)
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    exp.square().sum().backward()
    for (name, pm), pr in zip(m.named_parameters(), r.parameters()):
        torch.testing.assert_close(pm.grad, pr.grad, atol=1e-4, rtol=1e-4, msg=name)
    for args in ((x,), (x, mem_k)):
        with pytest.raises(ValueError, match="key and value must both be given"):
            m(*args)


@pytest.mark.parametrize("cls", ["RelativeMultiheadAttention", "ShawRelativeAttention"])
def test_module_device_dtype_factory_kwargs(cls):
    """device= / dtype= as in nn.MultiheadAttention: every parameter is made there and in that
    dtype (meta: nothing allocated), and a float64 layer computes in float64, matching a float32
    one holding the same state."""
    make = getattr(relpos_ext.nn, cls)
    kw = dict(embed_dim=16, num_heads=2, max_distance=3)
    meta = make(**kw, device="meta", dtype=torch.bfloat16)
    params = dict(meta.named_parameters())
    assert {"rel_k", "rel_v"} <= set(params)
    for name, prm in params.items():
        assert prm.device.type == "meta" and prm.dtype == torch.bfloat16, name
    m64 = make(**kw, dtype=torch.float64)
    for name, p64 in m64.named_parameters():
        assert p64.dtype == torch.float64 and p64.device.type == "cpu", name
    m32 = make(**kw)
    m32.load_state_dict({n: t.float() for n, t in m64.state_dict().items()})
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y64 = m64(x)
    y32 = m32(x.float())
    y64, y32 = (y[0] if isinstance(y, tuple) else y for y in (y64, y32))
    assert y64.dtype == torch.float64
    torch.testing.assert_close(y64.float(), y32, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cls,kw", [
    ("RelativeMultiheadAttention", dict(per_head_tables=True, rel_bias=True, rel_queries=True)),
    ("RelativeMultiheadAttention", dict(max_distance=(5, 2), num_kv_heads=1, kdim=8)),
    ("ShawRelativeAttention", dict(rel_values=False)),
])
def test_module_meta_init_reset_parameters(cls, kw):
    """Deferred initialisation (FSDP's): made on the meta device, ``to_empty()``, then
    ``reset_parameters()`` on each module that has it, the layer holds what the constructor
    would have made from the same seed; and a reset re-draws every parameter."""
    make = getattr(relpos_ext.nn, cls)
    kw = dict(embed_dim=16, num_heads=2, max_distance=3) | kw
    torch.manual_seed(0)
    want = make(**kw).state_dict()
    layer = make(**kw, device="meta").to_empty(device="cpu")
    for t in layer.parameters():
        t.detach().fill_(float("nan"))
    torch.manual_seed(0)
    layer.reset_parameters()
    got = layer.state_dict()
    assert got.keys() == want.keys()
    for name, t in got.items():
        torch.testing.assert_close(t, want[name], rtol=0, atol=0, msg=name)  # NaN: not reset
    # FSDP's order: the layer, then its children, each once
    for module in layer.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert all(torch.isfinite(t).all() for t in layer.parameters())
    before = {n: t.clone() for n, t in layer.named_parameters()}
    layer.reset_parameters()
    for name, t in layer.named_parameters():
        assert name == "rel_bias" or not torch.equal(t, before[name]), name


@pytest.mark.parametrize("cls", ["RelativeMultiheadAttention", "ShawRelativeAttention"])
def test_module_fsdp2_deferred_init(cls, tmp_path):
    """FSDP2's deferred initialisation as its docs give it: made on the meta device,
    ``fully_shard`` (the parameters become DTensors), ``to_empty()``, ``reset_parameters()``,
    then a training step. One process (gloo, world size 1). The tables used to be filled by
    ``copy_`` of a plain tensor, which a DTensor refuses."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        with torch.device("meta"):
            layer = getattr(relpos_ext.nn, cls)(16, 2, 3)
        fully_shard(layer)
        layer.to_empty(device="cpu")
        layer.reset_parameters()
        for name, t in layer.named_parameters():
            full = t.full_tensor()
            assert torch.isfinite(full).all() and full.std() > 0, name
        x = torch.randn(2, 5, 16)
        y = layer(x)
        (y[0] if isinstance(y, tuple) else y).square().sum().backward()
        assert all(torch.isfinite(t.grad.full_tensor()).all() for t in layer.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_module_kv_cache_decoding(gqa, grad):
    """A causal sequence fed in pieces through a KVCache (4 rows, then 1, 1, 5, 13, 16) gives the
    rows of one call on the whole sequence, padding mask included, for the fused module and the
    reference module alike; the cache holds the projected keys once. Without gradients it keeps
    them in a buffer that doubles when full (16 -> 48 positions here), which the layer reads in
    place; with them, in tensors grown by torch.cat."""
    torch.manual_seed(0)
    m, r = _module_pair(gqa)
    x = torch.randn(2, 40, 32)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[1, 2] = True
    mask[0, 30] = True
    for layer in (m, r):
        full, _ = layer(x, key_padding_mask=mask, is_causal=True)
        cache = relpos_ext.nn.KVCache()
        pieces, start, capacities = [], 0, []
        with torch.set_grad_enabled(grad):
            for n in (4, 1, 1, 5, 13, 16):
                out, _ = layer(x[:, start:start + n], key_padding_mask=mask[:, :start + n],
                               is_causal=True, cache=cache)
                pieces.append(out)
                start += n
                capacities.append(cache.capacity)
        assert cache.length == 40 and cache.k.shape == (2, 2 if gqa else 4, 40, 8)
        want = [4, 5, 6, 11, 24, 40] if grad else [16, 16, 16, 16, 48, 48]
        assert capacities == want
        assert cache.k.requires_grad == grad
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
        cache.reset()
        assert cache.length == 0 and cache.k is None and cache.capacity == 0


@pytest.mark.parametrize("trained", ["q_proj", "tables"])
def test_module_kv_cache_frozen_key_projections(trained):
    """Keys and values that need no gradient (k_proj and v_proj frozen) while the queries or the
    tables train: autograd saves each call's keys for its backward, so the cache must not write
    the next rows over them (it grows by torch.cat, not in its buffer). The pieces' gradients
    equal one call's on the whole sequence."""
    torch.manual_seed(0)
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3, rel_bias=True)
    frozen = [m.k_proj, m.v_proj] + ([] if trained == "q_proj" else [m.q_proj, m.out_proj])
    for module in frozen:
        module.requires_grad_(False)
    x = torch.randn(2, 9, 32)
    full, _ = m(x, is_causal=True)
    full.square().sum().backward()
    want = {n: t.grad.clone() for n, t in m.named_parameters() if t.requires_grad}
    m.zero_grad()
    cache = relpos_ext.nn.KVCache()
    pieces = [m(x[:, a:b], is_causal=True, cache=cache)[0] for a, b in ((0, 4), (4, 5), (5, 9))]
    torch.cat(pieces, 1).square().sum().backward()
    assert cache.capacity == 9  # no buffer
    for name, t in m.named_parameters():
        if t.requires_grad:
            torch.testing.assert_close(t.grad, want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_module_kv_cache_inference_mode_then_no_grad():
    """A prompt cached under torch.inference_mode, then steps under torch.no_grad: the buffer made
    in inference mode cannot be written outside it, so the cache moves to a new one."""
    torch.manual_seed(0)
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3).eval()
    x = torch.randn(1, 7, 32)
    full, _ = m(x, is_causal=True)
    cache = relpos_ext.nn.KVCache()
    with torch.inference_mode():
        first, _ = m(x[:, :5], is_causal=True, cache=cache)
    with torch.no_grad():
        rest = [m(x[:, i:i + 1], is_causal=True, cache=cache)[0] for i in (5, 6)]
    assert cache.length == 7 and not cache.k.is_inference()
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, atol=1e-5, rtol=1e-5)


def test_module_kv_cache_compiled_decoding():
    """A decoding step with a KVCache compiles with fullgraph=True (the cache's tensors grow by
    one position per call; dynamic shapes) and matches one eager call on the whole sequence."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3, num_kv_heads=2).eval()
    x = torch.randn(2, 9, 32)
    full, _ = m(x, is_causal=True)
    cache = relpos_ext.nn.KVCache()
    step = torch.compile(lambda t: m(t, is_causal=True, cache=cache)[0], fullgraph=True, dynamic=True)
    with torch.no_grad():
        outs = [step(x[:, :4])] + [step(x[:, i:i + 1]) for i in range(4, 9)]
    assert cache.length == 9
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def _window_pair(gqa, window):
    """_module_pair's layers with a local window and a learned bias (drawn, not zero)."""
    m, r = _module_pair(gqa, window=window, rel_bias=True)
    with torch.no_grad():
        m.rel_bias.normal_()
    r.load_state_dict(m.state_dict())
    return m, r


@pytest.mark.parametrize("window", [(5, 0), (0, 0), (12, 3)])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_module_kv_cache_sliding(gqa, grad, window):
    """A KVCache(sliding=True) under a left window of w keeps only the last w positions (their
    padding too), from cache.offset on, and gives the rows of one call on the whole sequence
    (fused and reference modules, pieces longer and shorter than the window). Without
    gradients its buffer stays at a few windows: the kept rows move to the front when full."""
    torch.manual_seed(0)
    left = window[0]
    m, r = _window_pair(gqa, window)
    x = torch.randn(2, 60, 32)
    mask = torch.zeros(2, 60, dtype=torch.bool)
    mask[1, 2] = mask[0, 30] = mask[1, 44] = True
    for layer in (m, r):
        full, _ = layer(x, key_padding_mask=mask, is_causal=True)
        cache = relpos_ext.nn.KVCache(sliding=True)
        pieces, start, capacities = [], 0, set()
        with torch.set_grad_enabled(grad):
            for n in (4, 1, 1, 5, 13, 16) + (1,) * 20:
                out, _ = layer(x[:, start:start + n], key_padding_mask=mask[:, start:start + n],
                               is_causal=True, cache=cache)
                pieces.append(out)
                start += n
                capacities.add(cache.capacity)
                assert cache.length == start and cache.held == min(left, start)
                assert cache.offset == start - cache.held
                assert cache.k.shape[2] == cache.v.shape[2] == cache.held
                assert torch.equal(cache.key_padding_mask, mask[:, cache.offset:start])
        assert start == 60
        assert max(capacities) <= (max(2 * (left + 16), 16) if not grad else left)
        assert cache.k.requires_grad == grad
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
        cache.reset()
        assert cache.length == 0 and cache.offset == 0 and cache.k is None


def test_module_kv_cache_sliding_segments_and_compiled():
    """A sliding cache with packed segment ids (kept for the held positions only), and compiled
    decoding steps (fullgraph, dynamic shapes) through one: the rows of one whole call."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m, _ = _window_pair(True, (6, 0))
    m.eval()
    x = torch.randn(2, 30, 32)
    seg = torch.tensor([[0] * 9 + [1] * 21, [0] * 2 + [1] * 16 + [2] * 12])
    with torch.no_grad():
        full, _ = m(x, segment_ids=seg, is_causal=True)
        cache = relpos_ext.nn.KVCache(sliding=True)
        outs, start = [], 0
        for n in (3, 1, 8, 1, 2):
            outs.append(m(x[:, start:start + n], segment_ids=seg[:, start:start + n],
                          is_causal=True, cache=cache)[0])
            start += n
        assert torch.equal(cache.segment_ids, seg[:, start - 6:start])
        torch.testing.assert_close(torch.cat(outs, 1), full[:, :start], atol=1e-5, rtol=1e-5)
        full, _ = m(x, is_causal=True)
        cache = relpos_ext.nn.KVCache(sliding=True)
        step = torch.compile(lambda t: m(t, is_causal=True, cache=cache)[0], fullgraph=True,
                             dynamic=True)
        outs = [step(x[:, :4])] + [step(x[:, i:i + 1]) for i in range(4, 30)]
    assert cache.length == 30 and cache.held == 6 and cache.offset == 24
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_module_kv_cache_sliding_lets_a_long_prompt_go():
    """Without gradients, the buffer a long prompt needed for its own call shrinks to a couple
    of windows once the positions before the window are dropped; the next steps still match."""
    torch.manual_seed(0)
    m, _ = _window_pair(False, (7, 0))
    x = torch.randn(1, 210, 32)
    with torch.no_grad():
        full, _ = m(x, is_causal=True)
        cache = relpos_ext.nn.KVCache(sliding=True)
        outs = [m(x[:, :200], is_causal=True, cache=cache)[0]]
        assert cache.held == 7 and cache.capacity == 16
        outs += [m(x[:, i:i + 1], is_causal=True, cache=cache)[0] for i in range(200, 210)]
    assert cache.capacity == 16 and cache.offset == 203
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_module_kv_cache_sliding_needs_a_left_window():
    for window in (None, (-1, 0), (-1, 4)):
        m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3, window=window)
        cache = relpos_ext.nn.KVCache(sliding=True)
        with pytest.raises(ValueError, match=r"needs window=\(left, right\) with left >= 0"):
            m(torch.randn(1, 2, 32), is_causal=True, cache=cache)
        assert cache.length == 0


@pytest.mark.parametrize("grad", [False, True])
def test_module_kv_cache_reorder_for_beam_search(grad):
    """cache.reorder(indices) makes batch row b the cached row indices[b] (batch size may
    change), padding included: the next steps equal one call on the reordered histories."""
    torch.manual_seed(0)
    m, r = _module_pair(True)
    x = torch.randn(2, 6, 32)
    y = torch.randn(3, 3, 32)
    pad = torch.tensor([[True, False, False, False, False, False], [False] * 6])
    idx = torch.tensor([1, 0, 0])
    for layer in (m, r):
        whole = torch.cat([x[idx], y], 1)
        full, _ = layer(whole, key_padding_mask=torch.cat([pad[idx], torch.zeros(3, 3,
                        dtype=torch.bool)], 1), is_causal=True)
        cache = relpos_ext.nn.KVCache()
        with torch.set_grad_enabled(grad):
            layer(x[:, :4], key_padding_mask=pad[:, :4], is_causal=True, cache=cache)
            layer(x[:, 4:], is_causal=True, cache=cache)
            capacity = cache.capacity
            cache.reorder(idx)
            assert cache.k.shape[0] == 3 and cache.capacity == capacity
            assert torch.equal(cache.key_padding_mask, pad[idx])
            outs = [layer(y[:, i:i + 1], is_causal=True, cache=cache)[0] for i in range(3)]
        torch.testing.assert_close(torch.cat(outs, 1), full[:, 6:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"integer indices \[B'\]"):
        cache.reorder(torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("sliding", [None, 0, 2])
def test_module_kv_cache_crop_for_speculative_decoding(sliding):
    """cache.crop(n) forgets the positions from n on (rejected draft rows, their segment ids
    too): the next rows take position n and equal one call on the accepted sequence. A sliding
    cache (window 4) goes back only as far as its spare positions allow."""
    torch.manual_seed(0)
    m, _ = _window_pair(False, (4, 0))
    x = torch.randn(2, 14, 32)
    draft = torch.randn(2, 3, 32)
    seg = torch.zeros(2, 14, dtype=torch.int64)
    seg[1, 9:] = 1
    with torch.no_grad():
        full, _ = m(x, segment_ids=seg, is_causal=True)
        cache = (relpos_ext.nn.KVCache() if sliding is None
                 else relpos_ext.nn.KVCache(sliding=True, spare=sliding))
        outs = [m(x[:, :8], segment_ids=seg[:, :8], is_causal=True, cache=cache)[0]]
        # a draft of 3 rows, of which the first (x[:, 8]) is accepted: back to 9 of 11
        m(torch.cat([x[:, 8:9], draft[:, 1:]], 1), segment_ids=seg[:, 8:11], is_causal=True,
          cache=cache)
        assert cache.length == 11 and cache.offset == (0 if sliding is None else 7 - sliding)
        if sliding == 0:
            with pytest.raises(ValueError, match=r"crop\(9\): this cache crops to lengths 11 to "
                                                 r"11 \(it keeps spare=0 positions beyond its "
                                                 r"window of 4\)"):
                cache.crop(9)
            return
        cache.crop(9)
        assert cache.length == 9 and torch.equal(cache.segment_ids, seg[:, cache.offset:9])
        outs.append(full[:, 8:9])
        outs += [m(x[:, 9:11], segment_ids=seg[:, 9:11], is_causal=True, cache=cache)[0],
                 m(x[:, 11:], segment_ids=seg[:, 11:], is_causal=True, cache=cache)[0]]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"crop\(15\)"):
        cache.crop(15)
    with pytest.raises(ValueError, match="only with sliding=True"):
        relpos_ext.nn.KVCache(spare=2)


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True, database=None)
@hypothesis.given(data=st.data())
def test_module_kv_cache_random_decoding(data):
    """Random decoding through a KVCache: pieces of 1-7 rows, a left window or none, a sliding
    cache with spare positions, crops (rejected drafts) and beam reorders between the calls,
    a padded prompt, gradients on or off. Every row kept equals the row of one causal call on
    the sequence the cache ended up holding."""
    left = data.draw(st.sampled_from([None, 0, 1, 3, 8]), label="left")
    sliding = left is not None and data.draw(st.booleans(), label="sliding")
    spare = data.draw(st.integers(0, 4), label="spare") if sliding else 0
    grad = data.draw(st.booleans(), label="grad")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    torch.manual_seed(0)
    m = relpos_ext.nn.RelativeMultiheadAttention(
        16, 4, 2, num_kv_heads=2, rel_bias=True, window=None if left is None else (left, 0))
    cache = relpos_ext.nn.KVCache(sliding=sliding, spare=spare)
    seq = torch.empty(2, 0, 16)  # the rows of the positions the cache holds, in order
    outs = torch.empty(2, 0, 16)  # the layer's output rows at those positions
    mask = torch.empty(2, 0, dtype=torch.bool)  # their key padding
    pad = torch.rand(2, 6, generator=gen) < 0.3
    pad[:, -1] = False
    with torch.set_grad_enabled(grad):
        for step in range(data.draw(st.integers(1, 8), label="calls")):
            n = 6 if step == 0 else data.draw(st.integers(1, 7), label="rows")
            x = torch.randn(2, n, 16, generator=gen)
            kw = {"key_padding_mask": pad} if step == 0 else {}
            y, _ = m(x, is_causal=True, cache=cache, **kw)
            seq, outs = torch.cat([seq, x], 1), torch.cat([outs, y], 1)
            mask = torch.cat([mask, pad if step == 0 else torch.zeros(2, n, dtype=torch.bool)], 1)
            back = data.draw(st.integers(0, min(n, spare) if sliding else n), label="crop")
            if back:
                cache.crop(cache.length - back)
                seq, outs, mask = seq[:, :-back], outs[:, :-back], mask[:, :-back]
            if data.draw(st.booleans(), label="reorder"):
                idx = torch.tensor(data.draw(st.lists(st.integers(0, 1), min_size=2, max_size=2),
                                             label="indices"))
                cache.reorder(idx)
                seq, outs, mask = seq[idx], outs[idx], mask[idx]
    assert cache.length == seq.shape[1]
    if sliding:
        assert cache.held <= left + spare
    with torch.no_grad():
        full, _ = m(seq, key_padding_mask=mask, is_causal=True)
    torch.testing.assert_close(outs.detach(), full, atol=1e-5, rtol=1e-5)


def test_module_kv_cache_bad_use():
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3)
    x = torch.randn(2, 3, 32)
    cache = relpos_ext.nn.KVCache()
    with pytest.raises(ValueError, match="key and value must be None"):
        m(x, x, x, cache=cache)
    with pytest.raises(ValueError, match="q_offset and k_offset must be 0"):
        m(x, q_offset=2, cache=cache)
    m(x, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="do not extend the cached"):
        m(torch.randn(1, 1, 32), is_causal=True, cache=cache)  # another batch size
    assert cache.length == 3


@pytest.mark.parametrize("compiled", [False, True])
def test_module_kv_cache_left_padded_batch(compiled):
    """Batched decoding of prompts of 6, 4 and 1 tokens, padded on the left to 6: the prompt's
    key_padding_mask is given once and the cache keeps it, so the steps pass only their rows
    (compiled steps too). Each step equals the rows of one call on the whole sequence, and each
    sequence's real rows equal the layer on that sequence alone, unpadded: relative positions do
    not move when padding shifts a sequence (absolute positions would)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3, num_kv_heads=2).eval()
    pads = (0, 2, 5)
    x = torch.randn(3, 10, 32)
    prompt_pad = torch.tensor([[j < p for j in range(6)] for p in pads])
    whole_pad = torch.cat([prompt_pad, torch.zeros(3, 4, dtype=torch.bool)], 1)
    cache = relpos_ext.nn.KVCache()
    step = (torch.compile(lambda t: m(t, is_causal=True, cache=cache)[0], fullgraph=True,
                          dynamic=True) if compiled else lambda t: m(t, is_causal=True, cache=cache)[0])
    with torch.no_grad():
        full, _ = m(x, key_padding_mask=whole_pad, is_causal=True)
        outs = [m(x[:, :6], key_padding_mask=prompt_pad, is_causal=True, cache=cache)[0]]
        outs += [step(x[:, i:i + 1]) for i in range(6, 10)]
        assert torch.equal(cache.key_padding_mask, whole_pad)
        got = torch.cat(outs, 1)
        torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
        for b, p in enumerate(pads):
            alone, _ = m(x[b:b + 1, p:], is_causal=True)
            torch.testing.assert_close(got[b:b + 1, p:], alone, atol=1e-5, rtol=1e-5)
    cache.reset()
    assert cache.key_padding_mask is None and cache.segment_ids is None


def test_module_kv_cache_segment_ids():
    """Packed sequences decoded through a cache: each call passes its new rows' segment ids, the
    cache keeps the rest, and the pieces equal one call with the whole [B, L] ids (reference
    module too); new rows' padding may also be given per call ([B, n])."""
    torch.manual_seed(0)
    m, r = _module_pair(True)
    x = torch.randn(2, 12, 32)
    seg = torch.tensor([[0] * 5 + [1] * 7, [0] * 2 + [1] * 6 + [2] * 4])
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, 3] = True
    for layer in (m, r):
        full, _ = layer(x, key_padding_mask=pad, segment_ids=seg, is_causal=True)
        cache = relpos_ext.nn.KVCache()
        outs, start = [], 0
        for n in (3, 1, 4, 1, 3):
            outs.append(layer(x[:, start:start + n], key_padding_mask=pad[:, start:start + n],
                              segment_ids=seg[:, start:start + n], is_causal=True, cache=cache)[0])
            start += n
        assert torch.equal(cache.segment_ids, seg) and torch.equal(cache.key_padding_mask, pad)
        torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)


def test_module_kv_cache_bad_padding_and_segment_ids():
    """Wrong widths and missing ids raise before the cache changes."""
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3)
    x = torch.randn(2, 3, 32)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    cache = relpos_ext.nn.KVCache()
    m(x, is_causal=True, cache=cache)
    cases = [
        (dict(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)),
         r"key_padding_mask must be \[B, 3\] \(the new rows\) or \[B, 6\]"),
        (dict(segment_ids=ids), r"this cache holds 3 positions without segment ids"),
    ]
    for kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            m(x, is_causal=True, cache=cache, **kw)
        assert cache.length == 3 and cache.key_padding_mask is None and cache.segment_ids is None
    cache.reset()
    m(x, is_causal=True, cache=cache, segment_ids=ids)
    with pytest.raises(ValueError, match="this cache holds segment ids: pass the new rows'"):
        m(x, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match=r"one segment_ids tensor holds the new rows' ids, \[B, 3\]"):
        m(x, is_causal=True, cache=cache, segment_ids=torch.zeros(2, 6, dtype=torch.int64))
    assert cache.length == 3 and cache.segment_ids.shape == (2, 3)


def test_module_compile_training_step():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3, num_kv_heads=2)
    eager = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3, num_kv_heads=2)
    eager.load_state_dict(m.state_dict())
    step = torch.compile(lambda x: m(x, is_causal=True)[0].square().mean(), fullgraph=True, dynamic=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    for length in (5, 8, 11):
        x = torch.randn(2, length, 32)
        loss = step(x)
        loss_e = eager(x, is_causal=True)[0].square().mean()
        torch.testing.assert_close(loss, loss_e)
        for o, l in ((opt, loss), (opt_e, loss_e)):
            o.zero_grad()
            l.backward()
            o.step()
    for pm, pe in zip(m.parameters(), eager.parameters()):
        torch.testing.assert_close(pm, pe, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gqa", [False, True])
def test_module_dropout_matches_reference_module(gqa):
    """dropout=0.3 in training mode: the fused module and the reference module, seeded alike,
    draw the same mask (outputs and every parameter's gradient match); in eval() there is no
    dropout; the mask changes from call to call."""
    m, r = _module_pair(gqa)
    m.dropout = r.dropout = 0.3
    x = torch.randn(2, 70, 32)
    torch.manual_seed(11)
    got, _ = m(x, is_causal=True)
    torch.manual_seed(11)
    exp, _ = r(x, is_causal=True)
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    exp.square().sum().backward()
    for (name, pm), pr in zip(m.named_parameters(), r.parameters()):
        torch.testing.assert_close(pm.grad, pr.grad, atol=1e-4, rtol=1e-4, msg=name)
    assert not torch.equal(m(x)[0], m(x)[0])
    m.eval()
    m.dropout = 0.0
    undropped = m(x)[0]
    m.dropout = 0.3
    assert torch.equal(m(x)[0], undropped)


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_module_need_weights(gqa, dropout):
    """need_weights=True returns the probabilities the fused kernel applied (dropout included):
    with average_attn_weights=False, [B, H, Lq, Lk] weights w give the layer's output as
    out_proj(sum_j w_ij (v_j + rel_v[b(i, j)])); averaged, their mean over heads, [B, Lq, Lk], as
    nn.MultiheadAttention. Without dropout each row sums to 1, or 0 when no key is visible."""
    m, _ = _module_pair(gqa)
    m.dropout = dropout
    x, mem = torch.randn(2, 7, 32), torch.randn(2, 9, 32)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[1, -3:] = True
    mask[0, :] = True  # batch 0 sees no key at all
    for args, causal in (((x,), True), ((x, mem, mem, mask), False)):
        torch.manual_seed(4)
        out, w = m(*args, is_causal=causal, need_weights=True, average_attn_weights=False)
        torch.manual_seed(4)
        out_avg, w_avg = m(*args, is_causal=causal, need_weights=True)
        assert w.shape == (2, 4, 7, args[-1].shape[1] if len(args) > 1 else 7)
        assert torch.equal(out, out_avg)
        torch.testing.assert_close(w_avg, w.mean(dim=1))
        kv = args[2] if len(args) > 1 else x
        v = m._heads(m.v_proj(kv), m.num_kv_heads).repeat_interleave(4 // m.num_kv_heads, dim=1)
        a = ref.rel_gather(m.rel_v, 7, v.shape[2], m.max_distance)
        z = w @ v + torch.einsum("bhij,ijd->bhid" if a.dim() == 3 else "bhij,hijd->bhid", w, a)
        exp = m.out_proj(z.transpose(1, 2).reshape(2, 7, 32))
        torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
        if dropout == 0:
            sums = w.sum(-1)
            want = torch.ones_like(sums)
            if len(args) > 1:
                want[0] = 0
            torch.testing.assert_close(sums, want)


@pytest.mark.parametrize("form", ["2d", "bh3d"])
def test_module_attn_mask(form):
    """attn_mask as nn.MultiheadAttention takes it ([Lq, Lk] or [B * H, Lq, Lk], bool, True =
    ignore), with padding and is_causal: outputs, weights and every parameter's gradient match
    the reference module; need_weights' rows are 0 on the masked keys. An integer mask, or a 3-D
    one of the wrong size, is refused (float masks: test_nn_compat.py)."""
    m, r = _module_pair(True)
    x, mem = torch.randn(2, 7, 32), torch.randn(2, 9, 32)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, -2:] = True
    g = torch.Generator().manual_seed(1)
    mask = torch.rand((7, 9) if form == "2d" else (2 * 4, 7, 9), generator=g) < 0.3
    got, w = m(x, mem, mem, kpm, need_weights=True, attn_mask=mask, average_attn_weights=False,
               is_causal=True, k_offset=-3)
    exp, _ = r(x, mem, mem, kpm, attn_mask=mask, is_causal=True, k_offset=-3)
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    hidden = mask if form == "2d" else mask.view(2, 4, 7, 9)
    assert (w.masked_select(hidden.expand_as(w)) == 0).all()
    got.square().sum().backward()
    exp.square().sum().backward()
    for (name, pm), pr in zip(m.named_parameters(), r.parameters()):
        torch.testing.assert_close(pm.grad, pr.grad, atol=1e-4, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="attn_mask must be bool"):
        m(x, mem, mem, attn_mask=torch.zeros(7, 9, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"a 3-D attn_mask must be \[B \* H, Lq, Lk\]"):
        m(x, mem, mem, attn_mask=torch.zeros(4, 7, 9, dtype=torch.bool))


@pytest.mark.parametrize("gqa", [False, True])
def test_module_segment_ids(gqa):
    """segment_ids on the module: one [B, L] tensor for self-attention, or a (q, k) pair: the
    outputs, the weights and every parameter's gradient match the reference module, and equal
    the same documents as a block-diagonal attn_mask; a position sees no other document. One
    tensor with Lq != Lk is refused."""
    m, r = _module_pair(gqa)
    x = torch.randn(2, 11, 32)
    seg = torch.tensor([[0] * 4 + [1] * 7, [0] * 6 + [1] * 2 + [2] * 3])
    got, w = m(x, segment_ids=seg, is_causal=True, need_weights=True, average_attn_weights=False)
    exp, _ = r(x, segment_ids=seg, is_causal=True)
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    other_doc = seg[:, None, :, None] != seg[:, None, None, :]
    assert (w.masked_select(other_doc.expand_as(w)) == 0).all()
    same, _ = m(x, segment_ids=(seg, seg), is_causal=True)
    as_mask, _ = m(x, attn_mask=other_doc.expand(2, 4, 11, 11).reshape(8, 11, 11), is_causal=True)
    torch.testing.assert_close(same, got, atol=0, rtol=0)
    torch.testing.assert_close(as_mask, got, atol=1e-6, rtol=1e-5)
    got.square().sum().backward()
    exp.square().sum().backward()
    for (name, pm), pr in zip(m.named_parameters(), r.parameters()):
        torch.testing.assert_close(pm.grad, pr.grad, atol=1e-4, rtol=1e-4, msg=name)
    mem = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match="one segment_ids tensor is for self-attention"):
        m(x, mem, mem, segment_ids=seg)
    cross, _ = m(x, mem, mem, segment_ids=(seg, seg[:, :5]))
    cross_exp, _ = r(x, mem, mem, segment_ids=(seg, seg[:, :5]))
    torch.testing.assert_close(cross, cross_exp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [(2, 0), (3, 1)])
def test_module_window(window):
    """window=(left, right) on the module: outputs, weights and every parameter's gradient match
    the reference module, the weights are 0 outside the window, and the layer equals itself
    with the window's attn_mask and no window; it compiles (fullgraph=True) to the same output."""
    m, r = _module_pair(False)
    for mod in (m, r):
        mod.window = window
    x = torch.randn(2, 11, 32)
    got, w = m(x, is_causal=True, need_weights=True, average_attn_weights=False)
    exp, _ = r(x, is_causal=True)
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    rel = torch.arange(11)[None, :] - torch.arange(11)[:, None]
    outside = (rel < -window[0]) | (rel > window[1])
    assert (w.masked_select(outside.expand_as(w)) == 0).all()
    m.window = (-1, -1)
    as_mask, _ = m(x, attn_mask=outside, is_causal=True)
    m.window = window
    torch.testing.assert_close(as_mask, got, atol=1e-6, rtol=1e-5)
    got.square().sum().backward()
    exp.square().sum().backward()
    for (name, pm), pr in zip(m.named_parameters(), r.parameters()):
        torch.testing.assert_close(pm.grad, pr.grad, atol=1e-4, rtol=1e-4, msg=name)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: m(x, is_causal=True)[0], fullgraph=True)
    torch.testing.assert_close(compiled(x), got, atol=1e-5, rtol=1e-5)
    assert relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3, window=(5, 0)).window == (5, 0)


@pytest.mark.parametrize("per_head", [False, True])
def test_module_asymmetric_clipping(per_head):
    """max_distance=(left, right): tables of left + right + 1 rows; outputs, weights and every
    parameter's gradient match the reference module, and the layer equals a symmetric K =
    max(left, right) layer holding the clipped tables (bitwise); a negative side is refused."""
    torch.manual_seed(0)
    kw = dict(embed_dim=32, num_heads=4, max_distance=(5, 2), per_head_tables=per_head)
    m = relpos_ext.nn.RelativeMultiheadAttention(**kw)
    r = ref.RelativeMultiheadAttentionReference(**kw)
    r.load_state_dict(m.state_dict())
    assert m.rel_k.shape == ((4,) if per_head else ()) + (8, 8) and m.max_distance == 5
    x = torch.randn(2, 11, 32)
    got, w = m(x, is_causal=False, need_weights=True, average_attn_weights=False)
    exp, _ = r(x)
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    sym = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 5, per_head_tables=per_head)
    state = dict(m.state_dict())
    state.update(rel_k=m.tables()[0].detach(), rel_v=m.tables()[1].detach())
    sym.load_state_dict(state)
    got_sym, w_sym = sym(x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(got_sym, got, atol=0, rtol=0)
    torch.testing.assert_close(w_sym, w, atol=0, rtol=0)
    got.square().sum().backward()
    exp.square().sum().backward()
    for (name, pm), pr in zip(m.named_parameters(), r.parameters()):
        torch.testing.assert_close(pm.grad, pr.grad, atol=1e-4, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match=r"max_distance \(left, right\) must be >= 0"):
        relpos_ext.nn.RelativeMultiheadAttention(32, 4, (3, -1))


@pytest.mark.parametrize("cls,k,error,match", [
    ("RelativeMultiheadAttention", 8.0, TypeError, r"max_distance must be an int, got 8.0"),
    ("RelativeMultiheadAttention", (6.5, 2), TypeError,
     r"max_distance \(left, right\) must be an int, got 6.5"),
    ("RelativeMultiheadAttention", (1, 2, 3), ValueError, r"must be an int or \(left, right\)"),
    ("ShawRelativeAttention", 8.0, TypeError, r"max_distance must be an int, got 8.0"),
])
def test_module_max_distance_must_be_integers(cls, k, error, match):
    """A float K (or clip) is an error naming max_distance, not torch.empty's TypeError, nor a
    fraction cut off (6.5 used to clip at 6); numpy and torch integers are ints."""
    make = getattr(relpos_ext.nn, cls)
    with pytest.raises(error, match=match):
        make(32, 4, k)
    assert make(32, 4, torch.tensor(3)).max_distance == 3


def _check_learned_positions(m, kw, param, table_of, clip, x):
    """The module m with its learned `param` (rel_bias or rel_q, zero at first) set to random
    values: the table the kernels get (table_of(m)) is the clipped one; output and every
    gradient (param's included) match the reference module; need_weights returns the
    probabilities the kernels applied (there is no value table: the output is
    out_proj(weights @ v)); a KV cache decodes the rows of one call; a compiled (fullgraph) step
    gives eager's loss and param's gradient."""
    weight = getattr(m, param)
    assert not weight.any()
    with torch.no_grad():
        without = m(x, is_causal=True)[0]
        weight.normal_(0, 2 if param == "rel_bias" else 1)
    left, right = clip if isinstance(clip, tuple) else (clip, clip)
    dist = torch.arange(-m.max_distance, m.max_distance + 1)  # the kernels' buckets' distances
    torch.testing.assert_close(table_of(m), weight[..., dist.clamp(-left, right) + left, :]
                               if weight.dim() == 3 else weight[:, dist.clamp(-left, right) + left],
                               atol=0, rtol=0)
    r = ref.RelativeMultiheadAttentionReference(**kw)
    r.load_state_dict(m.state_dict())
    batch, length, embed = x.shape
    got, w = m(x, is_causal=True, need_weights=True, average_attn_weights=False)
    assert not torch.allclose(got, without, atol=1e-3)  # the learned term moves the output
    exp, _ = r(x, is_causal=True)
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    heads = m.num_heads
    v = m._heads(m.v_proj(x), m.num_kv_heads).repeat_interleave(heads // m.num_kv_heads, 1)
    by_weights = m.out_proj((w @ v).transpose(1, 2).reshape(batch, length, embed))
    torch.testing.assert_close(by_weights, got, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    exp.square().sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    for (name, pm), pr in zip(m.named_parameters(), r.parameters()):
        torch.testing.assert_close(pm.grad, pr.grad, atol=1e-4, rtol=1e-4, msg=name)
    cache, pieces, start = relpos_ext.nn.KVCache(), [], 0
    with torch.no_grad():
        for n in (5, 1, length - 6):
            pieces.append(m(x[:, start:start + n], is_causal=True, cache=cache)[0])
            start += n
    torch.testing.assert_close(torch.cat(pieces, 1), got.detach(), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    m.zero_grad()
    step = torch.compile(lambda x: m(x, is_causal=True)[0].square().sum(), fullgraph=True)
    loss = step(x)
    loss.backward()
    torch.testing.assert_close(loss, exp.square().sum(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(weight.grad, getattr(r, param).grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("clip", [3, (5, 2)], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("gqa", [False, True])
def test_module_rel_bias(gqa, clip):
    """rel_bias=True: a learned [H, 2K+1] (or [H, left + right + 1]) bias, zero at first;
    _check_learned_positions."""
    torch.manual_seed(0)
    kw = dict(embed_dim=32, num_heads=4, max_distance=clip, num_kv_heads=2 if gqa else None,
              rel_values=False, rel_bias=True)
    m = relpos_ext.nn.RelativeMultiheadAttention(**kw)
    assert m.rel_bias.shape == (4, 7 if clip == 3 else 8)
    _check_learned_positions(m, kw, "rel_bias", lambda m: m.bias_table(), clip,
                             torch.randn(2, 13, 32))


@pytest.mark.parametrize("clip", [3, (4, 3)], ids=["symmetric", "asymmetric"])
@pytest.mark.parametrize("gqa", [False, True])
def test_module_rel_queries(gqa, clip):
    """rel_queries=True: a learned per-head key-side table (DeBERTa's position-to-content term)
    next to the key table; _check_learned_positions from a zero table."""
    torch.manual_seed(0)
    kw = dict(embed_dim=32, num_heads=4, max_distance=clip, num_kv_heads=2 if gqa else None,
              rel_values=False, rel_queries=True, per_head_tables=True)
    m = relpos_ext.nn.RelativeMultiheadAttention(**kw)
    assert m.rel_q.shape == (4, 7 if clip == 3 else 8, 8)
    with torch.no_grad():
        m.rel_q.zero_()
    _check_learned_positions(m, kw, "rel_q", lambda m: m.key_side_table(), clip,
                             torch.randn(2, 13, 32))


def test_module_from_multihead_attention_with_rel_bias():
    """from_multihead_attention(..., rel_bias=True, rel_queries=True): a zero bias and key-side
    table, so the layer still computes what the nn.MultiheadAttention did."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    layer = relpos_ext.nn.RelativeMultiheadAttention.from_multihead_attention(
        mha, 4, rel_bias=True, rel_queries=True)
    assert layer.rel_bias.shape == (4, 9) and not layer.rel_bias.any()
    assert layer.rel_q.shape == (9, 8) and not layer.rel_q.any()
    x = torch.randn(2, 10, 32)
    torch.testing.assert_close(layer(x)[0], mha(x, x, x, need_weights=False)[0], atol=1e-5,
                               rtol=1e-5)


def test_module_segment_ids_compiled_training_step():
    """A compiled (fullgraph=True, dynamic=True) training step with segment ids: no graph break,
    and the loss and table gradients of eager."""
    torch._dynamo.reset()
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3)
    step = torch.compile(lambda x, s: m(x, segment_ids=s, is_causal=True)[0].square().mean(),
                         fullgraph=True, dynamic=True)
    for length in (9, 13):
        x = torch.randn(2, length, 32)
        seg = (torch.arange(length) >= length // 2).long().expand(2, length)
        loss = step(x, seg)
        loss.backward()
        got = m.rel_k.grad.clone()
        m.zero_grad()
        exp = m(x, segment_ids=seg, is_causal=True)[0].square().mean()
        exp.backward()
        torch.testing.assert_close(loss, exp, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got, m.rel_k.grad, atol=1e-6, rtol=1e-4)
        m.zero_grad()


def test_module_need_weights_compiled_fullgraph():
    """need_weights=True, with dropout, compiles with fullgraph=True (the mask is drawn and
    hashed in the graph); without dropout it equals eager."""
    torch._dynamo.reset()
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3)
    x = torch.randn(2, 9, 32)
    compiled = torch.compile(lambda x: m(x, is_causal=True, need_weights=True), fullgraph=True)
    got, w = compiled(x)
    exp, w_exp = m(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, w_exp, atol=1e-6, rtol=1e-5)
    m.dropout = 0.5
    got, w = compiled(x)
    assert w.shape == (2, 9, 9) and torch.isfinite(got).all()


def test_module_dropout_compiled_training_step():
    """torch.compile(fullgraph=True) of a training step with dropout: no graph break (the seed
    is drawn inside the graph), a loss that changes with the mask, finite table gradients."""
    torch._dynamo.reset()
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3, dropout=0.5)
    step = torch.compile(lambda x: m(x, is_causal=True)[0].square().mean(), fullgraph=True)
    x = torch.randn(2, 9, 32)
    losses = []
    for _ in range(3):
        loss = step(x)
        loss.backward()
        losses.append(loss.item())
    assert len(set(losses)) == 3
    assert torch.isfinite(m.rel_k.grad).all() and m.rel_k.grad.abs().sum() > 0


def test_dropout_keep_statistics():
    """reference.dropout_keep (the kernels' mask): the kept fraction is 1 - p within 6 sigma for
    several p, seeds and shapes; adjacent rows, keys and heads are uncorrelated; another seed
    gives another mask; p = 0 keeps all, p = 1 nothing."""
    n = 4 * 8 * 64 * 512
    for p in (0.05, 0.1, 0.5, 0.9):
        for seed in (0, 1, -1, 2**40 + 3):
            keep = ref.dropout_keep(seed, 4, 8, 64, 512, p).double()
            assert abs(keep.mean().item() - (1 - p)) < 6 * (p * (1 - p) / n) ** 0.5, (p, seed)
    keep = ref.dropout_keep(9, 2, 4, 128, 256, 0.5).double() - 0.5
    for a, b in ((keep[..., 1:, :], keep[..., :-1, :]), (keep[..., 1:], keep[..., :-1]),
                 (keep[:, 1:], keep[:, :-1]), (keep[1:], keep[:-1])):
        corr = (a * b).mean().item() / 0.25
        assert abs(corr) < 6 / a.numel() ** 0.5
    other = ref.dropout_keep(10, 2, 4, 128, 256, 0.5).double() - 0.5
    assert abs((keep * other).mean().item() / 0.25) < 6 / keep.numel() ** 0.5
    assert ref.dropout_keep(5, 1, 2, 3, 4, 0.0).all()
    assert not ref.dropout_keep(5, 1, 2, 3, 4, 1.0).any()


# ------------------------------------------------------------------------------------ errors
def _bad(**over):
    tensors, kw = make_inputs(CASES["basic"], torch.float32)
    q, k, v, rk, rv = tensors
    args = dict(q=q, k=k, v=v, rel_k=rk, rel_v=rv, max_distance=2)
    args.update(over)
    return lambda: relpos_ext.rel_attention(**args)


BAD = [
    ("mask wrong shape", _bad(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), r"key_padding_mask must be \[B, Lk\]"),
    ("mask not bool", _bad(key_padding_mask=torch.zeros(2, 5)), r"key_padding_mask must be bool"),
    ("k dtype", _bad(k=torch.randn(2, 2, 5, 16, dtype=torch.float64)), r"k and v dtypes must match q dtype"),
    ("v shape", _bad(v=torch.randn(2, 2, 6, 16)), r"v must have the shape of k"),
    ("heads not dividing", _bad(k=torch.randn(2, 3, 5, 16), v=torch.randn(2, 3, 5, 16)), r"k's head count must divide q's"),
    ("table rows", _bad(rel_k=torch.randn(4, 16)), r"rel_k must have 2\*max_distance\+1 = 5 rows"),
    ("table dtype", _bad(rel_v=torch.randn(5, 16, dtype=torch.float16)), r"rel_v dtype must match q dtype"),
    ("table D", _bad(rel_v=torch.randn(5, 8)), r"rel_v's last dim must equal q's head dim"),
    ("q 3-D", _bad(q=torch.randn(2, 5, 16)), r"q must be \[B, H, Lq, D\]"),
    ("negative K", _bad(max_distance=-1, rel_k=None, rel_v=None), r"max_distance must be >= 0"),
    ("dropout_p > 1", _bad(dropout_p=1.5), r"dropout_p must be in \[0, 1\]"),
    ("dropout_p < 0", _bad(dropout_p=-0.1, dropout_seed=torch.tensor([1])), r"dropout_p must be in \[0, 1\]"),
    ("dropout seed dtype", _bad(dropout_p=0.1, dropout_seed=torch.tensor([1.0])), r"dropout_seed must be a CPU int64 tensor of one element"),
    ("dropout seed size", _bad(dropout_p=0.1, dropout_seed=torch.tensor([1, 2])), r"dropout_seed must be a CPU int64 tensor of one element"),
    ("attn_mask dtype", _bad(attn_mask=torch.zeros(5, 5)), r"attn_mask must be bool"),
    ("attn_mask shape", _bad(attn_mask=torch.zeros(5, 4, dtype=torch.bool)), r"attn_mask must be \[Lq, Lk\] or \[B or 1, H or 1, Lq, Lk\]"),
    ("attn_mask heads", _bad(attn_mask=torch.zeros(1, 3, 5, 5, dtype=torch.bool)), r"attn_mask must be \[Lq, Lk\]"),
    ("attn_mask 3-D", _bad(attn_mask=torch.zeros(2, 5, 5, dtype=torch.bool)), r"attn_mask must be \[Lq, Lk\]"),
    ("segment ids alone", _bad(q_segment_ids=torch.zeros(2, 5, dtype=torch.int64)), r"q_segment_ids and k_segment_ids go together"),
    ("segment ids dtype", _bad(q_segment_ids=torch.zeros(2, 5), k_segment_ids=torch.zeros(2, 5)), r"q_segment_ids must be an integer tensor"),
    ("segment ids bool", _bad(q_segment_ids=torch.zeros(2, 5, dtype=torch.int32), k_segment_ids=torch.zeros(2, 5, dtype=torch.bool)), r"k_segment_ids must be an integer tensor"),
    ("segment ids shape", _bad(q_segment_ids=torch.zeros(2, 5, dtype=torch.int32), k_segment_ids=torch.zeros(2, 4, dtype=torch.int32)), r"k_segment_ids must be \[B, Lk\] = \[2, 5\]"),
    ("segment ids batch", _bad(q_segment_ids=torch.zeros(1, 5, dtype=torch.int32), k_segment_ids=torch.zeros(2, 5, dtype=torch.int32)), r"q_segment_ids must be \[B, Lq\] = \[2, 5\]"),
    ("bias columns", _bad(rel_bias=torch.randn(4)), r"rel_bias must be \[2K\+1\] \(shared\) or \[H, 2K\+1\]"),
    ("bias 3-D", _bad(rel_bias=torch.randn(2, 2, 5)), r"rel_bias must be \[2K\+1\] \(shared\) or \[H, 2K\+1\]"),
    ("bias heads", _bad(rel_bias=torch.randn(3, 5)), r"a per-head rel_bias \[H, 2K\+1\] must have H equal to q.size\(1\)=2"),
    ("bias dtype", _bad(rel_bias=torch.randn(5, dtype=torch.float64)), r"rel_bias dtype must match q dtype"),
    ("bias zero scale", _bad(rel_bias=torch.randn(5), scale=0.0), r"rel_bias needs a finite nonzero scale; got 0"),
    ("NaN scale", _bad(scale=float("nan")), r"scale must be finite and at most .* for Float inputs; got nan"),
    ("scale beyond float32", _bad(scale=1e39), r"scale must be finite and at most 8.50706e\+37 in magnitude for Float"),
    ("infinite scale", _bad(scale=-float("inf")), r"scale must be finite"),
    ("rel_q rows", _bad(rel_q=torch.randn(4, 16)), r"rel_q must have 2\*max_distance\+1 = 5 rows"),
    ("rel_q dtype", _bad(rel_q=torch.randn(5, 16, dtype=torch.float64)), r"rel_q dtype must match q dtype"),
    ("rel_q D", _bad(rel_q=torch.randn(5, 8)), r"rel_q's last dim must equal q's head dim"),
    ("rel_q heads", _bad(rel_q=torch.randn(3, 5, 16)), r"a per-head rel_q \[H, 2K\+1, D\] must have H equal to q.size\(1\)=2"),
    ("dropout no seed", lambda: torch.ops.relpos.rel_attention.default(
        *make_inputs(CASES["basic"], torch.float32)[0], 2, False, None, 0, 0, None, 0.1, None),
     r"dropout_p > 0 needs dropout_seed"),
]


@pytest.mark.parametrize("desc,fn,pattern", BAD, ids=[b[0] for b in BAD])
def test_rel_attention_bad_input(desc, fn, pattern):
    with pytest.raises((RuntimeError, ValueError), match=pattern):
        fn()


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_efficient_eager_reference_agrees(causal, per_head, masked):
    """reference.shaw_attention_gather (the benchmarks' eager baseline) equals the oracle, with
    an attention mask too (three packed documents)."""
    q, k, v = (torch.randn(2, 3, 9, 8, dtype=torch.float64) for _ in range(3))
    shape = ((3,) if per_head else ()) + (5, 8)
    rk, rv = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    mask = random_attn_mask((2, 3, 3, 9, 9), "docs", 0) if masked else None
    got = ref.shaw_attention_gather(q, k, v, rk, rv, 2, causal, attn_mask=mask)
    torch.testing.assert_close(got, ref.shaw_attention(q, k, v, rk, rv, 2, causal, attn_mask=mask))
