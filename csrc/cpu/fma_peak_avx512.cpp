// fma_spin (fma_peak_avx2.cpp) compiled again with AVX-512 flags into namespace avx512: 16-lane
// FMAs, the FMA throughput of one core where the AVX-512 kernels run (fma_peak.cpp picks it then).
#define RELPOS_ISA avx512
#include "cpu/fma_peak_avx2.cpp"
