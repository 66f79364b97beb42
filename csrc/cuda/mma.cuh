// Tensor-core matrix products for the kernels that use them (rel_attention_tc.cuh): one warp-wide
// D += A B on a 16 x 8 x 16 tile with bfloat16 or float16 operands and float32 accumulators (PTX
// mma.sync.aligned.m16n8k16.row.col, sm_80 and newer), and what feeds it: 32-bit shared-memory
// accesses, ldmatrix (four 8 x 8 matrices a warp-wide load) and cp.async (16-byte copies from
// global to shared memory that run in the background), each with the emulator's version beside it.
//
// Fragment layout (PTX ISA, "Matrix fragments for mma.m16n8k16"), lane = 4 g + t (g = lane / 4,
// t = lane % 4); a register holds two consecutive elements, the lower index in the low 16 bits:
//   A (16 x 16, row-major)  a[0] = A[g][2t, 2t+1]       a[1] = A[g+8][2t, 2t+1]
//                           a[2] = A[g][2t+8, 2t+9]     a[3] = A[g+8][2t+8, 2t+9]
//   B (16 x 8, "col")       b[0] = B[2t, 2t+1][g]       b[1] = B[2t+8, 2t+9][g]
//   C, D (16 x 8, float)    d[0], d[1] = D[g][2t, 2t+1]  d[2], d[3] = D[g+8][2t, 2t+1]
// So the accumulators of two n-tiles side by side are, packed in pairs, the A fragment of the
// next product (FlashAttention-2's register reuse of P).
//
// Under the emulator (RELPOS_CUDA_EMU, which has no inline PTX) mma_16816 computes the same
// product from that layout: a warp-wide operation (relpos_emu::warp_collective) that, once every
// lane waits at it, assembles A and B from the 32 lanes' fragments and adds each lane's four sums
// in float32 to its accumulators. A kernel whose fragments do not follow the layout gets wrong
// results under the emulator too.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(RELPOS_CUDA_EMU)
#include <stdexcept>
#endif

#include "cuda/dtype.cuh"

namespace relpos::cuda {

// 32 bits (two 16-bit elements) from / to shared memory, 4-byte aligned. The emulator's host
// build goes through memcpy, which strict aliasing allows.
template <typename T>
RELPOS_DEVICE uint32_t ld32(const T* p) {
#if defined(RELPOS_CUDA_EMU)
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
#else
  return *reinterpret_cast<const uint32_t*>(p);
#endif
}
template <typename T>
RELPOS_DEVICE void st32(T* p, uint32_t u) {
#if defined(RELPOS_CUDA_EMU)
  std::memcpy(static_cast<void*>(p), &u, 4);
#else
  *reinterpret_cast<uint32_t*>(p) = u;
#endif
}

template <typename T>
RELPOS_DEVICE uint16_t bits16(T x) {
  uint16_t u;
  std::memcpy(&u, &x, 2);
  return u;
}
template <typename T>
RELPOS_DEVICE T from_bits16(uint16_t u) {
  T x;
  std::memcpy(static_cast<void*>(&x), &u, 2);
  return x;
}

// (lo, hi) rounded to T and packed: lo in the low half.
template <typename T>
RELPOS_DEVICE uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(bits16(from_float<T>(lo))) |
         (static_cast<uint32_t>(bits16(from_float<T>(hi))) << 16);
}

#if defined(RELPOS_CUDA_EMU)
template <typename T>
inline float unpack_half(uint32_t u, int hi) {
  return to_float(from_bits16<T>(static_cast<uint16_t>(hi ? u >> 16 : u & 0xffffu)));
}

// A warp collective's answer to a partial warp (undefined on the device): all-ones bits, a NaN,
// in the four result words (Lane::*out) of every waiting lane. False, writing nothing, for a whole
// warp.
template <typename Lane, typename Word>
inline bool poison_partial_warp(void* const* args, uint32_t group, Word* Lane::*out) {
  if (group == 0xffffffffu) return false;
  for (int lane = 0; lane < 32; ++lane) {
    if (args[lane] != nullptr) {
      std::memset(static_cast<const Lane*>(args[lane])->*out, 0xff, 4 * sizeof(Word));
    }
  }
  return true;
}

// One lane's registers of an emulated mma.sync.
struct MmaLane {
  const uint32_t* a;  // [4]
  const uint32_t* b;  // [2]
  float* d;           // [4]
};

