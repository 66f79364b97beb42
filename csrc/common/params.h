// Plain-old-data descriptions of one op call, passed from the torch glue to kernels that must not
// include torch headers: the AVX2 translation units (compiled with -mavx2, where inline torch code
// would leak AVX2 instructions into the scalar path) and the CUDA launchers (where torch headers
// cost a minute of nvcc time per file). All tensors are contiguous; sizes are in elements.
#pragma once

#include <cstdint>

namespace relpos {

enum class DType : int { Float32 = 0, Float64 = 1, Float16 = 2, BFloat16 = 3 };

// rel_gather: out[h, i, j, :] = table[h, b(i, j), :]   (h ranges over `heads`, 1 for a shared table)
struct RelGatherParams {
  const void* table;  // [heads, 2K+1, dim]
  void* out;          // [heads, q_len, k_len, dim]
  int64_t heads, q_len, k_len, dim, max_distance, q_offset, k_offset;
  DType dtype;
};

// rel_gather_backward: dtable[h, b, :] = sum_{(i, j): b(i, j) = b} grad[h, i, j, :]
struct RelGatherBwdParams {
  const void* grad;  // [heads, q_len, k_len, dim]
  void* dtable;      // [heads, 2K+1, dim], fully written (zeros where no (i, j) maps)
  int64_t heads, q_len, k_len, dim, max_distance, q_offset, k_offset;
  DType dtype;
};

// skew: y[n, i, j] = x[n, i, skew_col(i, j)]; causal: x is [n, L, L], zeros above the diagonal.
// skew_backward (unskew) is the adjoint: dx[n, i, skew_col(i, j)] = dy[n, i, j], zero elsewhere.
struct SkewParams {
  const void* in;
  void* out;
  int64_t batch;  // product of the leading dimensions
  int64_t q_len, k_len;
  bool causal;
  DType dtype;
};

// rel_logits: out[b, h, i, j] = q[b, h, i, :] . table[h?, b(i, j), :]
struct RelLogitsParams {
  const void* q;      // [batch, heads, q_len, dim]
  const void* table;  // [2K+1, dim] or [heads, 2K+1, dim]
  void* out;          // [batch, heads, q_len, k_len]
  int64_t batch, heads, q_len, k_len, dim, max_distance, q_offset, k_offset;
  bool table_per_head;
  DType dtype;
};

// rel_logits_backward, first stage: per query row, the gradient mass of each reachable bucket,
//   wsum[b, h, i, c] = sum_{j: b(i, j) = bucket0 + c} grad[b, h, i, j]
// accumulated in float32 (float64 for float64 input), with bucket0 = first_bucket(...) and
// num_cols = last_bucket - bucket0 + 1 <= q_len + k_len - 1 columns, so memory is bounded by the
// gradient itself whatever K is. The glue finishes with two matmuls:
//   dq = wsum @ table[bucket0 : bucket0 + num_cols],  dtable[bucket0 : ...] = sum wsum^T @ q.
struct BucketSumParams {
  const void* grad;  // [batch, heads, q_len, k_len]
  void* wsum;  // [batch, heads, q_len, num_cols]: float32, or float64 when dtype is Float64
  int64_t batch, heads, q_len, k_len, max_distance, q_offset, k_offset;
  int64_t bucket0, num_cols;
  DType dtype;
};

}  // namespace relpos
