"""Pieces shared by the benchmark scripts: fresh-process measurement, timing, machine info, I/O.

Every measurement runs in its own process forked from the (idle) parent, which imports torch but
never runs a kernel: the child inherits no thread pool and no freed heap that could hide its peak.
Peak extra memory is the growth of the resident set over one call: the child allocates its inputs,
resets the kernel's peak-RSS counter (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0), makes
the call and reads ``VmHWM``. That counts every page the call touched, torch tensors and a
kernel's private scratch alike, outputs and gradients included. Where ``clear_refs`` is not
writable it falls back to the ``ru_maxrss`` delta, a lower bound (results say which). Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime as _dt
import json
import logging
import multiprocessing
import os
import platform
import random
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# torch.utils.benchmark imports cpp_extension, which warns about CUDA_HOME on CPU-only machines.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
import torch.utils.benchmark as tbench  # noqa: E402

import relpos_ext  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MiB, GiB = 2.0**20, 2.0**30


# --------------------------------------------------------------------------- /proc and the heap
def _proc_kib(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes(resettable: bool) -> int:
    """Peak RSS since the last :func:`reset_peak_rss` (or since start when not resettable)."""
    if resettable:
        return _proc_kib("/proc/self/status", "VmHWM") * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``), so a warm-up call's freed
    memory cannot be reused unseen by the measured call. A no-op where glibc is absent."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def call_peak_extra_mib(run: Callable[[], Any]) -> dict:
    """Peak RSS growth of one ``run()`` in this process, in MiB (``{"peak_extra_mib": ...}``)."""
    resettable = reset_peak_rss()
    base = peak_rss_bytes(resettable)
    out = run()
    peak = peak_rss_bytes(resettable)
    del out
    return {"peak_extra_mib": max(peak - base, 0) / MiB}


def in_spawned_child(fn: Callable[..., dict], *fn_args: Any) -> dict:
    """``fn(*fn_args)`` (a module-level function) in a fresh, spawned interpreter, or an error
    record. Spawned, not forked as :func:`in_child`: a child forked from a process whose OpenMP
    threads are up (after timings, or inside pytest) hangs in its first parallel region."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        try:
            return pool.apply(fn, fn_args)
        except Exception as e:  # noqa: BLE001  (report it in the table, keep going)
            return {"error": f"{type(e).__name__}: {e}"}


def check_platform(script: str) -> None:
    if not hasattr(os, "fork") or not os.path.exists("/proc/self/status"):
        sys.exit(f"{script} measures memory through /proc and fork(): run it on Linux")


