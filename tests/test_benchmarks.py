"""The benchmarks' verdict logic (benchmarks/bench_attention.py), with the timings stubbed: which
methods the interleaved rounds time, in which order, and how the verdicts take their medians;
the quick modes of a few benchmarks (and bench_overhead.py at two rounds); and
benchmarks/ptxas_report.py's parsing and failure path, with nvcc stubbed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench = pytest.importorskip("bench_attention")

L = bench.TARGET_L
# the table's times, ms: the forward's best baseline is (4) compiled; ours takes 1.6x SDPA's
# time in the table (a slow spell), about as long as SDPA in the rounds below
TABLE = {("fwd", "ours"): 80.0, ("fwd", "eager"): 400.0, ("fwd", "compiled"): 300.0,
         ("fwd", "flex"): 350.0, ("fwd", "sdpa"): 50.0,
         ("fwd+bwd", "ours"): 200.0, ("fwd+bwd", "eager"): 800.0, ("fwd+bwd", "compiled"): 600.0,
         ("fwd+bwd", "sdpa"): 210.0}
ROUNDS = {("fwd", "ours"): [52.0, 55.0, 50.0], ("fwd", "compiled"): [310.0, 280.0, 300.0],
          ("fwd", "sdpa"): [53.0, 54.0, 52.0], ("fwd+bwd", "ours"): [190.0, 195.0, 205.0],
          ("fwd+bwd", "eager"): [790.0, 820.0, 800.0]}


@pytest.fixture
def rounds(monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list]:
    rows = [bench.Row(L, mode, method, ms) for (mode, method), ms in TABLE.items()]
    calls: list[tuple[str, str]] = []
    left = {k: list(v) for k, v in ROUNDS.items()}

    def fake_in_child(fn, method, mode, length, max_distance, args):
        assert fn is bench.measure and length == L
        calls.append((mode, method))
        return {"time_ms": left[(mode, method)].pop(0)}

    monkeypatch.setattr(bench, "in_child", fake_in_child)
    out = bench.target_rounds(rows, argparse.Namespace(rounds=3, max_distance=64))
    return out, calls, rows


def test_rounds_time_each_target_baseline_in_turn(rounds) -> None:
    out, calls, _ = rounds
    assert calls == [
        ("fwd", "compiled"), ("fwd", "sdpa"), ("fwd", "ours"),  # baselines first
        ("fwd", "ours"), ("fwd", "sdpa"), ("fwd", "compiled"),  # then ours first
        ("fwd", "compiled"), ("fwd", "sdpa"), ("fwd", "ours"),
        ("fwd+bwd", "eager"), ("fwd+bwd", "ours"),
        ("fwd+bwd", "ours"), ("fwd+bwd", "eager"),
        ("fwd+bwd", "eager"), ("fwd+bwd", "ours")]
    assert {k: v["baseline"] for k, v in out.items()} == {
        "fwd": "compiled", "fwd/sdpa": "sdpa", "fwd+bwd": "eager"}
    # the table's pair first; both forward targets pair the same timing of ours
    assert out["fwd"]["pairs"] == [[80.0, 300.0], [52.0, 310.0], [55.0, 280.0], [50.0, 300.0]]
    assert out["fwd/sdpa"]["pairs"] == [[80.0, 50.0], [52.0, 53.0], [55.0, 54.0], [50.0, 52.0]]
    assert out["fwd+bwd"]["pairs"] == [[200.0, 800.0], [190.0, 790.0], [195.0, 820.0],
                                       [205.0, 800.0]]


def test_verdicts_take_the_median_of_the_pairs(rounds) -> None:
    out, _, rows = rounds
    got = {v["target"]: v for v in bench.target_verdicts(rows, None, out, 64)}
    sdpa = got[f"fwd L={L}: ours / (6) SDPA time"]
    # ours / SDPA over the pairs: 1.6, 0.98, 1.02, 0.96 -> median 1.0; the table's pair alone fails
    assert sdpa["value"] == pytest.approx((52 / 53 + 55 / 54) / 2)
    assert sdpa["verdict"] == "PASS" and "median of 4 paired timings" in sdpa["detail"]
    fwd = got[f"fwd L={L}: best of (3)/(4)/(5) / ours"]
    assert fwd["value"] == pytest.approx((280 / 55 + 310 / 52) / 2)  # 3.75, 5.96, 5.09, 6.0
    assert fwd["verdict"] == "PASS"
    bwd = got[f"fwd+bwd L={L}: (3) eager / ours"]
    assert bwd["value"] == pytest.approx((4.0 + 790 / 190) / 2)  # 4.0, 4.16, 4.21, 3.90
    # without rounds: the table's pair alone
    alone = {v["target"]: v for v in bench.target_verdicts(rows, None, {}, 64)}
    assert alone[f"fwd L={L}: ours / (6) SDPA time"]["value"] == pytest.approx(1.6)
    assert alone[f"fwd L={L}: ours / (6) SDPA time"]["verdict"] == "FAIL"


def test_bench_per_sample_quick(tmp_path: Path) -> None:
    """bench_per_sample.py --quick runs its three methods and writes one row each."""
    per_sample = pytest.importorskip("bench_per_sample")
    out = tmp_path / "per_sample.json"
    assert per_sample.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == list(per_sample.METHODS)
    assert all(r["time_ms"] > 0 for r in rows) and rows[0]["ratio_vs_fold"] == 1.0


def test_bench_jvp_quick(tmp_path: Path) -> None:
    """bench_jvp.py --quick times its three methods and measures the jvp's memory."""
    jvp = pytest.importorskip("bench_jvp")
    out = tmp_path / "jvp.json"
    assert jvp.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == 2 * list(jvp.METHODS)
    assert all(r["time_ms"] > 0 for r in rows)
    assert all(r["peak_extra_mib"] >= 0 for r in rows if r["method"] == "jvp")


