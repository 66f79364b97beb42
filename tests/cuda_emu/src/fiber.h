// A fiber: a stack of its own and a cooperative context switch, one per emulated CUDA thread.
//
// On x86-64 the switch is a dozen instructions (fiber.cpp); elsewhere, or with
// -DRELPOS_EMU_UCONTEXT, it is ucontext's swapcontext, which costs two system calls per switch
// (about 0.6 us a round trip here). Each switch is announced to AddressSanitizer so that it
// tracks which stack is live and reports no false positives on the fiber stacks.
#pragma once

#include <cstddef>

#if !defined(__x86_64__) || defined(RELPOS_EMU_UCONTEXT)
#define RELPOS_EMU_FIBER_UCONTEXT 1
#include <ucontext.h>
#endif

namespace relpos_emu::detail {

class Fiber {
 public:
  using Entry = void (*)(void* arg);

  // Stacks are mmap'ed with a guard page below them, so an overflow faults instead of silently
  // corrupting the next fiber's stack.
  explicit Fiber(size_t stack_bytes);
  ~Fiber();
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;

  // The next resume() runs entry(arg) from the top of the stack; entry must not throw. A fiber is
  // started again (its stack reused) after entry has returned or before it first ran.
  void start(Entry entry, void* arg);

  // Called by the scheduler: runs the fiber until it suspends or its entry returns.
  void resume();

  // Called on the fiber itself: back to the scheduler, returning on the next resume().
  void suspend();

 private:
  static void trampoline();
  [[noreturn]] void finish();

  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  char* stack_lo_ = nullptr;
  size_t stack_bytes_ = 0;
  Entry entry_ = nullptr;
  void* arg_ = nullptr;
#if defined(RELPOS_EMU_FIBER_UCONTEXT)
  ucontext_t context_{};
  ucontext_t caller_context_{};
#else
  void* sp_ = nullptr;         // saved stack pointer of this fiber while it is suspended
  void* caller_sp_ = nullptr;  // the scheduler's, while this fiber runs
#endif
#if defined(__SANITIZE_ADDRESS__)
  void* fake_stack_ = nullptr;  // ASan's fake frames of this fiber while it is suspended
  const void* caller_stack_lo_ = nullptr;
  size_t caller_stack_bytes_ = 0;
#endif
};

// Default stack size: kernel threads need little stack, but AddressSanitizer's redzones and
// reports need more.
#if defined(__SANITIZE_ADDRESS__)
inline constexpr size_t kFiberStackBytes = 256 * 1024;
#else
inline constexpr size_t kFiberStackBytes = 64 * 1024;
#endif

}  // namespace relpos_emu::detail
