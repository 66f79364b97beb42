"""Tests of the CUDA emulator itself (tests/cuda_emu, DESIGN.md §4).

The emulator must make a missing ``__syncthreads()`` visible, give warp primitives CUDA's
semantics, report synchronisation misuse instead of hanging, and, built with AddressSanitizer,
catch out-of-bounds reads of global and shared memory. The kernels are in
tests/cuda_emu/kernels/emu_test_kernels.cuh.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _emu import SKIP_REASON, emu_seed, load_emu

pytestmark = [pytest.mark.emu, pytest.mark.skipif(not load_emu(), reason=SKIP_REASON)]

REVERSE_BLOCK = 128  # kReverseBlock in emu_test_kernels.h
OOB_BLOCK = 64  # kOobBlock


def emu():
    return torch.ops.relpos_emu_test


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN equal to NaN (uninitialised shared memory reads as NaN)."""
    return a.dtype == b.dtype and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# ---- the schedule ------------------------------------------------------------------------------


def reversal_input() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(16 * REVERSE_BLOCK, dtype=torch.float32)
    return x, x.view(-1, REVERSE_BLOCK).flip(1).reshape(-1)


@pytest.mark.parametrize("seed", range(8))
def test_reversal_with_barrier_is_correct_under_every_seed(seed: int) -> None:
    x, expected = reversal_input()
    with emu_seed(seed):
        assert_same(emu().racy_reverse(x, True), expected)


def test_missing_barrier_changes_the_result() -> None:
    x, expected = reversal_input()
    results = []
    for seed in (0, 1, 0):
        with emu_seed(seed):
            results.append(emu().racy_reverse(x, False))
    assert not same(results[0], results[1]), "two seeds gave the same racy result"
    assert not all(same(r, expected) for r in results), "the race was never exposed"
    assert same(results[0], results[2]), "the same seed must give the same result"


def test_seed_comes_from_the_environment_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    x, _ = reversal_input()
    with emu_seed(5):
        from_override = emu().racy_reverse(x, False)
    assert emu().seed_override() == -1
    monkeypatch.setenv("RELPOS_EMU_SEED", "5")
    assert same(emu().racy_reverse(x, False), from_override)
    with emu_seed(6):  # an explicit seed wins over the environment
        assert not same(emu().racy_reverse(x, False), from_override)
    monkeypatch.setenv("RELPOS_EMU_SEED", "five")
    with pytest.raises(RuntimeError, match="RELPOS_EMU_SEED must be a non-negative integer"):
        emu().racy_reverse(x, False)


# ---- block-level primitives --------------------------------------------------------------------


@pytest.mark.parametrize("block", [1, 32, 128, 256])
def test_block_reduce_in_dynamic_shared_memory(block: int) -> None:
    # Integers, so that every summation order gives the same float32 result.
    x = torch.randint(-50, 50, (1000,), generator=torch.Generator().manual_seed(0)).float()
    sums, positives, total = emu().block_reduce(x, block)
    padded = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    assert_same(sums, padded.sum(1))
    assert_same(positives, (padded > 0).sum(1, dtype=torch.int32))
    assert_same(total, x.sum().view(1))


@pytest.mark.parametrize(
    ("grid", "block"), [([3, 2, 2], [4, 3, 2]), ([5, 1, 1], [32, 1, 1]), ([1, 1, 3], [1, 1, 64])]
)
def test_index_map_covers_every_block_and_thread(grid: list[int], block: list[int]) -> None:
    out = emu().index_map(grid, block)
    gz, gy, gx, bz, by, bx = torch.meshgrid(
        *(torch.arange(n, dtype=torch.int32) for n in (*grid[::-1], *block[::-1])), indexing="ij"
    )
    assert_same(out, torch.stack([gx, gy, gz, bx, by, bz], dim=-1))


