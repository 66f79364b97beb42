// Element types of the kernels and their arithmetic: float16 (__half) and bfloat16 (__nv_bfloat16)
// load and store through float32 accumulation, float32 stays float32, float64 stays float64
// (the emulator tests use it for exact comparisons).
#pragma once

#include "cuda/device.cuh"

namespace relpos::cuda {

// The accumulation type of an element type: float, or double for double.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Acc<T>::type;

RELPOS_DEVICE float to_float(float x) { return x; }
RELPOS_DEVICE double to_float(double x) { return x; }
RELPOS_DEVICE float to_float(__half x) { return __half2float(x); }
RELPOS_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// from_float<T>(x): round an accumulator to the element type (round to nearest even).
template <typename T>
RELPOS_DEVICE T from_float(acc_t<T> x) {
  return static_cast<T>(x);
}
template <>
RELPOS_DEVICE __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
RELPOS_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

}  // namespace relpos::cuda
