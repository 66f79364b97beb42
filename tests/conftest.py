"""Shared test machinery: the backends every op suite is parametrised over, and the tolerances.

Backends:
  cpu-scalar  torch.ops.relpos on CPU tensors with RELPOS_CPU_ISA=scalar
  cpu-avx2    torch.ops.relpos on CPU tensors with RELPOS_CPU_ISA=avx2
  cpu-avx512  the same with RELPOS_CPU_ISA=avx512 (the AVX-512 builds of the attention and
              rel_logits kernels; only on CPUs with AVX-512, and only in the tests of those ops:
              the others run their AVX2 kernels there)
  cuda-emu    the CUDA kernels run by the CPU emulator: torch.ops.relpos_emu on CPU tensors
  cuda        torch.ops.relpos on CUDA tensors (only where a GPU exists)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import relpos_ext

sys.path.insert(0, str(Path(__file__).parent))
from _emu import load_emu  # noqa: E402

BACKENDS = ["cpu-scalar", "cpu-avx2", "cpu-avx512", "cuda-emu", "cuda"]

# Absolute/relative tolerance per dtype, for results compared with a float64 reference computed
# from the same (already rounded) inputs. Data movement ops are compared exactly instead.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """Compare with the per-dtype tolerance; `scale` widens it for long reductions."""
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == dtype, f"dtype {actual.dtype} != {dtype}"
    torch.testing.assert_close(
        actual.double().cpu(), expected.double().cpu(), atol=atol * scale, rtol=rtol * scale
    )


@dataclass
class Backend:
    name: str
    device: str
    namespace: str  # torch.ops.<namespace>

    def op(self, name: str):
        return getattr(getattr(torch.ops, self.namespace), name).default

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)


def _avx2_available() -> bool:
    info = relpos_ext.build_info()
    return "avx2" in info["cpu_kernels"]


def skip_unless_avx512(monkeypatch) -> None:
    """Skip unless the AVX-512 kernels are built and this CPU runs them (the default path picks
    them exactly then)."""
    monkeypatch.delenv("RELPOS_CPU_ISA", raising=False)
    if relpos_ext.build_info()["cpu_kernel_in_use"] != "avx512":
        pytest.skip("no AVX-512 kernels on this build/CPU")


def skip_unless_bf16_dot(monkeypatch) -> None:
    """skip_unless_avx512, and skip unless this CPU has AVX512-BF16 (the attention kernels'
    bfloat16 dot products, cpu/isa.h bf16_dot_enabled); RELPOS_CPU_BF16_DOT=1, so that every
    call takes them (Intel CPUs without AMX tiles take them only when decoding by default,
    build_info()["cpu_bf16_dot_decode_only"])."""
    skip_unless_avx512(monkeypatch)
    monkeypatch.setenv("RELPOS_CPU_BF16_DOT", "1")
    if not relpos_ext.build_info()["cpu_bf16_dot"]:
        pytest.skip("no AVX512-BF16 on this CPU")


def skip_unless_amx(monkeypatch) -> None:
    """skip_unless_bf16_dot, and skip unless those dots run on AMX tiles here (cpu/isa.h
    amx_enabled: AMX-TILE and AMX-BF16, the build's AMX code, the OS's grant)."""
    skip_unless_bf16_dot(monkeypatch)
    monkeypatch.delenv("RELPOS_CPU_AMX", raising=False)
    if not relpos_ext.build_info()["cpu_amx"]:
        pytest.skip("no AMX tiles on this CPU/OS/build")


def assert_concurrent_calls_match(monkeypatch, source: str, jobs) -> None:
    """Run each of `jobs` (callables returning a tuple of tensors or None) alone, then all of them
    twice over from 8 Python threads at once (the ops release the GIL, so the calls overlap), each
    on two torch threads from the CPU thread source `source` (RELPOS_CPU_THREADS): every
    concurrent call must give bitwise what it gave alone."""
    from concurrent.futures import ThreadPoolExecutor

    if source == "gomp" and not relpos_ext._C._gomp_available():
        pytest.skip("no OpenMP runtime with GOMP_parallel in this process")
    monkeypatch.setenv("RELPOS_CPU_THREADS", source)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = [job() for job in jobs]
        with ThreadPoolExecutor(max_workers=8) as pool:
            got = list(pool.map(lambda job: job(), jobs + jobs))
    finally:
        torch.set_num_threads(before)
    for results, expected in zip(got, want + want):
        for a, b in zip(results, expected):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def cpu_isa(request, monkeypatch) -> str:
    """Each CPU kernel path (RELPOS_CPU_ISA) for tests of what sits above the kernels."""
    if request.param == "avx2" and not _avx2_available():
        pytest.skip("AVX2 kernels not built")
    if request.param == "avx512":
        skip_unless_avx512(monkeypatch)
    monkeypatch.setenv("RELPOS_CPU_ISA", request.param)
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> Backend:
    name = request.param
    if name == "cpu-scalar":
        monkeypatch.setenv("RELPOS_CPU_ISA", "scalar")
        return Backend(name, "cpu", "relpos")
    if name == "cpu-avx2":
        if not _avx2_available():
            pytest.skip("AVX2 kernels not built (non-x86 build)")
        monkeypatch.setenv("RELPOS_CPU_ISA", "avx2")
        params = getattr(request.node, "callspec", None)
        if (params is not None and params.params.get("dtype") == torch.float64
                and relpos_ext.build_info()["cpu_float64_attention"] != "avx2"):
            pytest.skip("no AVX2 build of the float64 attention kernels (GCC and clang builds for x86 only)")
        return Backend(name, "cpu", "relpos")
    if name == "cpu-avx512":
        skip_unless_avx512(monkeypatch)
        monkeypatch.setenv("RELPOS_CPU_ISA", "avx512")
        return Backend(name, "cpu", "relpos")
    if name == "cuda-emu":
        if not load_emu():
            pytest.skip("CUDA emulator library not built (bash scripts/build_cuda_emu.sh)")
        return Backend(name, "cpu", "relpos_emu")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if relpos_ext.build_info()["cuda_archs"] is None:
        pytest.fail("a CUDA device is present but relpos_ext was built without CUDA kernels")
    return Backend(name, "cuda", "relpos")


# Attention cases (tests/test_attention.py CASES) sized for the AVX2 kernels' key runs and key
# chunks: 1100 to 4200 keys. The CUDA kernels have no such paths; there these cases only run more
# key tiles of the kinds the smaller cases have. Under AddressSanitizer they run on cuda-emu in
# test_rel_attention_forward and test_rel_attention_backward only: in the other attention tests
# (bias, rel_q, masks, dropout, windows, ...) they were half of that step's time. The main run
# keeps every one of them on every backend.
ASAN_FORWARD_BACKWARD_ONLY = frozenset({"bwd_key_runs", "decode_long_cache", "decode_split_keys",
                                        "decode_split_hidden_chunk", "decode_split_uniform"})


def pytest_collection_modifyitems(config, items):
    # Everything parametrised with the cuda-emu backend runs the emulator: mark it so that
    # `pytest -m emu` (the AddressSanitizer step) selects exactly those tests. float64 on the
    # vector backends would run the scalar kernels again (the vector kernels have no float64
    # path): deselect, except on cpu-avx2 in the attention tests, where float64 runs the AVX2/FMA
    # build of the scalar attention kernels (rel_attention_f64.cpp); cpu-avx512 runs that build
    # too. cpu-avx512 is deselected as well outside the tests of the ops it has kernels for (the
    # attention tests and the rel_logits ones), where it would run the AVX2 kernels again.
    # Under AddressSanitizer (scripts/test_asan.sh), cuda-emu's float16 cases are deselected:
    # they run the bfloat16 cases' kernels and memory accesses (2-byte elements, the same tiles
    # and tensor-core paths), and were a third of that step's time; the main run keeps them.
    # So are the attention cases of ASAN_FORWARD_BACKWARD_ONLY outside the plain forward and
    # backward tests (see there).
    asan = os.environ.get("RELPOS_EMU_ASAN") == "1"
    keep, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        backend = params.get("backend")
        attention = item.path.name == "test_attention.py"
        avx512_op = attention or "rel_logits" in item.name
        f64 = params.get("dtype") == torch.float64
        asan_emu = asan and backend == "cuda-emu"
        if (f64 and backend == "cpu-avx512") or (f64 and backend == "cpu-avx2" and not attention) or (
                backend == "cpu-avx512" and not avx512_op) or (
                asan_emu and params.get("dtype") == torch.float16) or (
                asan_emu and attention and params.get("name") in ASAN_FORWARD_BACKWARD_ONLY
                and item.originalname not in ("test_rel_attention_forward",
                                              "test_rel_attention_backward")):
            dropped.append(item)
            continue
        if params.get("backend") == "cuda-emu":
            item.add_marker(pytest.mark.emu)
        keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
