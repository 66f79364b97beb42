// Launchers of the emulator's test kernels: grid arithmetic and relpos::cuda::launch, as in
// csrc/cuda/*.cu.
#include "emu_test_kernels.cuh"

namespace relpos_emu_test {

namespace {

unsigned blocks_for(int64_t n, int block) { return static_cast<unsigned>((n + block - 1) / block); }

template <bool kBarrier>
void launch_reverse(const float* x, float* out, int64_t n) {
  relpos::cuda::launch(reverse_in_block_kernel<kBarrier>, dim3(blocks_for(n, kReverseBlock)),
                       dim3(kReverseBlock), 0, nullptr, x, out);
}

template <bool kBFloat16>
void launch_round_trip(const float* x, float* out, int64_t n) {
  constexpr int kBlock = 256;
  relpos::cuda::launch(round_trip_kernel<kBFloat16>, dim3(blocks_for(n, kBlock)), dim3(kBlock), 0,
                       nullptr, x, out, n);
}

template <OobMemory kMemory>
void launch_oob_read(const float* x, int64_t n, float* out) {
  relpos::cuda::launch(oob_read_kernel<kMemory>, dim3(1), dim3(kOobBlock),
                       kOobBlock * sizeof(float), nullptr, x, n, out);
}

template <Misuse kMisuse>
void launch_misuse(float* out, int block) {
  relpos::cuda::launch(misuse_kernel<kMisuse>, dim3(2), dim3(block), 0, nullptr, out);
}

}  // namespace

void reverse_in_block(const float* x, float* out, int64_t n, bool with_barrier) {
  if (with_barrier) {
    launch_reverse<true>(x, out, n);
  } else {
    launch_reverse<false>(x, out, n);
  }
}

void block_reduce(const float* x, int64_t n, int block, float* sums, int* positives, float* total) {
  relpos::cuda::launch(block_reduce_kernel<float>, dim3(blocks_for(n, block)), dim3(block),
                       block * sizeof(float), nullptr, x, n, sums, positives, total);
}

void index_map(int32_t* out, const int64_t grid[3], const int64_t block[3]) {
  const auto u = [](int64_t v) { return static_cast<unsigned>(v); };
  relpos::cuda::launch(index_map_kernel<int32_t>, dim3(u(grid[0]), u(grid[1]), u(grid[2])),
                       dim3(u(block[0]), u(block[1]), u(block[2])), 0, nullptr, out);
}

template <typename T>
void warp_test(const T* x, T* out, int64_t n, int block, WarpTest op, int width) {
  relpos::cuda::launch(warp_test_kernel<T>, dim3(blocks_for(n, block)), dim3(block), 0, nullptr,
                       x, out, op, width);
}

template void warp_test<float>(const float*, float*, int64_t, int, WarpTest, int);
template void warp_test<double>(const double*, double*, int64_t, int, WarpTest, int);
template void warp_test<int32_t>(const int32_t*, int32_t*, int64_t, int, WarpTest, int);
template void warp_test<int64_t>(const int64_t*, int64_t*, int64_t, int, WarpTest, int);

void round_trip(const float* x, float* out, int64_t n, bool bfloat16) {
  if (bfloat16) {
    launch_round_trip<true>(x, out, n);
  } else {
    launch_round_trip<false>(x, out, n);
  }
}

void mma_test(const uint16_t* a, const uint16_t* b, float* d, int block, bool bfloat16) {
  if (bfloat16) {
    relpos::cuda::launch(mma_test_kernel<__nv_bfloat16>, dim3(1), dim3(block), 0, nullptr, a, b, d);
  } else {
    relpos::cuda::launch(mma_test_kernel<__half>, dim3(1), dim3(block), 0, nullptr, a, b, d);
  }
}

void oob_read(const float* x, int64_t n, float* out, OobMemory memory) {
  switch (memory) {
    case OobMemory::kGlobal: return launch_oob_read<OobMemory::kGlobal>(x, n, out);
    case OobMemory::kStaticShared: return launch_oob_read<OobMemory::kStaticShared>(x, n, out);
    case OobMemory::kDynamicShared: return launch_oob_read<OobMemory::kDynamicShared>(x, n, out);
  }
}

void misuse(float* out, int block, Misuse kind) {
  switch (kind) {
    case Misuse::kEarlyExit: return launch_misuse<Misuse::kEarlyExit>(out, block);
    case Misuse::kTwoBarriers: return launch_misuse<Misuse::kTwoBarriers>(out, block);
    case Misuse::kWarpVsBlock: return launch_misuse<Misuse::kWarpVsBlock>(out, block);
    case Misuse::kMaskExcludesLane: return launch_misuse<Misuse::kMaskExcludesLane>(out, block);
    case Misuse::kBadWidth: return launch_misuse<Misuse::kBadWidth>(out, block);
    case Misuse::kMmaDivergent: return launch_misuse<Misuse::kMmaDivergent>(out, block);
  }
}

}  // namespace relpos_emu_test