# --------------------------------------------------------------------------- measuring
def measure_call(run: Callable[[], Any], args: argparse.Namespace, trim: bool = False) -> dict:
    """Peak extra memory of one ``run()``, then its median time; call in a fresh child.

    ``run`` must already be warmed up (lazy state loaded). With ``trim`` the freed heap is given
    back first (needed when the warm-up ran at the measured size, e.g. to compile). A first call
    slower than ``args.slow_s`` is timed by at most ``args.slow_reps`` further single calls, fewer
    where they would take more than ``args.rep_budget_s`` (at least one); faster calls by
    ``blocked_autorange(min_run_time=args.min_run_time)``.
    """
    if trim:
        trim_heap()
    resettable = reset_peak_rss()
    base = peak_rss_bytes(resettable)
    t0 = time.perf_counter()
    out = run()
    first_s = time.perf_counter() - t0
    peak = peak_rss_bytes(resettable)
    del out

    if first_s >= args.slow_s:
        # A few single calls, timed directly: the call above was the warm-up, and Timer.timeit
        # adds two warm-up calls per sample and blocked_autorange a block-size probe.
        reps = args.slow_reps
        if reps * first_s > args.rep_budget_s:
            reps = max(1, int(args.rep_budget_s // first_s))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    else:
        timer = tbench.Timer(stmt="run()", globals={"run": run}, num_threads=args.threads)
        times = list(timer.blocked_autorange(min_run_time=args.min_run_time).times)
    return {
        "time_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "times_ms": [t * 1e3 for t in times],
        "first_call_ms": first_s * 1e3,
        "peak_extra_bytes": max(peak - base, 0),
        "memory_method": "VmHWM after clear_refs" if resettable else "ru_maxrss delta (lower bound)",
    }


def in_child(fn: Callable[..., dict], *fn_args: Any) -> dict:
    """Run ``fn(*fn_args)`` in a forked child and return its (JSON) result or an error record.

    The parent only imports torch and never runs a kernel, so the child starts with no thread
    pool to inherit and with nothing freed in its heap that could hide its peak.
    """
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(rfd)
        try:
            res = fn(*fn_args)
        except BaseException as e:  # report, never fall back into the parent's code
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        with os.fdopen(wfd, "w") as w:
            json.dump(res, w)
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd) as r:
        data = r.read()
    _, status = os.waitpid(pid, 0)
    if data:
        return json.loads(data)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    why = f"killed by signal {sig}" + (" (out of memory?)" if sig == 9 else "") if sig else "no result"
    return {"error": why}


def measure_grid(
    measure: Callable[..., dict], args: argparse.Namespace, modes: tuple[str, ...],
    methods: tuple[str, ...], skip: Callable[[str, str, int], str | None], width: int = 18,
) -> list[dict]:
    """``measure(method, mode, length, args)`` in a forked child for every mode x L x method,
    ``methods[0]`` being ours: rows of ``time_ms``, ``peak_extra_mib``, ``skipped`` (``skip``'s
    reason, or None to measure), ``errors`` and ``over_fused`` (each method's time over ours),
    printed as a table per mode as they come."""
    ours, others = methods[0], methods[1:]
    rows = []
    for mode in modes:
        print(f"\n{mode}: time ms (peak extra MiB)")
        print(f"{'L':>5}" + "".join(f"{m:>{width}}" for m in methods) + "   " +
              " ".join(f"{m + '/' + ours:>12}" for m in others))
        for length in args.lengths:
            row = {"mode": mode, "L": length, "time_ms": {}, "peak_extra_mib": {}, "skipped": {}}
            for method in methods:
                why = skip(method, mode, length)
                if why is not None:
                    row["skipped"][method] = why
                    row["time_ms"][method] = None
                    continue
                res = in_child(measure, method, mode, length, args)
                row["time_ms"][method] = res.get("time_ms")
                row["peak_extra_mib"][method] = res.get("peak_extra_bytes", 0) / 2**20
                if "error" in res:
                    row.setdefault("errors", {})[method] = res["error"]
            t = row["time_ms"]
            row["over_fused"] = {m: t[m] / t[ours] if t[m] and t[ours] else None for m in others}

            def cell(m: str) -> str:
                if m in row["skipped"]:
                    return row["skipped"][m]
                return "error" if t[m] is None else f"{t[m]:.1f} ({row['peak_extra_mib'][m]:.0f})"

            print(f"{length:>5}" + "".join(f"{cell(m):>{width}}" for m in methods) + "   " +
                  " ".join(f"{r:>12.2f}" if r else f"{'-':>12}" for r in row["over_fused"].values()),
                  flush=True)
            rows.append(row)
    return rows


def error_cell(res: dict, width: int = 60) -> str:
    """The first line of a child's error, for a table cell."""
    return "error: " + res["error"].splitlines()[0][:width]


def time_rounds(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each call of each ``fns`` entry, the entries taking turns, ``rounds`` times
    after a round that warms up (so that drifts of the machine's speed touch them alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds + 1):  # round 0 warms up
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r > 0:
                times[name].append(time.perf_counter() - t0)
    return times


def time_interleaved(
    methods: dict[str, tuple[str | dict[str, str], Callable[[], torch.Tensor]]],
    env_var: str,
    grad: torch.Tensor,
    rounds: int,
) -> dict[str, dict[str, float]]:
    """Median seconds of each method's forward (under no_grad) and forward+backward (``grad``).

    ``methods`` maps a name to ``(value, fn)``: ``env_var`` is set to ``value`` around the calls of
    ``fn`` (a kernel choice read at every call, such as ``RELPOS_CPU_ISA``); a dict value sets
    several variables instead (``{"RELPOS_CPU_AMX": "0", ...}``), each method's own. The methods take
    turns call by call, ``rounds`` times after a round that warms up, so that drifts of the
    machine's speed touch them alike; each round in its own (seeded) random order, as a call
    can be slower right after another method's forward+backward (decoding calls of 0.6 ms, the
    same kernel under two names, differed by 15-30% when one always followed SDPA's).
    Every variable set is restored afterwards.
    """
    times: dict[str, dict[str, list[float]]] = {m: {"fwd": [], "fwdbwd": []} for m in methods}
    settings = {name: value if isinstance(value, dict) else {env_var: value}
                for name, (value, _) in methods.items()}
    names = {var for env in settings.values() for var in env}
    saved = {var: os.environ.get(var) for var in names}
    order, shuffle = list(methods), random.Random(0).shuffle
    try:
        for r in range(rounds + 1):  # round 0 warms up
            shuffle(order)
            for name in order:
                fn = methods[name][1]
                for var in names:  # a variable this method does not name takes its default
                    os.environ.pop(var, None)
                os.environ.update(settings[name])
                with torch.no_grad():
                    t0 = time.perf_counter()
                    fn()
                    t_fwd = time.perf_counter() - t0
                t0 = time.perf_counter()
                fn().backward(grad)
                t_fb = time.perf_counter() - t0
                if r > 0:
                    times[name]["fwd"].append(t_fwd)
                    times[name]["fwdbwd"].append(t_fb)
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
    return {m: {mode: statistics.median(ts) for mode, ts in modes.items()} for m, modes in times.items()}


# --------------------------------------------------------------------------- the machine
# CPU features that decide which kernel runs and how fast (cpu/isa.cpp), as /proc/cpuinfo names them
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_identity() -> dict:
    """The first CPU's model name, family and model numbers and :data:`CPU_FLAGS` present, from
    /proc/cpuinfo (empty where it cannot be read). The model name alone does not tell machines
    apart here: "AMD EPYC" was Zen 4 (family 25, 512-bit instructions as two 256-bit halves) on
    one and Zen 5 (family 26, full-width 512-bit FMA units, twice the float32 peak) on another."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block only
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {}
    flags = set(fields.get("flags", "").split())
    out: dict = {"cpu_flags": [fl for fl in CPU_FLAGS if fl in flags]}
    for key, name in (("model name", "cpu"), ("cpu family", "cpu_family"), ("model", "cpu_model")):
        if key in fields:
            out[name] = int(fields[key]) if fields[key].isdigit() else fields[key]
    return out


# Environment variables that cap the instruction set of ours and torch's kernels below what the CPU
# has. All four at AVX2 (benchmarks/README.md, "A machine without AVX-512") run everything as on a
# CPU with AVX2 and FMA only: ours (cpu/isa.cpp), ATen's vectorised kernels and inductor's code
# (FlexAttention, torch.compile), oneDNN and MKL (matmuls).
ISA_ENV = ("RELPOS_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def machine_info(threads: int) -> dict:
    """The machine (:func:`cpu_identity`), its load, memory and Python, and the instruction sets
    the kernels were allowed: ours (``relpos_cpu_kernel``, what ``RELPOS_CPU_ISA=auto`` or the
    variable picks), torch's (``torch_cpu_capability``) and the :data:`ISA_ENV` variables set."""
    ident = cpu_identity()
    cpu = ident.pop("cpu", None) or platform.processor()
    try:
        mem_gib = _proc_kib("/proc/meminfo", "MemTotal") / 2**20
    except (OSError, KeyError):
        mem_gib = None
    return {
        "cpu": cpu,
        "load_average_at_start": os.getloadavg(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "mem_total_gib": mem_gib,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "relpos_cpu_kernel": relpos_ext.build_info().get("cpu_kernel_in_use"),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_env": {k: os.environ[k] for k in ISA_ENV if k in os.environ},
    } | ident


def print_environment(threads: int) -> tuple[dict, dict]:
    """Print the build, the machine and a load warning; returns ``(build_info, machine_info)``."""
    info = relpos_ext.build_info()
    print(f"relpos_ext {info['version']}  torch {torch.__version__}  build_info={info}")
    mach = machine_info(threads)
    family = ""
    if "cpu_family" in mach:
        family = f" (family {mach['cpu_family']} model {mach.get('cpu_model')})"
    print(f"machine: {mach['cpu']}{family}, {mach['logical_cpus']} logical CPUs, "
          f"torch threads={threads}, {mach['mem_total_gib'] or 0:.0f} GiB RAM")
    capped = "".join(f" {k}={v}" for k, v in mach["isa_env"].items())
    print(f"kernels: ours {mach['relpos_cpu_kernel']}, torch {mach['torch_cpu_capability']}"
          + (f" (set:{capped})" if capped else ""))
    load1 = mach["load_average_at_start"][0]
    if load1 > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load1:.1f} on {os.cpu_count()} CPUs: other work is running, "
              "timings will be noisy and slow")
    return info, mach


# --------------------------------------------------------------------------- CLI and output
def add_common_args(
    p: argparse.ArgumentParser, default_out: Path, rep_budget_s: float = float("inf")
) -> None:
    """The options every benchmark takes: output, plotting, threads, timing, verbosity."""
    p.add_argument("--out", type=Path, default=default_out,
                   help="JSON path; the PNG goes beside it with a .png suffix")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--min-run-time", type=float, default=1.0,
                   help="blocked_autorange min_run_time in seconds for fast cases")
    p.add_argument("--slow-s", type=float, default=0.5,
                   help="a first call slower than this is timed by --slow-reps single calls")
    p.add_argument("--slow-reps", type=int, default=2)
    p.add_argument("--rep-budget-s", type=float, default=rep_budget_s,
                   help="time at most this many seconds of --slow-reps after the first call "
                        f"(at least one rep; default {rep_budget_s:g})")
    p.add_argument("-v", "--verbose", action="store_true", help="print each measurement as it ends")


def parse_rounds_args(argv: list[str] | None, doc: str, default_out: Path, lengths: list[int],
                      rounds: int) -> tuple[argparse.Namespace, list[int], int]:
    """The options of the scripts whose methods take turns for some rounds (time_rounds):
    ``(args, lengths, rounds)``, with ``--quick``'s L = 128 and 256 and 2 rounds applied.
    Sets torch's threads."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--rounds", type=int, default=rounds, help=f"timed rounds (default {rounds})")
    p.add_argument("--lengths", type=int, nargs="+", default=lengths)
    p.add_argument("--quick", action="store_true", help="L = 128 and 256, 2 rounds (a smoke test)")
    p.add_argument("--out", type=Path, default=default_out)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args, [128, 256] if args.quick else args.lengths, 2 if args.quick else args.rounds


def timestamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_json(doc: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


def loglog_axes(ax: Any, lengths: list[int], title: str) -> None:
    """Time-vs-L axes: log2 x with the measured lengths as ticks, log y, grid, legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("L (= Lq = Lk)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
