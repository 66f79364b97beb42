"""Access to the CUDA emulator (tests/cuda_emu) for tests of the ``cuda-emu`` backend.

The emulator is a shared library built by ``scripts/build_cuda_emu.sh``. Loading it registers
``torch.ops.relpos_emu.*`` (the CUDA kernels of csrc/cuda run on the CPU, with the signatures of
the ``relpos`` ops) and ``torch.ops.relpos_emu_test.*`` (the emulator's own tests and seed).

Environment:
  RELPOS_CUDA_EMU_LIB      the library to load
                           (default ``<repo>/build/cuda_emu/librelpos_cuda_emu.so``)
  RELPOS_REQUIRE_CUDA_EMU  ``1``: a missing library is an error, not a skip (CI)
  RELPOS_EMU_SEED          the default seed of the emulator's schedule, read at every launch
                           (default 0); ``emu_seed`` overrides it
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LIBRARY = REPO_ROOT / "build" / "cuda_emu" / "librelpos_cuda_emu.so"
SKIP_REASON = (
    "CUDA emulator not built: run scripts/build_cuda_emu.sh "
    "(set RELPOS_REQUIRE_CUDA_EMU=1 to make this an error)"
)


def emu_library_path() -> Path:
    """Where ``load_emu`` looks for the emulator library."""
    return Path(os.environ.get("RELPOS_CUDA_EMU_LIB", str(DEFAULT_LIBRARY)))


@functools.cache
def load_emu() -> bool:
    """Loads the emulator library once; False if it was not built (unless it is required)."""
    path = emu_library_path()
    if not path.is_file():
        if os.environ.get("RELPOS_REQUIRE_CUDA_EMU") == "1":
            raise FileNotFoundError(
                f"RELPOS_REQUIRE_CUDA_EMU=1 but the CUDA emulator library {path} does not exist; "
                "build it with scripts/build_cuda_emu.sh"
            )
        return False
    torch.ops.load_library(str(path))
    return True


@contextlib.contextmanager
def emu_seed(seed: int) -> Iterator[None]:
    """Runs the enclosed launches with the emulator's schedule seeded by ``seed`` (>= 0).

    The same seed gives the same block order and thread interleaving, hence the same results;
    different seeds give different ones, which is how a missing ``__syncthreads()`` shows.
    """
    if seed < 0:
        raise ValueError(f"emu_seed: seed must be >= 0, got {seed}")
    ops = torch.ops.relpos_emu_test
    previous = ops.seed_override()
    ops.set_seed(seed)
    try:
        yield
    finally:
        ops.set_seed(previous)
