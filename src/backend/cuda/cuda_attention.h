#pragma once
// Attention, indexer and routing launchers (cuda_attention.cu).
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_kernels.cuh"

namespace vireo::cuda {

// With q set: the same launch rotates q's rope parts [t, h, nope : qw] in place first (q the
// absorption's own q; rope width qw - nope <= 64), as rope_kernel by cs ([T, (qw - nope) / 2, 2]).
struct AbsorbRope {
  float* q = nullptr;
  const float* cs = nullptr;
  bool interleaved = false;
};
// Whether absorb_q can rotate a rope part of this width (a warp a head: at most 64, even).
inline bool absorb_rope_fits(int64_t rope) { return rope <= 64 && rope % 2 == 0; }
// q_lat[t, h, :] = W_UK(h)^T q[t, h, :nope]                         q_lat [T, H, L]
// stage_ahead: an FP8 W_UK may be staged in shared memory before the kernel's wait (read while
// the launch before it still runs; the same sums), unless set_absorb_ahead(false).
void absorb_q(const float* q, int64_t T, int64_t H, int64_t qw, int64_t nope, const DevW& kvb, int64_t hw, int64_t L,
              float* qlat, cudaStream_t st, AbsorbRope rope = {}, bool stage_ahead = false);
// The staged form allowed (on, the default; VIREO_ABSORB_AHEAD=0 turns it off). Process-wide;
// cuda_set_absorb_ahead (cuda_backend.h).
void set_absorb_ahead(bool on);
int64_t absorb_staged_launches();  // launches of the staged form so far (tests)

struct DecodeAttnArgs {
  const float* qlat = nullptr;  // [T, H, L]
  const float* q = nullptr;     // [T, H, qw] (rope part read)
  int64_t T = 0, H = 0, qw = 0, nope = 0, L = 0, vd = 0, hw = 0;
  const float* kv = nullptr;    // [N, kvw]
  int64_t kvw = 0, pos0 = 0;
  const int32_t* sel = nullptr;     // [T, sel_stride] or null (causal)
  const int32_t* counts = nullptr;  // [T]
  int64_t sel_stride = 0;
  float scale = 1.0f;
  int nsplit = 1;
  float* opart = nullptr;  // [T, H, nsplit, L]
  float* mpart = nullptr;  // [T, H, nsplit]
  float* lpart = nullptr;  // [T, H, nsplit]
  DevW kvb;
  float* out = nullptr;    // [T, H, vd]
  const int32_t* pos0_dev = nullptr;  // run-time pos0 (then pos0 above is a bound)
  // The fast kernels (cuda_decode_attention.cu): max_keys bounds every query's key count, scores
  // holds [T, H, max_keys rounded up to 32] floats. fast = false: the reference kernels.
  int64_t max_keys = 0;
  float* scores = nullptr;
  bool fast = true;
  // The fast modes: the long-context scores and p x latent on bf16 tensor cores (q, the cache rows
  // and p rounded).
  bool tc = false;
};
// Splits of the decode kernels for a key list of at most `max_keys` (sizes the partials: every
// kernel set fits in T x H x decode_splits(max_keys) x (L + 2) floats). The rule lives in
// CudaBufferSizes, which the memory plan reads too.
inline int decode_splits(int64_t max_keys) { return int(CudaBufferSizes::decode_splits(max_keys)); }
// The short-context kernel's longest key list, and its splits where it takes a key list of at
// most `max_keys`, else 0.
constexpr int64_t kDecodeShortMaxKeys = CudaBufferSizes::kDecodeShortMaxKeys;
inline int64_t decode_short_splits(int64_t max_keys) { return CudaBufferSizes::decode_short_splits(max_keys); }
void mla_decode(const DecodeAttnArgs& a, cudaStream_t st);
// All heads of a query per block (scores, then o_lat partials, then merge + W_UV; at most 256
// keys, scores and o_lat partials in one kernel). False (nothing
// launched) when the shapes or alignments do not fit those kernels.
bool mla_decode_fast(const DecodeAttnArgs& a, cudaStream_t st);
// Long key lists in mla_decode_fast: the fused kernel (on, the default) or the scores and p x
// latent kernels (off). Process-wide.
void set_fused_decode_attention(bool on);

// mask[t, u / 32] bit u % 32 set for every selected key u of query t.
void build_mask(const int32_t* sel, const int32_t* counts, int64_t T, int64_t stride, int64_t mwords, uint32_t* mask,
                cudaStream_t st);

struct PrefillAttnArgs {
  const float* q = nullptr;    // [T, H, qw]
  int64_t T = 0, H = 0, qw = 0, nope = 0, vd = 0, L = 0;
  const float* kv = nullptr;   // [N, kvw] (k_rope read at L)
  int64_t kvw = 0;
  const float* kvx = nullptr;  // [N, H, hw]: k_nope | v
  int64_t hw = 0, n_keys = 0, pos0 = 0;
  const uint32_t* mask = nullptr;  // [T, mwords] or null (causal)
  int64_t mwords = 0;
  float scale = 1.0f;
  float* out = nullptr;        // [T, H, vd]
};
// f32 CUDA cores (exact f32 math, slow).
void mla_prefill(const PrefillAttnArgs& a, cudaStream_t st);
// Tensor cores (bf16 hi/lo split, ~2^-16 relative per product). False (nothing launched) when
// the head dims do not fit the kernel (qk > 256 or v > 256).
bool mla_prefill_tc(const PrefillAttnArgs& a, cudaStream_t st);
// Fast math mode (CudaGemmMode::Bf16, cuda_prefill_fast.cu): operands rounded to bf16 once, one
// tensor-core pass, f32 accumulation and online softmax (~2^-9 relative per operand). Reads
// k_nope | v from kvx_bf16 (a.kvx's [N, H, hw] rows as bf16; a.kvx itself is not read) and k_rope
// from rope_bf16 [N, qw - nope] (mla_prefill_fast_rope writes it from a.kv); both 16-byte aligned.
// Supported: max(qw, vd) <= 256, nope, qw and vd multiples of 8, scale > 0.
bool mla_prefill_fast_supported(const PrefillAttnArgs& a);
void mla_prefill_fast_rope(const PrefillAttnArgs& a, void* rope_bf16, cudaStream_t st);
// wgmma: Hopper's warpgroup MMA (the default); false: the mma.sync kernel (kept as the reference
// it is checked against and for the timing comparison).
void mla_prefill_fast(const PrefillAttnArgs& a, const void* kvx_bf16, const void* rope_bf16, cudaStream_t st,
                      bool wgmma = true);

// scores[t, u] for u < pos0 + t + 1, rows with more causal keys than topk only. fast = false: run-time
// positions take the plain kernel (the reference; both give the same bits).
// pos0_dev: run-time pos0 (then pos0 and n_keys are bounds; n_keys is the row stride of scores).
// wscale: IndexerArgs::weight_scale.
void indexer_scores(const float* q, const float* wts, const float* keys, int64_t T, int64_t nI, int64_t d,
                    int64_t n_keys, int64_t pos0, const int32_t* pos0_dev, int64_t topk, float scale, float wscale,
                    float* scores, cudaStream_t st, bool fast = true);
// --math fast prefill (cuda_indexer_fast.cu): the same scores with q and k rounded to bf16 once,
// on tensor cores (f32 accumulation; not bit-identical to the CPU, so near-ties may select
// differently). Host-known pos0 only. False (nothing launched) for shapes it does not take.
bool indexer_scores_bf16(const float* q, const float* wts, const float* keys, int64_t T, int64_t nI, int64_t d,
                         int64_t n_keys, int64_t pos0, int64_t topk, float scale, float wscale, float* scores,
                         cudaStream_t st);
// --math fast decode (cuda_indexer_fast.cu): the same rounding as indexer_scores_bf16 for a few rows
// under run-time or host positions, shaped for latency. False (nothing launched) for shapes it does not
// take (d a multiple of 16 up to 128, at most 64 heads).
bool indexer_scores_decode_tc(const float* q, const float* wts, const float* keys, int64_t T, int64_t nI, int64_t d,
                              int64_t n_keys, int64_t pos0, const int32_t* pos0_dev, int64_t topk, float scale,
                              float wscale, float* scores, cudaStream_t st);
// fast: rows' keys held in registers (one 1024-thread block a row to 16384 keys, a cluster of 8 to
// 262144), longer rows streamed by one block (indexer_topk_fast); else the shared-memory kernel.
void indexer_topk(const float* scores, int64_t T, int64_t n_keys, int64_t pos0, const int32_t* pos0_dev, int64_t topk,
                  int32_t* selected, int32_t* counts, cudaStream_t st, bool fast = true);
// False (nothing launched) when a row could have more keys than the kernel holds.
bool indexer_topk_fast(const float* scores, int64_t T, int64_t n_keys, int64_t pos0, const int32_t* pos0_dev,
                       int64_t topk, int32_t* selected, int32_t* counts, cudaStream_t st);

void moe_route(const float* logits, int64_t T, int E, int G, int topk_group, int K, const float* bias, bool norm,
               float rsf, int32_t* ids, float* weights, cudaStream_t st);

}  // namespace vireo::cuda
