#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

namespace relpos_emu::detail {

namespace {

// The fiber that resume() is entering; trampoline() reads it to find itself. Fibers never migrate
// between OS threads and the emulator runs one grid at a time, so a plain global suffices.
Fiber* g_entering = nullptr;

size_t page_bytes() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

}  // namespace

#if !defined(RELPOS_EMU_FIBER_UCONTEXT)

// switch_stack(save, load): push the callee-saved registers and the floating-point control words
// on the current stack, store the stack pointer to *save, load `load`, pop the same from there and
// return into the other context. Everything else is caller-saved in the System V ABI, so the C++
// callers handle it. No unwind info: exceptions are always caught on the stack they were thrown on.
extern "C" void relpos_emu_switch_stack(void** save, void* load);
asm(R"(
    .text
    .p2align 4
    .globl relpos_emu_switch_stack
    .hidden relpos_emu_switch_stack
    .type relpos_emu_switch_stack, @function
relpos_emu_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size relpos_emu_switch_stack, .-relpos_emu_switch_stack
)");

#endif

Fiber::Fiber(size_t stack_bytes) {
  const size_t page = page_bytes();
  stack_bytes_ = (stack_bytes + page - 1) / page * page;
  mapping_bytes_ = stack_bytes_ + page;
  mapping_ = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mapping_ == MAP_FAILED) throw std::bad_alloc();
  if (mprotect(mapping_, page, PROT_NONE) != 0) {
    munmap(mapping_, mapping_bytes_);
    throw std::runtime_error("relpos CUDA emulator: mprotect of a fiber guard page failed: " +
                             std::string(std::strerror(errno)));
  }
  stack_lo_ = static_cast<char*>(mapping_) + page;
}

Fiber::~Fiber() { munmap(mapping_, mapping_bytes_); }

void Fiber::start(Entry entry, void* arg) {
  entry_ = entry;
  arg_ = arg;
#if defined(RELPOS_EMU_FIBER_UCONTEXT)
  getcontext(&context_);
  context_.uc_stack.ss_sp = stack_lo_;
  context_.uc_stack.ss_size = stack_bytes_;
  context_.uc_link = nullptr;
  makecontext(&context_, &Fiber::trampoline, 0);
#else
  // The frame relpos_emu_switch_stack pops, from the lowest address: MXCSR and the x87 control
  // word (the scheduler's own), r15 r14 r13 r12 rbx rbp (zero: rbp = 0 ends frame-pointer
  // backtraces), the address it returns to (trampoline) and a null return address for trampoline
  // itself, placed so that the stack is aligned as after a call.
  auto* top = reinterpret_cast<uint64_t*>(
      reinterpret_cast<uintptr_t>(stack_lo_ + stack_bytes_) & ~uintptr_t{15});
  uint64_t* frame = top - 9;
  uint32_t mxcsr;
  uint16_t fpu_control;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpu_control));
  frame[0] = mxcsr | (uint64_t{fpu_control} << 32);
  for (int i = 1; i <= 6; ++i) frame[i] = 0;
  frame[7] = reinterpret_cast<uint64_t>(&Fiber::trampoline);
  frame[8] = 0;
  sp_ = frame;
#endif
}

void Fiber::resume() {
  Fiber* const outer = g_entering;
  g_entering = this;
#if defined(__SANITIZE_ADDRESS__)
  void* caller_fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&caller_fake_stack, stack_lo_, stack_bytes_);
#endif
#if defined(RELPOS_EMU_FIBER_UCONTEXT)
  swapcontext(&caller_context_, &context_);
#else
  relpos_emu_switch_stack(&caller_sp_, sp_);
#endif
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(caller_fake_stack, nullptr, nullptr);
#endif
  g_entering = outer;
}

void Fiber::suspend() {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(&fake_stack_, caller_stack_lo_, caller_stack_bytes_);
#endif
#if defined(RELPOS_EMU_FIBER_UCONTEXT)
  swapcontext(&context_, &caller_context_);
#else
  relpos_emu_switch_stack(&sp_, caller_sp_);
#endif
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake_stack_, &caller_stack_lo_, &caller_stack_bytes_);
#endif
}

void Fiber::trampoline() {
  Fiber* const self = g_entering;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(nullptr, &self->caller_stack_lo_, &self->caller_stack_bytes_);
#endif
  self->entry_(self->arg_);
  self->finish();
}

void Fiber::finish() {
#if defined(__SANITIZE_ADDRESS__)
  // A null save slot tells ASan that this fiber is gone and its fake frames can be freed.
  __sanitizer_start_switch_fiber(nullptr, caller_stack_lo_, caller_stack_bytes_);
#endif
#if defined(RELPOS_EMU_FIBER_UCONTEXT)
  setcontext(&caller_context_);
#else
  relpos_emu_switch_stack(&sp_, caller_sp_);
#endif
  __builtin_unreachable();  // start() prepares a new frame before the fiber is resumed again
}

}  // namespace relpos_emu::detail
