// Torch ops over the emulator's test kernels, in the `relpos_emu_test` namespace: what
// tests/test_cuda_emu.py calls (after tests/_emu.py loaded this library).
#include <torch/library.h>

#include <ATen/ATen.h>

#include <cstring>
#include <memory>
#include <string>

#include "emu_test_kernels.h"
#include "relpos_cuda_emu/runtime.h"

namespace relpos_emu_test {

namespace {

at::Tensor contiguous_cpu(const at::Tensor& x, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": expected a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == dtype, name, ": expected dtype ", dtype, ", got ",
              x.scalar_type());
  return x.contiguous();
}

void set_seed(int64_t seed) { relpos_emu::set_seed(seed); }

int64_t seed_override() { return relpos_emu::seed_override(); }

at::Tensor racy_reverse(const at::Tensor& x, bool with_barrier) {
  const at::Tensor in = contiguous_cpu(x, at::kFloat, "racy_reverse: x");
  TORCH_CHECK(in.numel() % kReverseBlock == 0, "racy_reverse: x.numel() must be a multiple of ",
              kReverseBlock, ", got ", in.numel());
  at::Tensor out = at::empty_like(in);
  reverse_in_block(in.data_ptr<float>(), out.data_ptr<float>(), in.numel(), with_barrier);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> block_reduce_op(const at::Tensor& x, int64_t block) {
  const at::Tensor in = contiguous_cpu(x, at::kFloat, "block_reduce: x");
  TORCH_CHECK(block >= 1 && block <= 1024 && (block & (block - 1)) == 0,
              "block_reduce: block must be a power of two in [1, 1024], got ", block);
  const int64_t blocks = (in.numel() + block - 1) / block;
  at::Tensor sums = at::empty({blocks}, in.options());
  at::Tensor positives = at::empty({blocks}, in.options().dtype(at::kInt));
  at::Tensor total = at::zeros({1}, in.options());
  block_reduce(in.data_ptr<float>(), in.numel(), static_cast<int>(block), sums.data_ptr<float>(),
               positives.data_ptr<int>(), total.data_ptr<float>());
  return {sums, positives, total};
}

at::Tensor index_map_op(at::IntArrayRef grid, at::IntArrayRef block) {
  TORCH_CHECK(grid.size() == 3 && block.size() == 3, "index_map: grid and block need 3 entries");
  at::Tensor out = at::full({grid[2], grid[1], grid[0], block[2], block[1], block[0], 6}, -1,
                            at::TensorOptions().dtype(at::kInt));
  index_map(out.data_ptr<int32_t>(), grid.data(), block.data());
  return out;
}

WarpTest parse_warp_test(const std::string& op) {
  if (op == "xor_sum") return WarpTest::kXorSum;
  if (op == "down_sum") return WarpTest::kDownSum;
  if (op == "up_scan") return WarpTest::kUpScan;
  if (op == "idx_rotate") return WarpTest::kIdxRotate;
  if (op == "ballot") return WarpTest::kBallot;
  if (op == "any") return WarpTest::kAny;
  if (op == "all") return WarpTest::kAll;
  TORCH_CHECK(false, "warp_test: op must be one of xor_sum, down_sum, up_scan, idx_rotate, ",
              "ballot, any, all; got '", op, "'");
}

at::Tensor warp_test_op(const at::Tensor& x, const std::string& op, int64_t block, int64_t width) {
  TORCH_CHECK(x.device().is_cpu(), "warp_test: x: expected a CPU tensor, got one on ", x.device());
  TORCH_CHECK(block >= 1 && block <= 1024, "warp_test: block must be in [1, 1024], got ", block);
  TORCH_CHECK(x.numel() % block == 0, "warp_test: x.numel() must be a multiple of block, got ",
              x.numel(), " and ", block);
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  const WarpTest test = parse_warp_test(op);
  const int b = static_cast<int>(block);
  const int w = static_cast<int>(width);
  switch (in.scalar_type()) {
    case at::kFloat:
      warp_test(in.data_ptr<float>(), out.data_ptr<float>(), in.numel(), b, test, w);
      break;
    case at::kDouble:
      warp_test(in.data_ptr<double>(), out.data_ptr<double>(), in.numel(), b, test, w);
      break;
    case at::kInt:
      warp_test(in.data_ptr<int32_t>(), out.data_ptr<int32_t>(), in.numel(), b, test, w);
      break;
    case at::kLong:
      warp_test(in.data_ptr<int64_t>(), out.data_ptr<int64_t>(), in.numel(), b, test, w);
      break;
    default:
      TORCH_CHECK(false, "warp_test: x: expected float32, float64, int32 or int64, got ",
                  in.scalar_type());
  }
  return out;
}

at::Tensor round_trip_op(const at::Tensor& x, const std::string& dtype) {
  TORCH_CHECK(dtype == "float16" || dtype == "bfloat16",
              "round_trip: dtype must be 'float16' or 'bfloat16', got '", dtype, "'");
  const at::Tensor in = contiguous_cpu(x, at::kFloat, "round_trip: x");
  at::Tensor out = at::empty_like(in);
  round_trip(in.data_ptr<float>(), out.data_ptr<float>(), in.numel(), dtype == "bfloat16");
  return out;
}

// d + a b per warp of one block of `block` threads (mma_test); a [warps, 16, 16] and b
// [warps, 16, 8] float16 or bfloat16, d [warps, 16, 8] float32, warps = ceil(block / 32).
at::Tensor mma_test_op(const at::Tensor& a, const at::Tensor& b, const at::Tensor& d,
                       int64_t block) {
  const at::ScalarType dtype = a.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "mma_test: a must be float16 or bfloat16, got ", dtype);
  TORCH_CHECK(block >= 1 && block <= 1024, "mma_test: block must be in [1, 1024], got ", block);
  const int64_t warps = (block + 31) / 32;
  const at::Tensor ai = contiguous_cpu(a, dtype, "mma_test: a");
  const at::Tensor bi = contiguous_cpu(b, dtype, "mma_test: b");
  at::Tensor out = contiguous_cpu(d, at::kFloat, "mma_test: d").clone();
  TORCH_CHECK(ai.sizes() == at::IntArrayRef({warps, 16, 16}) &&
                  bi.sizes() == at::IntArrayRef({warps, 16, 8}) &&
                  out.sizes() == at::IntArrayRef({warps, 16, 8}),
              "mma_test: expected a [", warps, ", 16, 16], b and d [", warps, ", 16, 8], got ",
              ai.sizes(), ", ", bi.sizes(), ", ", out.sizes());
  mma_test(static_cast<const uint16_t*>(ai.const_data_ptr()),
           static_cast<const uint16_t*>(bi.const_data_ptr()), out.data_ptr<float>(),
           static_cast<int>(block), dtype == at::kBFloat16);
  return out;
}

at::Tensor oob_read_op(const at::Tensor& x, const std::string& memory) {
  const at::Tensor in = contiguous_cpu(x, at::kFloat, "oob_read: x");
  const int64_t n = in.numel();
  TORCH_CHECK(n >= kOobBlock, "oob_read: x needs at least ", kOobBlock, " elements, got ", n);
  OobMemory where;
  if (memory == "global") {
    where = OobMemory::kGlobal;
  } else if (memory == "shared") {
    where = OobMemory::kStaticShared;
  } else if (memory == "dynamic_shared") {
    where = OobMemory::kDynamicShared;
  } else {
    TORCH_CHECK(false, "oob_read: memory must be 'global', 'shared' or 'dynamic_shared', got '",
                memory, "'");
  }
  // A heap block of exactly n floats, so that AddressSanitizer's redzone starts right after it.
  const std::unique_ptr<float[]> exact(new float[n]);
  std::memcpy(exact.get(), in.data_ptr<float>(), n * sizeof(float));
  at::Tensor out = at::empty({kOobBlock}, in.options());
  oob_read(exact.get(), n, out.data_ptr<float>(), where);
  return out;
}

at::Tensor misuse_op(const std::string& kind, int64_t block) {
  Misuse m;
  if (kind == "early_exit") {
    m = Misuse::kEarlyExit;
  } else if (kind == "two_barriers") {
    m = Misuse::kTwoBarriers;
  } else if (kind == "warp_vs_block") {
    m = Misuse::kWarpVsBlock;
  } else if (kind == "mask_excludes_lane") {
    m = Misuse::kMaskExcludesLane;
  } else if (kind == "bad_width") {
    m = Misuse::kBadWidth;
  } else if (kind == "mma_divergent") {
    m = Misuse::kMmaDivergent;
  } else {
    TORCH_CHECK(false, "misuse: kind must be early_exit, two_barriers, warp_vs_block, ",
                "mask_excludes_lane, bad_width or mma_divergent, got '", kind, "'");
  }
  at::Tensor out = at::zeros({block}, at::TensorOptions().dtype(at::kFloat));
  misuse(out.data_ptr<float>(), static_cast<int>(block), m);
  return out;
}

}  // namespace
}  // namespace relpos_emu_test

TORCH_LIBRARY(relpos_emu_test, m) {
  using namespace relpos_emu_test;
  m.def("set_seed(int seed) -> ()", &set_seed);
  m.def("seed_override() -> int", &seed_override);
  m.def("racy_reverse(Tensor x, bool with_barrier) -> Tensor", &racy_reverse);
  m.def("block_reduce(Tensor x, int block) -> (Tensor, Tensor, Tensor)", &block_reduce_op);
  m.def("index_map(int[3] grid, int[3] block) -> Tensor", &index_map_op);
  m.def("warp_test(Tensor x, str op, int block, int width=32) -> Tensor", &warp_test_op);
  m.def("round_trip(Tensor x, str dtype) -> Tensor", &round_trip_op);
  m.def("oob_read(Tensor x, str memory=\"global\") -> Tensor", &oob_read_op);
  m.def("misuse(str kind, int block=64) -> Tensor", &misuse_op);
  m.def("mma_test(Tensor a, Tensor b, Tensor d, int block) -> Tensor", &mma_test_op);
}