@pytest.mark.parametrize(
    ("grid", "block", "message"),
    [
        ([1, 1, 1], [2048, 1, 1], "block"),
        ([1, 1, 1], [32, 32, 2], "block"),
        ([1, 1, 1], [1, 1, 65], "block"),
        ([1, 70000, 1], [32, 1, 1], "grid"),
    ],
)
def test_invalid_launch_configuration_is_rejected(
    grid: list[int], block: list[int], message: str
) -> None:
    with pytest.raises(RuntimeError, match=f"invalid configuration argument: {message}"):
        emu().index_map(grid, block)


# ---- warp primitives ---------------------------------------------------------------------------
# Reference semantics from the CUDA C++ Programming Guide ("Warp Shuffle Functions", "Warp Vote
# Functions"), per segment of `width` lanes: shfl_down leaves lanes whose source is past the
# segment unchanged (it returns their own value), shfl_up likewise before it, __shfl_sync takes
# the source lane modulo width.

WARP_OPS = ["xor_sum", "down_sum", "up_scan", "idx_rotate", "ballot", "any", "all"]
SHAPES = [(64, 32), (64, 16), (96, 8), (64, 1), (48, 16)]  # (block, width); 48: a partial warp


def warp_reference(x: list, op: str, block: int, width: int) -> list:
    out = list(x)
    for start in range(0, len(x), block):
        for warp in range(start, start + block, 32):
            lanes = list(range(warp, min(warp + 32, start + block)))
            preds = [x[i] > 0 for i in lanes]
            for seg in range(0, len(lanes), width):
                seg_lanes = lanes[seg : seg + width]
                v = [x[i] for i in seg_lanes]
                if op == "xor_sum":
                    v = [sum(v)] * len(v)
                elif op == "down_sum":
                    d = width // 2
                    while d > 0:
                        v = [v[r] + (v[r + d] if r + d < width else v[r]) for r in range(len(v))]
                        d //= 2
                elif op == "up_scan":
                    v = [sum(v[: r + 1]) for r in range(len(v))]
                elif op == "idx_rotate":
                    v = [x[seg_lanes[((i - warp) * 3 + 1) % width]] for i in seg_lanes]
                elif op == "ballot":
                    v = [sum(preds)] * len(v)
                elif op == "any":
                    v = [int(any(preds))] * len(v)
                elif op == "all":
                    v = [int(all(preds))] * len(v)
                for i, value in zip(seg_lanes, v):
                    out[i] = value
    return out


