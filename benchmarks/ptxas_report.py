"""Resource usage of every CUDA kernel, as ptxas reports it (DESIGN.md §4: zero spills is the bar).

Compiles each csrc/cuda/*.cu with nvcc for the target architectures (sm_80 and sm_90 by default;
no GPU and no torch headers needed) and records per kernel and architecture: registers, barriers,
spill stores and loads, stack frame, static shared memory and constant bank 0. Prints a table and
writes benchmarks/results/ptxas.json, sorted so that two commits' files diff cleanly.

    python benchmarks/ptxas_report.py
    python benchmarks/ptxas_report.py --arch 80 90 100 --out /tmp/ptxas.json csrc/cuda/skew.cu

Exits non-zero only when a file fails to compile; spills are reported, not fatal.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "ptxas.json"
# The flags of the extension's own CUDA build (CMakeLists.txt), plus ptxas' verbose report.
NVCC_FLAGS = ["-std=c++20", "-O3", "--expt-relaxed-constexpr", "-Xptxas", "-v"]
NVCC_FLAGS += ["-I", "csrc", "-I", "csrc/cuda"]

ENTRY_RE = re.compile(r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>sm_\w+)'")
PROPERTIES_RE = re.compile(r"Function properties for (?P<name>\S+)")
FRAME_RE = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, "
    r"(?P<loads>\d+) bytes spill loads"
)
USED_RE = re.compile(r"Used (?P<registers>\d+) registers")
BARRIERS_RE = re.compile(r"used (?P<barriers>\d+) barriers")
SMEM_RE = re.compile(r"(?P<smem>\d+) bytes smem")
CMEM_RE = re.compile(r"(?P<cmem>\d+) bytes cmem\[0\]")
ARCH_RE = re.compile(r"for '(?P<arch>sm_\w+)'")


@dataclass
class Function:
    """One function as compiled for one architecture. `kind` is "kernel" (an entry point) or
    "device" (a __device__ function ptxas kept out of line: only its frame is reported)."""

    file: str
    arch: str
    kind: str
    name: str
    mangled: str
    registers: int | None = None
    barriers: int | None = None
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    stack_frame_bytes: int = 0
    static_smem_bytes: int = 0
    cmem0_bytes: int | None = None


def find_nvcc(explicit: str | None) -> str:
    candidates = [explicit] if explicit else []
    if os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and Path(c).is_file():
            return c
    sys.exit("ptxas_report: nvcc not found (pass --nvcc or set CUDA_HOME)")


def parse_ptxas(file: str, log: str) -> list[Function]:
    """Parses `-Xptxas -v` output: per architecture, entry lines announce a kernel, "Function
    properties" lines (kernels and out-of-line device functions) precede their frame line, and a
    "Used N registers" line closes the kernel."""
    functions: dict[tuple[str, str], Function] = {}
    arch = ""
    kernel: Function | None = None
    frame_owner: Function | None = None
    for line in log.splitlines():
        if m := ENTRY_RE.search(line):
            arch = m["arch"]
            kernel = functions.setdefault(
                (arch, m["name"]), Function(file, arch, "kernel", m["name"], m["name"])
            )
        elif m := PROPERTIES_RE.search(line):
            name = m["name"]
            if (m_arch := ARCH_RE.search(line)) is not None:
                arch = m_arch["arch"]
            frame_owner = functions.setdefault(
                (arch, name), Function(file, arch, "device", name, name)
            )
        elif (m := FRAME_RE.search(line)) and frame_owner is not None:
            frame_owner.stack_frame_bytes = int(m["stack"])
            frame_owner.spill_store_bytes = int(m["stores"])
            frame_owner.spill_load_bytes = int(m["loads"])
            frame_owner = None
        elif (m := USED_RE.search(line)) and kernel is not None:
            kernel.registers = int(m["registers"])
            if b := BARRIERS_RE.search(line):
                kernel.barriers = int(b["barriers"])
            if s := SMEM_RE.search(line):
                kernel.static_smem_bytes = int(s["smem"])
            if c := CMEM_RE.search(line):
                kernel.cmem0_bytes = int(c["cmem"])
            kernel = None
    return list(functions.values())


def compile_file(nvcc: str, source: Path, archs: list[str]) -> tuple[Path, int, str]:
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    with tempfile.TemporaryDirectory(prefix="ptxas_report_") as tmp:
        cmd = [nvcc, *NVCC_FLAGS, *gencode, "-c", str(source), "-o", str(Path(tmp) / "out.o")]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    return source, proc.returncode, proc.stdout + proc.stderr


def demangle(names: list[str]) -> dict[str, str]:
    """Demangles all names with one c++filt process; names stay mangled without c++filt."""
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names) + "\n", capture_output=True, text=True)
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) != len(names):
        return {n: n for n in names}
    return dict(zip(names, lines))


def print_table(functions: list[Function]) -> None:
    headers = ["kernel", "arch", "regs", "spill st/ld", "stack", "smem", "cmem0"]
    rows = []
    for f in functions:
        name = f.name if len(f.name) <= 72 else f.name[:69] + "..."
        if f.kind == "device":
            name = f"  (device) {name}"
        rows.append(
            [
                name,
                f.arch,
                "-" if f.registers is None else str(f.registers),
                f"{f.spill_store_bytes}/{f.spill_load_bytes}",
                str(f.stack_frame_bytes),
                str(f.static_smem_bytes),
                "-" if f.cmem0_bytes is None else str(f.cmem0_bytes),
            ]
        )
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:  # the name left-aligned, numbers right-aligned
        first, *rest = zip(cells, widths)
        return "  ".join([first[0].ljust(first[1]), *(c.rjust(w) for c, w in rest)])

    print(line(headers))
    current_file = None
    for f, row in zip(functions, rows):
        if f.file != current_file:
            current_file = f.file
            print(f"-- {current_file}")
        print(line(row))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("sources", nargs="*", type=Path, help="default: csrc/cuda/*.cu")
    parser.add_argument(
        "--arch", nargs="+", default=["80", "90"], help="compute capabilities (default: 80 90)"
    )
    parser.add_argument(
        "--nvcc", help="nvcc to use (default: $CUDA_HOME/bin/nvcc, then PATH, /usr/local/cuda)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="JSON output (default: %(default)s)"
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="parallel nvcc processes"
    )
    args = parser.parse_args()

    nvcc = find_nvcc(args.nvcc)
    sources = [s.resolve() for s in args.sources]
    sources = sources or sorted((REPO_ROOT / "csrc" / "cuda").glob("*.cu"))
    if not sources:
        print("ptxas_report: no .cu files to compile", file=sys.stderr)
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda s: compile_file(nvcc, s, args.arch), sources))

    functions: list[Function] = []
    failed = []
    for source, returncode, log in results:
        label = str(source.relative_to(REPO_ROOT) if source.is_relative_to(REPO_ROOT) else source)
        if returncode != 0:
            failed.append(label)
            print(f"ptxas_report: {label} failed to compile:\n{log}", file=sys.stderr)
            continue
        functions += parse_ptxas(label, log)

    names = demangle(sorted({f.mangled for f in functions}))
    for f in functions:
        f.name = names[f.mangled]
    functions.sort(key=lambda f: (f.file, f.kind != "kernel", f.name, f.arch))

    print_table(functions)
    spills = [f for f in functions if f.spill_store_bytes or f.spill_load_bytes]
    kernels = sum(f.kind == "kernel" for f in functions)
    print(f"\n{kernels} kernel builds over {len(sources)} files for sm_{', sm_'.join(args.arch)}; "
          f"{len(spills)} with register spills")
    for f in spills:
        print(
            f"  SPILLS {f.arch} {f.name}: "
            f"{f.spill_store_bytes} B stored, {f.spill_load_bytes} B loaded"
        )

    if not failed:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "nvcc": next((v for v in version.splitlines() if "release" in v), version.strip()),
            "flags": NVCC_FLAGS,
            "archs": [f"sm_{a}" for a in args.arch],
            "spilling": len(spills),
            "functions": [asdict(f) for f in functions],
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
