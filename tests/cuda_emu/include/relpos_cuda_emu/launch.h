// relpos_emu::launch, what relpos::cuda::launch (csrc/cuda/launch.cuh) calls in emulator mode:
// kernel<<<grid, block, smem_bytes>>>(args...) run on the CPU under the scheduler of runtime.h.
// Returns when the grid has finished (the emulator has no streams; launches are synchronous) and
// throws std::runtime_error on a launch CUDA would reject or a synchronisation error.
#pragma once

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "runtime.h"

namespace relpos_emu {

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem_bytes, Args&&... args) {
  static_assert(sizeof...(KArgs) == sizeof...(Args), "wrong number of kernel arguments");
  // Like CUDA's parameter buffer: the arguments are captured once, and every thread gets its own
  // by-value copies of them when it calls the kernel.
  const std::tuple<std::decay_t<KArgs>...> params(std::forward<Args>(args)...);
  auto body = [kernel, &params] { std::apply(kernel, params); };
  using Body = decltype(body);
  const detail::Kernel erased{[](const void* closure) { (*static_cast<const Body*>(closure))(); },
                              &body, reinterpret_cast<const void*>(kernel)};
  detail::run_grid(erased, grid, block, smem_bytes);
}

}  // namespace relpos_emu