// The product of the whole warp, once every lane waits at it (relpos_emu::warp_collective):
// A and B assembled from the lanes' fragments as the layout above places them, then each lane's
// four sums in float32, k ascending. With a lane missing (exited: mma.sync is undefined there)
// every lane's result is NaN.
template <typename T>
inline void mma_16816_complete(void* const* args, uint32_t group) {
  if (poison_partial_warp(args, group, &MmaLane::d)) return;
  float am[16][16], bm[8][16];  // A[row][k], B stored as [col][k]
  for (int lane = 0; lane < 32; ++lane) {
    const MmaLane& x = *static_cast<const MmaLane*>(args[lane]);
    const int g = lane / 4, t = lane % 4;
    for (int hi = 0; hi < 2; ++hi) {
      am[g][2 * t + hi] = unpack_half<T>(x.a[0], hi);
      am[g + 8][2 * t + hi] = unpack_half<T>(x.a[1], hi);
      am[g][2 * t + 8 + hi] = unpack_half<T>(x.a[2], hi);
      am[g + 8][2 * t + 8 + hi] = unpack_half<T>(x.a[3], hi);
      bm[g][2 * t + hi] = unpack_half<T>(x.b[0], hi);
      bm[g][2 * t + 8 + hi] = unpack_half<T>(x.b[1], hi);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    float* d = static_cast<const MmaLane*>(args[lane])->d;
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
      const float* ar = am[g + (e >= 2 ? 8 : 0)];
      const float* bc = bm[2 * t + (e & 1)];
      float acc = 0;
      for (int k = 0; k < 16; ++k) acc += ar[k] * bc[k];
      d[e] += acc;
    }
  }
}

template <typename T>
inline void mma_16816_emu(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  MmaLane lane{a, b, d};
  relpos_emu::warp_collective(0xffffffffu, &mma_16816_complete<T>, &lane);
}
#endif

// d += A B (16 x 8 x 16), fragments as above; T is __nv_bfloat16 or __half. All 32 lanes call it.
template <typename T>
RELPOS_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>,
                "mma_16816: bfloat16 or float16 operands");
#if defined(RELPOS_CUDA_EMU)
  mma_16816_emu<T>(d, a, b);
#elif defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  __trap();  // the launcher takes the tensor-core kernels on compute capability 8.0 and newer only
#endif
#endif
}

// The A fragment of the 16 x 16 tile at a (row-major, rows ld elements apart) for lane `lane`.
template <typename T>
RELPOS_DEVICE void load_a_frag(uint32_t (&f)[4], const T* a, int ld, int lane) {
  const T* x = a + (lane / 4) * ld + 2 * (lane % 4);
  f[0] = ld32(x);
  f[1] = ld32(x + 8 * ld);
  f[2] = ld32(x + 8);
  f[3] = ld32(x + 8 * ld + 8);
}

// 16 bits from shared memory, as the low half of a word.
template <typename T>
RELPOS_DEVICE uint32_t ld16(const T* p) {
  return static_cast<uint32_t>(bits16(*p));
}

// The A fragment of the 16 x 16 tile A = M^T, M at m row-major (16 rows of k, 16 columns of m,
// rows ld elements apart): two 16-bit loads a register (what ldmatrix .trans does in one).
template <typename T>
RELPOS_DEVICE void load_a_frag_t(uint32_t (&f)[4], const T* m, int ld, int lane) {
  const T* x = m + 2 * (lane % 4) * ld + lane / 4;
  f[0] = ld16(x) | (ld16(x + ld) << 16);
  f[1] = ld16(x + 8) | (ld16(x + ld + 8) << 16);
  f[2] = ld16(x + 8 * ld) | (ld16(x + 9 * ld) << 16);
  f[3] = ld16(x + 8 * ld + 8) | (ld16(x + 9 * ld + 8) << 16);
}

// The B fragment of the 16 x 8 tile B itself at m row-major (16 rows of k, 8 columns of n, rows
// ld elements apart), two 16-bit loads a register.
template <typename T>
RELPOS_DEVICE void load_b_frag_kn(uint32_t (&f)[2], const T* m, int ld, int lane) {
  const T* x = m + 2 * (lane % 4) * ld + lane / 4;
  f[0] = ld16(x) | (ld16(x + ld) << 16);
  f[1] = ld16(x + 8 * ld) | (ld16(x + 9 * ld) << 16);
}