def warp_input(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    magnitude = torch.randint(1, 50, (n,), generator=g, dtype=torch.int64)
    if dtype in (torch.int64, torch.float64):
        magnitude += 2**40  # so that the upper 32 bits of 8-byte values must travel too
    positive = torch.rand(n, generator=g) < 0.5
    positive[:32] = True  # one warp all positive, one all negative: `all` and `any` both vary
    positive[32:64] = False
    return torch.where(positive, magnitude, -magnitude).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize(("block", "width"), SHAPES)
@pytest.mark.parametrize("op", WARP_OPS)
def test_warp_primitive(op: str, block: int, width: int, dtype: torch.dtype) -> None:
    x = warp_input(3 * block, dtype)
    expected = torch.tensor(warp_reference(x.tolist(), op, block, width), dtype=dtype)
    assert_same(emu().warp_test(x, op, block, width), expected)


def test_shuffle_from_a_missing_lane_is_poisoned() -> None:
    # Block 48: the second warp has 16 lanes, so a full-width butterfly reads lanes that do not
    # exist. CUDA leaves that value undefined; the emulator returns NaN so that it shows.
    x = torch.ones(48)
    out = emu().warp_test(x, "xor_sum", 48, 32)
    assert_same(out[:32], torch.full((32,), 32.0))
    assert out[32:].isnan().all()


# ---- synchronisation misuse --------------------------------------------------------------------

MISUSE_REPORTS = {
    "early_exit": r"__syncthreads\(\) at emu_test_kernels.cuh:\d+ is not reached by every thread",
    "two_barriers": r"divergent __syncthreads\(\)",
    "warp_vs_block": r"deadlock, no thread can continue: .*__syncwarp\(mask 0xffffffff\)",
    "mask_excludes_lane": r"__shfl_sync\(mask 0x00000001\).*which its mask excludes",
    "bad_width": r"__shfl_xor_sync at emu_test_kernels.cuh:\d+: width 3 is not a power of two",
    "mma_divergent": r"deadlock, no thread can continue: (?=.*warp_collective\(mask 0xffffffff\) "
                     r"at mma.cuh:\d+)(?=.*__syncwarp\(mask 0xffffffff\))",
}


@pytest.mark.parametrize("kind", MISUSE_REPORTS)
def test_misuse_is_reported_not_hung(kind: str) -> None:
    with pytest.raises(RuntimeError, match=MISUSE_REPORTS[kind]):
        emu().misuse(kind)
    # The failed launch left nothing behind: the next one runs normally.
    x, expected = reversal_input()
    assert_same(emu().racy_reverse(x, True), expected)


# ---- tensor cores ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("block", [32, 96, 48])
def test_mma_matches_matmul(dtype: torch.dtype, block: int) -> None:
    """The emulated mma.sync m16n8k16 (one warp_collective per warp) adds A B to D, the fragments
    placed as the PTX ISA lays them out. Small integers: every summation order is exact. In a
    partial warp (block 48) the lanes that exist get NaN, as mma.sync is undefined there."""
    warps = (block + 31) // 32
    g = torch.Generator().manual_seed(block)
    a = torch.randint(-8, 8, (warps, 16, 16), generator=g).to(dtype)
    b = torch.randint(-8, 8, (warps, 16, 8), generator=g).to(dtype)
    d = torch.randint(-50, 50, (warps, 16, 8), generator=g).float()
    out = emu().mma_test(a, b, d, block)
    expected = d + a.float() @ b.float()
    full = block // 32
    assert_same(out[:full], expected[:full])
    if block % 32:
        # lanes 0..15 of the last warp: rows g and g + 8 (g = lane / 4 in 0..3), all 8 columns
        nan = torch.zeros(16, 8, dtype=torch.bool)
        nan[[0, 1, 2, 3, 8, 9, 10, 11]] = True
        assert out[full][nan].isnan().all()
        assert_same(out[full][~nan], d[full][~nan])


# ---- half precision ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype"), [("float16", torch.float16), ("bfloat16", torch.bfloat16)]
)
def test_half_conversions_round_like_torch(name: str, dtype: torch.dtype) -> None:
    special = torch.tensor([0.0, -0.0, 1.0 / 3, 65504.0, 65520.0, 1e-8, 6e-8, 3e38, 1e39])
    inf_nan = torch.tensor([float("inf"), float("nan")])
    x = torch.cat([special, -special, torch.randn(5000) * 100, inf_nan])
    assert_same(emu().round_trip(x, name), x.to(dtype).float())


# ---- AddressSanitizer --------------------------------------------------------------------------

TESTS_DIR = Path(__file__).resolve().parent


@pytest.mark.skipif(
    os.environ.get("RELPOS_EMU_ASAN") != "1",
    reason="needs the AddressSanitizer build of the emulator: run scripts/test_asan.sh",
)
@pytest.mark.parametrize(
    ("memory", "report"),
    [
        ("global", "heap-buffer-overflow"),
        ("shared", "global-buffer-overflow"),  # a static __shared__ array
        ("dynamic_shared", "heap-buffer-overflow"),
    ],
)
def test_out_of_bounds_read_is_caught_by_asan(memory: str, report: str) -> None:
    # In a child process, since AddressSanitizer ends the process that it catches.
    code = textwrap.dedent(
        f"""
        import sys
        import torch
        sys.path.insert(0, {str(TESTS_DIR)!r})
        from _emu import load_emu
        assert load_emu()
        torch.ops.relpos_emu_test.oob_read(torch.arange({OOB_BLOCK}.0), {memory!r})
        """
    )
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":halt_on_error=1"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode != 0, f"no AddressSanitizer report; stderr:\n{proc.stderr[-3000:]}"
    assert f"AddressSanitizer: {report}" in proc.stderr, proc.stderr[-3000:]
    assert "oob_read_kernel" in proc.stderr, proc.stderr[-3000:]
