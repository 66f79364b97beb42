"""Where the CPU kernels get their threads (csrc/cpu/parallel.h).

Three sources, each making at::parallel_for's chunks: ``aten`` (at::parallel_for, on torch's
OpenMP threads in builds compiled with OpenMP), ``gomp`` (torch's OpenMP runtime reached at run
time through GOMP_parallel, for builds without OpenMP) and ``std`` (a std::thread per chunk).
``RELPOS_CPU_THREADS`` picks one per call. The gomp and std splits are compiled into every build,
so these tests check them in every build; ``test_rel_attention_cpu_results_do_not_depend_on_threads``
(test_attention.py) runs the kernels on each source. ``RELPOS_EXPECT_CPU_THREADS`` (set by the CI
scripts) names the default source the build under test must have.
"""

from __future__ import annotations

import os

import pytest
import torch

import relpos_ext
from relpos_ext import _C

SOURCES = ["gomp", "std"]


def expected_chunks(begin: int, end: int, grain: int, threads: int) -> list[tuple[int, int]]:
    """at::parallel_for's split on a team of `threads`."""
    if begin >= end:
        return []
    if end - begin <= grain or end - begin == 1 or threads <= 1:
        return [(begin, end)]
    n = min(threads, -(-(end - begin) // grain)) if grain > 0 else threads
    size = -(-(end - begin) // n)
    return [(b, min(end, b + size)) for b in range(begin, end, size)]


def team(source: str, threads: int) -> int:
    """gomp's team has torch's thread count, as at::parallel_for's; std's has `threads`."""
    return torch.get_num_threads() if source == "gomp" else threads


@pytest.fixture(params=SOURCES)
def source(request):
    if request.param == "gomp" and not _C._gomp_available():
        pytest.skip("no OpenMP runtime with GOMP_parallel in this process")
    return request.param


@pytest.fixture
def torch_threads():
    """Four torch threads for the test (the gomp team), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


def test_default_source(monkeypatch):
    monkeypatch.delenv("RELPOS_CPU_THREADS", raising=False)
    default = relpos_ext.build_info()["cpu_threads"]
    assert default in ("aten", "gomp", "std")
    expected = os.environ.get("RELPOS_EXPECT_CPU_THREADS")
    if expected:
        assert default == expected
    for name in ("aten", "std") + (("gomp",) if _C._gomp_available() else ()):
        monkeypatch.setenv("RELPOS_CPU_THREADS", name)
        assert relpos_ext.build_info()["cpu_threads"] == name


def test_bad_source(monkeypatch):
    monkeypatch.setenv("RELPOS_CPU_THREADS", "tbb")
    with pytest.raises(RuntimeError, match="RELPOS_CPU_THREADS must be one of auto, aten, gomp, std"):
        relpos_ext.rel_gather(torch.randn(5, 8), 3, 3, 2)


@pytest.mark.parametrize(
    "begin,end,grain,threads",
    [(0, 10, 1, 4), (3, 20, 1, 2), (0, 10, 4, 8), (0, 5, 1, 4), (0, 7, 100, 4), (0, 1, 1, 4),
     (0, 3, 0, 4), (0, 64, 1, 16)],
)
def test_split_one_thread_per_chunk(source, torch_threads, begin, end, grain, threads):
    """Contiguous chunks as at::parallel_for makes them, each on a thread of its own, the
    calling thread (0) taking the first."""
    chunks = _C._parallel_probe(source, begin, end, grain, threads)
    want = expected_chunks(begin, end, grain, team(source, threads))
    assert [(b, e) for b, e, _ in chunks] == want
    assert sorted(t for _, _, t in chunks) == list(range(len(want)))
    assert chunks[0][2] == 0


@pytest.mark.parametrize("threads", [1, 0, -3])
def test_one_thread_runs_serially(source, threads):
    """max_threads below 2 (torch.get_num_threads() == 1 for the kernels) splits nothing."""
    assert _C._parallel_probe(source, 2, 9, 1, threads) == [(2, 9, 0)]


def test_empty_range(source):
    assert _C._parallel_probe(source, 5, 5, 1, 4) == []
    assert _C._parallel_probe(source, 6, 5, 1, 4) == []


def test_exception_reaches_the_caller(source, torch_threads):
    """A chunk's exception is rethrown in the caller once every chunk has finished."""
    with pytest.raises(RuntimeError, match="chunk 2 failed"):
        _C._parallel_probe(source, 0, 8, 1, 4, throw_at=3)
    with pytest.raises(RuntimeError, match="chunk 0 failed"):  # the caller's own chunk
        _C._parallel_probe(source, 0, 8, 1, 4, throw_at=1)


def test_nested_split_runs_serially(source, torch_threads):
    """A split inside a chunk runs on the chunk's thread, whole (as at::parallel_for inside a
    parallel region)."""
    chunks = _C._parallel_probe(source, 0, 8, 1, 4, nested=True)
    assert [(b, e) for b, e, _ in chunks] == expected_chunks(0, 8, 1, 4)
    assert sorted(t for _, _, t in chunks) == [0, 1, 2, 3]