// The B fragment of the 16 x 8 tile B = Bt^T, Bt at bt row-major (8 rows of n, 16 columns of k,
// rows ld elements apart): B's "col" layout is Bt's rows.
template <typename T>
RELPOS_DEVICE void load_b_frag(uint32_t (&f)[2], const T* bt, int ld, int lane) {
  const T* x = bt + (lane / 4) * ld + 2 * (lane % 4);
  f[0] = ld32(x);
  f[1] = ld32(x + 8);
}

#if defined(RELPOS_CUDA_EMU)
// One lane's part of an emulated ldmatrix: its row address and its four registers.
template <typename T>
struct LdmatrixLane {
  const T* row;
  uint32_t* r;  // [4]
};

// Every lane's registers from the 32 row addresses, once all lanes wait (warp_collective); in a
// partial warp (undefined on the device) every lane gets all-ones bits, a NaN.
template <bool kTrans, typename T>
inline void ldmatrix_x4_complete(void* const* args, uint32_t group) {
  if (poison_partial_warp(args, group, &LdmatrixLane<T>::r)) return;
  const T* rows[32];
  for (int lane = 0; lane < 32; ++lane) {
    rows[lane] = static_cast<const LdmatrixLane<T>*>(args[lane])->row;
  }
  for (int lane = 0; lane < 32; ++lane) {
    uint32_t* r = static_cast<const LdmatrixLane<T>*>(args[lane])->r;
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      if constexpr (kTrans) {
        r[i] = ld16(rows[8 * i + 2 * t] + g) | (ld16(rows[8 * i + 2 * t + 1] + g) << 16);
      } else {
        r[i] = ld32(rows[8 * i + g] + 2 * t);
      }
    }
  }
}
#endif

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: four 8 x 8 matrices of 16-bit elements from
// shared memory, matrix i's row r at lane 8 i + r's address `row` (16-byte aligned). Lane
// 4 g + t receives r[i] = M_i[g][2t, 2t+1], or with kTrans M_i[2t][g] and M_i[2t+1][g] (the low
// half first). All 32 lanes call it. Under the emulator it is one warp_collective, as
// mma_16816_emu is.
template <bool kTrans, typename T>
RELPOS_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const T* row) {
#if defined(RELPOS_CUDA_EMU)
  // The device takes 16-byte aligned rows only (else an error at run time); the emulator's
  // dynamic shared memory is 16-byte aligned, as the device's, so offsets check the same.
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0) {
    throw std::runtime_error("ldmatrix: a row address that is not 16-byte aligned");
  }
  LdmatrixLane<T> lane{row, r};
  relpos_emu::warp_collective(0xffffffffu, &ldmatrix_x4_complete<kTrans, T>, &lane);
#elif defined(__CUDA_ARCH__)
  const auto a = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
#endif
}

// The B fragments of n-tiles n and n + 1 (b[0], b[1]) of k-step 16 x 16 block at m of B = M
// itself, row-major [k][n] (rows ld elements apart, 16-byte aligned): one ldmatrix .trans of the
// blocks (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
template <typename T>
RELPOS_DEVICE void load_b_frags_kn_x4(uint32_t (&b)[2][2], const T* m, int ld, int lane) {
  const int i = lane / 8;
  uint32_t r[4];
  ldmatrix_x4<true>(r, m + (8 * (i % 2) + lane % 8) * ld + 8 * (i / 2));
  b[0][0] = r[0];
  b[0][1] = r[1];
  b[1][0] = r[2];
  b[1][1] = r[3];
}

// cp.async.cg.shared.global of 16 bytes (sm_80 and newer): dst (shared) = src (global), or zeros
// if !valid (src is then not read). Both 16-byte aligned. The copy lands in the background: it is
// visible to this thread after cp_async_wait, and to the block after that and a barrier. Under
// the emulator it is a plain copy.
RELPOS_DEVICE void cp_async16(void* dst, const void* src, bool valid) {
#if defined(RELPOS_CUDA_EMU)
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 ||
      (valid && reinterpret_cast<uintptr_t>(src) % 16 != 0)) {
    throw std::runtime_error("cp.async: an address that is not 16-byte aligned");
  }
  if (valid) {
    std::memcpy(dst, src, 16);
  } else {
    std::memset(dst, 0, 16);
  }