def test_bench_second_order_quick(tmp_path: Path) -> None:
    """bench_second_order.py --quick times its three methods and measures the penalties'
    memory."""
    second = pytest.importorskip("bench_second_order")
    out = tmp_path / "second_order.json"
    assert second.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == 2 * list(second.METHODS)
    assert all(r["time_ms"] > 0 for r in rows)
    assert all(r["peak_extra_mib"] >= 0 for r in rows if r["method"] != "fwd_bwd")


def test_bench_kv_cache_window_adds_the_sliding_cache(tmp_path: Path) -> None:
    """bench_kv_cache.py --window times the sliding cache besides the buffer and torch.cat; its
    buffer holds a couple of windows, not the T cached positions."""
    kv = pytest.importorskip("bench_kv_cache")
    out = tmp_path / "kv.json"
    assert kv.main(["--window", "16", "--lk", "200", "--min-run-time", "0.05", "--threads", "1",
                    "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["buffer", "cat", "sliding"]
    assert all(r["time_us"] > 0 for r in rows)
    assert [r["capacity"] for r in rows] == [400, 201, 30]


def test_bench_overhead_runs_both_routes(tmp_path: Path) -> None:
    """bench_overhead.py times every case's three kinds of call, by both routes where the op
    has them (SDPA has only one)."""
    overhead = pytest.importorskip("bench_overhead")
    out = tmp_path / "overhead.json"
    assert overhead.main(["--rounds", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * len(overhead.cases())
    for r in rows:
        assert r["wrapper_us"] > 0
        assert ("torch.ops_us" in r) == (not r["case"].startswith("SDPA"))


def test_machine_info_records_the_instruction_set_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    """machine_info keeps the kernels in use and the ISA_ENV variables that capped them (README,
    "A machine without AVX-512"): RELPOS_CPU_ISA is read at every call, so setting it here
    changes the kernel recorded; torch's capability was fixed when torch loaded."""
    import _common  # benchmarks/_common.py, on the path above
    import torch

    import relpos_ext

    for name in _common.ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELPOS_CPU_ISA", "scalar")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    info = _common.machine_info(1)
    assert info["relpos_cpu_kernel"] == "scalar"
    assert info["relpos_cpu_kernel"] == relpos_ext.build_info()["cpu_kernel_in_use"]
    assert info["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["isa_env"] == {"RELPOS_CPU_ISA": "scalar", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


ptxas = pytest.importorskip("ptxas_report")

# What `nvcc -Xptxas -v` prints for one kernel on one architecture (the lines the parser reads).
PTXAS_LOG = """\
ptxas info    : Compiling entry function '_Z6kernelv' for 'sm_90'
ptxas info    : Function properties for _Z6kernelv
    24 bytes stack frame, 40 bytes spill stores, 64 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 712 bytes cmem[0]
"""


def test_ptxas_report_parses_registers_and_spills() -> None:
    (f,) = ptxas.parse_ptxas("csrc/cuda/x.cu", PTXAS_LOG)
    assert (f.arch, f.kind, f.registers, f.barriers, f.cmem0_bytes) == ("sm_90", "kernel", 255, 1,
                                                                         712)
    assert (f.stack_frame_bytes, f.spill_store_bytes, f.spill_load_bytes) == (24, 40, 64)


def test_ptxas_report_a_failed_compile_exits_1_and_writes_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    """Every file failing leaves no function to tabulate: the table is its header (it raised on
    an empty list once), the exit status 1, and the JSON is not written."""
    out = tmp_path / "ptxas.json"

    def fake_run(cmd, **kwargs):
        return argparse.Namespace(stdout="Cuda compilation tools, release 13.0", returncode=0)

    monkeypatch.setattr(ptxas, "find_nvcc", lambda explicit: "nvcc")
    monkeypatch.setattr(ptxas.subprocess, "run", fake_run)
    monkeypatch.setattr(ptxas, "compile_file",
                        lambda nvcc, source, archs: (source, 2, "error: expected a ';'"))
    monkeypatch.setattr(sys, "argv", ["ptxas_report.py", "--out", str(out), "csrc/cuda/skew.cu"])
    assert ptxas.main() == 1
    captured = capsys.readouterr()
    assert "failed to compile" in captured.err and "expected a ';'" in captured.err
    assert "0 kernel builds" in captured.out
    assert not out.exists()
