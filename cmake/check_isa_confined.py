"""Fails when an object file holds VEX/EVEX instructions (AVX and up) outside the functions whose
demangled names contain one of the given namespaces.

rel_attention_f64.cpp compiles the scalar attention kernels with AVX2 by target pragmas: only
functions defined between the pragmas may use AVX2. A header that the kernels include for the
first time inside that region (an #include added to rel_attention_scalar.h but not to the list
included before the pragmas) would define its inline functions and templates with AVX2 as weak
symbols, which the linker may pick for the scalar path too. Built without LTO, so the object
holds machine code.
Usage: python check_isa_confined.py OBJDUMP OBJECT NAMESPACE [NAMESPACE ...]
"""

import re
import subprocess
import sys


def main() -> int:
    objdump, obj, *allowed = sys.argv[1:]
    dis = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", obj], check=True,
                         capture_output=True, text=True).stdout
    fn, bad, confined = None, {}, 0
    for line in dis.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            fn = m.group(1)
            continue
        parts = line.split("\t")
        if fn is None or len(parts) < 2:
            continue
        insn = parts[-1].strip()
        if not (insn.startswith("v") or "%ymm" in insn or "%zmm" in insn):
            continue
        if any(ns in fn for ns in allowed):
            confined += 1
        else:
            bad[fn] = bad.get(fn, 0) + 1
    if bad:
        lines = "\n".join(f"  {n} in {f}" for f, n in sorted(bad.items()))
        print(f"relpos_ext: {obj} has AVX instructions outside {allowed} (see the comment at the "
              f"top of csrc/cpu/rel_attention_f64.cpp):\n{lines}", file=sys.stderr)
        return 1
    if confined == 0:
        print(f"relpos_ext: {obj} has no AVX instructions in {allowed}: were the target pragmas "
              "dropped?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