#elif defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  const auto a = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  __trap();
#endif
#endif
}
// Closes this thread's group of cp_async16 issued since the last commit (possibly empty).
RELPOS_DEVICE void cp_async_commit() {
#if !defined(RELPOS_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
RELPOS_DEVICE void cp_async_wait() {
#if !defined(RELPOS_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

template <int kN>
RELPOS_DEVICE void zero_acc(float (&acc)[kN][4]) {
  RELPOS_UNROLL
  for (int n = 0; n < kN; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0;
}

// acc[n] += A_kk B_{kk,n} for n < kN over kK k-steps of 16: a(kk, f) writes the A fragment of
// k-step kk (16 rows x 16 columns) into f, b(kk, n, f) the B fragment of k-step kk and n-tile n
// (16 x 8). All 32 lanes call it.
template <typename T, int kN, int kK, typename AFrag, typename BFrag>
RELPOS_DEVICE void warp_mma(float (&acc)[kN][4], AFrag&& a, BFrag&& b) {
  RELPOS_UNROLL
  for (int kk = 0; kk < kK; ++kk) {
    uint32_t af[4];
    a(kk, af);
    RELPOS_UNROLL
    for (int n = 0; n < kN; ++n) {
      uint32_t bf[2];
      b(kk, n, bf);
      mma_16816<T>(acc[n], af, bf);
    }
  }
}

// warp_mma with B = Bt^T: Bt_n is the 8 x 16 kK block of rows [8 n, 8 n + 8) of bt (row-major,
// rows ld elements apart).
template <typename T, int kN, int kK, typename AFrag>
RELPOS_DEVICE void warp_mma_bt(float (&acc)[kN][4], AFrag&& a, const T* bt, int ld, int lane) {
  warp_mma<T, kN, kK>(acc, a, [&](int kk, int n, uint32_t (&f)[2]) {
    load_b_frag(f, bt + n * 8 * ld + kk * 16, ld, lane);
  });
}

// warp_mma with B itself stored: B_n is the 16 x 8 block (k-step kk, n-tile n) of B = M, M
// row-major [k][n] at m (rows ld elements apart; load_b_frag_kn).
template <typename T, int kN, int kK, typename AFrag>
RELPOS_DEVICE void warp_mma_kn(float (&acc)[kN][4], AFrag&& a, const T* m, int ld, int lane) {
  warp_mma<T, kN, kK>(acc, a, [&](int kk, int n, uint32_t (&f)[2]) {
    load_b_frag_kn(f, m + kk * 16 * ld + n * 8, ld, lane);
  });
}

// warp_mma_kn with the B fragments loaded two n-tiles at a time by ldmatrix .trans
// (load_b_frags_kn_x4): kN even, m 16-byte aligned, ld a multiple of 8.
template <typename T, int kN, int kK, typename AFrag>
RELPOS_DEVICE void warp_mma_kn_x4(float (&acc)[kN][4], AFrag&& a, const T* m, int ld, int lane) {
  static_assert(kN % 2 == 0, "two n-tiles per ldmatrix");
  RELPOS_UNROLL
  for (int kk = 0; kk < kK; ++kk) {
    uint32_t af[4];
    a(kk, af);
    RELPOS_UNROLL
    for (int n = 0; n < kN; n += 2) {
      uint32_t bf[2][2];
      load_b_frags_kn_x4(bf, m + kk * 16 * ld + n * 8, ld, lane);
      mma_16816<T>(acc[n], af, bf[0]);
      mma_16816<T>(acc[n + 1], af, bf[1]);
    }
  }
}

// The A fragment of k-step kk from accumulators of 16 x 8 tiles side by side (2 kk and 2 kk + 1),
// rounded to T: FlashAttention-2's reuse of P from registers.
template <typename T, int kN>
RELPOS_DEVICE void acc_a_frag(uint32_t (&a)[4], const float (&acc)[kN][4], int kk) {
  const float(&s0)[4] = acc[2 * kk];
  const float(&s1)[4] = acc[2 * kk + 1];
  a[0] = pack2<T>(s0[0], s0[1]);
  a[1] = pack2<T>(s0[2], s0[3]);
  a[2] = pack2<T>(s1[0], s1[1]);
  a[3] = pack2<T>(s1[2], s1[3]);
}

// dst[r][c] = the accumulators of 16 x 8 tiles side by side (row-major, rows ld floats apart).
template <int kN>
RELPOS_DEVICE void store_acc(float* dst, int ld, const float (&acc)[kN][4], int lane) {
  const int g = lane / 4, t = lane % 4;
  RELPOS_UNROLL
  for (int n = 0; n < kN; ++n) {
    RELPOS_UNROLL
    for (int e = 0; e < 4; ++e) dst[(g + (e / 2) * 8) * ld + n * 8 + 2 * t + e % 2] = acc[n][e];
  }
}

}  // namespace relpos::cuda
