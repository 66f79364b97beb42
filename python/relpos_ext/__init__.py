"""relpos_ext: fast, memory-lean relative-position attention ops for PyTorch.

Importing the package loads the compiled extension, which registers ``torch.ops.relpos.*``.
"""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (libtorch must be loaded before the extension)

from . import _C, hf, nn, positions, reference
from .ops import (
    rel_attention,
    rel_attention_backward,
    rel_gather,
    rel_gather_backward,
    rel_logits,
    rel_logits_backward,
    rope,
    skew,
    skew_backward,
)
from .positions import alibi_bias_table, alibi_slopes, t5_bias_table

__all__ = [
    "alibi_bias_table",
    "alibi_slopes",
    "build_info",
    "hf",
    "nn",
    "positions",
    "reference",
    "rel_attention",
    "rel_attention_backward",
    "rel_gather",
    "rel_gather_backward",
    "rel_logits",
    "rel_logits_backward",
    "rope",
    "skew",
    "skew_backward",
    "t5_bias_table",
]


def build_info() -> dict[str, Any]:
    """What this build contains.

    Returns a dict with ``version``, ``torch_version`` (torch it was built against),
    ``cpu_kernels`` (paths compiled in, e.g. ``["scalar", "avx2"]``), ``cpu_kernel_in_use`` (the
    path the dispatcher picks now, honouring ``RELPOS_CPU_ISA``), ``cpu_float64_attention`` (the
    kernel float64 ``rel_attention`` runs on now: ``"avx2"``, the scalar kernels compiled with
    AVX2 and FMA, on the vector paths of GCC and clang builds for x86; else ``"scalar"``),
    ``cpu_threads`` (where the CPU kernels' threads come from now, honouring
    ``RELPOS_CPU_THREADS``: ``"aten"``, at::parallel_for on torch's OpenMP threads in builds
    compiled with OpenMP; ``"gomp"``, the same threads reached at run time in builds without it;
    ``"std"``, a std::thread per chunk), ``cpu_bf16_dot`` (whether the AVX-512 attention kernels
    take bfloat16 inputs' matmuls by AVX512-BF16 dot products now: on CPUs that have them,
    unless ``RELPOS_CPU_BF16_DOT=0``), ``cpu_amx`` (whether those dot products run on AMX tiles
    now: on CPUs with AMX-BF16 whose OS grants the tile state, unless ``RELPOS_CPU_AMX=0``),
    ``cpu_bf16_dot_decode_only`` (whether only decoding calls take those dot products, at most
    32 query rows against at least 256 keys: on Intel CPUs whose dots do not run on AMX tiles,
    where they are slower than float32 matmuls otherwise, unless ``RELPOS_CPU_BF16_DOT=1``),
    ``cpu_wide_rows`` (rows per matmul block of the AVX-512
    attention kernels' 64-column strips: 6 on Intel CPUs, 4 on others, ``RELPOS_CPU_WIDE_ROWS``
    overriding; 0 on the other paths) and ``cuda_archs`` (e.g. ``["80", "90"]``, or ``None``
    when the CUDA kernels were not built).
    """
    return dict(_C.build_info())


__version__: str = build_info()["version"]
