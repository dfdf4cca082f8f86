#pragma once
// Decode-step kernels (cuda_decode.cu): routed experts by id, fused cache appends, argmax.
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/cuda_kernels.cuh"

namespace vireo::cuda {

// One routed expert's three matrices on the device.
struct DevExpert {
  DevW gate, up, down;  // gate/up [I, D], down [D, I]
};

// Which of moe_experts' launches a call queues: all of them; only the shared experts' gate | up
// (which read no routing, so they may run before or beside it); or the rest (the routed experts'
// gate | up, then the down products of every slot), after a SharedGateUp call with the same h.
enum class MoePart { All, SharedGateUp, Rest };

// out[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t, k], k in order,
// then + the S shared experts (bank[n_routed ..], weight 1). h is scratch [N * (K + S), I + D]
// (the slots' gate | up products, then their down products before they are summed).
// x_shared: BF16/FP8 kernels read x from a copy in shared memory (else through L1; same sums).
// ready (may be null): N * (K + S) ints, zero, that the shared-memory kernels use to let each slot's
// down products begin once that slot's gate | up is written (and zero again after); the same sums.
// f16_x: one token's FP8 gate | up and down products (the walks) on x and h staged as f16 with
// a scale a 128-column block (stage_x_f16: fast-fp8's arithmetic; other sums).
void moe_experts(const float* x, int64_t N, int64_t D, int64_t I, int K, int S, int n_routed, const int32_t* ids,
                 const float* weights, const DevExpert* bank, int dtype, bool vec, bool x_shared, MoePart part,
                 float* h, float* out, int* ready, cudaStream_t st, bool f16_x = false);
// cuda_set_moe_walk (cuda_backend.h).
void set_moe_walk(bool on);
int64_t moe_down_walk_launches();  // moe_down_walk_kernel's launches so far (tests check it is taken)

// h += x; y = rms_norm(h) * w, row by row (bit-identical to add then rms_norm).   [T, n]
void add_rms_norm(float* h, const float* x, int64_t T, int64_t n, const float* w, float eps, float* y,
                  cudaStream_t st);
// y = rms_norm(x) * w for a decode step's rows (T <= 8), each row over a cluster of
// blocks, with add_rms_norm's arithmetic at those T (so add then rms_norm gives the same bits).
// False (nothing launched) for other shapes.   x [T, xs], y [T, ys]
bool rms_norm_decode(const float* x, int64_t xs, int64_t T, int64_t n, const float* w, float eps, float* y, int64_t ys,
                     cudaStream_t st);

// h = table[ids] as f32, then y = rms_norm(h) * w, in one launch for decode steps (the shapes
// embed_rms_norm_fits accepts: T <= 8): the bits of embed then rms_norm_decode.   h, y [T, hidden]
bool embed_rms_norm_fits(int64_t T, int64_t hidden);
void embed_rms_norm_decode(const DevW& table, const int32_t* ids, int64_t T, const float* w, float eps, float* h,
                           float* y, cudaStream_t st);

void mla_cache_append(const float* kva, int64_t T, int64_t L, int64_t rope, const float* norm_w, float eps,
                      const float* cs, bool interleaved, float* cache, int64_t pos0, const int32_t* pos0_dev,
                      cudaStream_t st);
void index_key_append(const float* k, int64_t T, int64_t d, const float* w, const float* b, float eps, int64_t rope,
                      const float* cs, bool interleaved, float* keys, int64_t pos0, const int32_t* pos0_dev,
                      cudaStream_t st);

// Up to kMaxMany weights sharing one input row (of one dtype; FP8 and BF16 for gemv_many_mixed):
// y_i = W_i x, one launch, a warp per output row. Rows must allow 16-byte loads.
constexpr int kMaxMany = 6;
struct ManyW {
  DevW w[kMaxMany];
  float* y[kMaxMany];
  int64_t row0[kMaxMany + 1] = {0};  // first global row of each weight; row0[n] = total rows
  int n = 0;
  void add(const DevW& wi, float* yi) {  // (host; at most kMaxMany)
    w[n] = wi;
    y[n] = yi;
    row0[n + 1] = row0[n] + wi.out;
    ++n;
  }
};
void gemv_many(const float* x, const ManyW& m, bool x_shared, cudaStream_t st);  // x_shared: as moe_experts
// One launch for FP8 and BF16 weights together (an FP8 checkpoint's bf16 indexer head weights
// beside q_a, kv_a and the indexer's keys), in the shared-x form of one block an SM, a warp a row
// (each row's sum as gemv_many's for its dtype). False where that form does not apply (nothing
// launched). VIREO_GEMV_MANY_MIXED=0: never (a launch a dtype, A/B runs).
bool gemv_many_mixed(const float* x, const ManyW& m, bool x_shared, cudaStream_t st);

// y = W x for one token, a warp per two rows (x read once for both): large matrices, where the
// x reads from L1 rather than the weight bytes limit the one-row-per-warp GEMV. False when the
// shape or alignment does not allow it (nothing launched). x_shared: as moe_experts.
// form (Backend::ProductLaunch, with x shared): HalfSm launches blocks of 16 warps (half of an SM's
// registers), Early the same without waiting for the kernel before; otherwise the form that
// fills the SMs. The other paths (x not shared) always launch in order. f16_x (FP8 rows, x shared,
// w.in % 128 == 0): x staged as f16 with a scale a 128-column block (as moe_experts').
enum class Rows2Launch { InOrder, HalfSm, Early };
bool gemv_rows2(const float* x, const DevW& w, float* y, bool x_shared, cudaStream_t st,
                Rows2Launch form = Rows2Launch::InOrder, bool f16_x = false);

// out[r] = the index of row r's largest value (the lowest on ties), as the CPU reference. Two
// launches: blocks over parts of each row, then one warp per row; parts_buf holds
// rows x argmax_parts(n) x 8 bytes.
int argmax_parts(int64_t n);
void argmax_rows(const float* x, int64_t rows, int64_t n, int32_t* out, void* parts_buf, cudaStream_t st);

}  // namespace vireo::cuda
