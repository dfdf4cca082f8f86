#pragma once
// The CUDA backend: every Backend op on one NVIDIA GPU. Activations are f32 device buffers;
// weights are uploaded once in their stored dtype (BF16, F16, F32, or F8_E4M3 with its 128x128
// block scales) and converted in registers as they stream through. Built when nvcc is found
// (VIREO_HAVE_CUDA); this header is usable either way, so callers need no #ifdefs.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/transfer_link.h"
#include "core/error.h"

namespace vireo {

// Sizes the CUDA backend builds its own buffers from, shared with the memory plan
// (cli/cmd_plan.cpp, estimate_scratch_bytes / estimate_backend_bytes), which counts them in any
// build.
struct CudaBufferSizes {
  static constexpr size_t kAbsorbedPassBytes = size_t(256) << 20;  // absorbed attention's partials + scores a pass
  static constexpr size_t kFp8ChunkBytes = size_t(256) << 20;      // exact mode's bf16 copy of an FP8 weight, a chunk
  static constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;    // a cuBLASLt workspace (the stream's, each lane's)
  static constexpr int kExpertLanes = 4;                           // experts_add's side streams
  static constexpr int64_t kGroupedRows = 16384;                   // grouped experts: rows a chunk (cuda_grouped.h)
  // The most bytes a resident bank's prefill runs (bank_run, cuda_backend.cu) keep in buffers after
  // runs of up to T tokens of per_token rows each (the routed slots and the shared expert's): bf16
  // x and SwiGLU rows and f32 down rows (6 D + 2 I bytes a row) for the rows its growth rule leaves
  // (whole 1024s, at most twice the largest run plus 1024, at most a chunk: longer runs take the
  // forward's grouping), an index and a scale a row for the routed rows and again for the shared
  // expert's, and an offset an expert. None for decode steps (T <= 8: the experts run by id).
  static constexpr int64_t bank_run_bytes(int64_t T, int64_t per_token, int64_t D, int64_t I, int64_t n_routed) {
    if (T <= 8 || n_routed <= 0) return 0;
    const int64_t run = std::min(T * per_token, kGroupedRows);
    const int64_t rows = (std::min(2 * run + 1024, kGroupedRows) + 1023) / 1024 * 1024;
    return rows * (6 * D + 2 * I) + run * 16 + (n_routed + 1) * 4;
  }
  // Absorbed decode attention's key splits (cuda_attention.h): kDecodeSplitKeys keys each, or
  // kDecodeShortSplitKeys each for key lists of at most kDecodeShortMaxKeys (the short-context
  // kernel). The partials are sized for the larger count.
  static constexpr int64_t kDecodeSplitKeys = 64, kDecodeShortSplitKeys = 32, kDecodeShortMaxKeys = 256;
  static constexpr int64_t decode_short_splits(int64_t keys) {
    return keys > 0 && keys <= kDecodeShortMaxKeys ? (keys + kDecodeShortSplitKeys - 1) / kDecodeShortSplitKeys : 0;
  }
  static constexpr int64_t decode_splits(int64_t keys) {
    return std::max<int64_t>({1, (keys + kDecodeSplitKeys - 1) / kDecodeSplitKeys, decode_short_splits(keys)});
  }
};

#ifdef VIREO_HAVE_CUDA
// True when a CUDA device can be used; otherwise `why` (if given) says why not.
bool cuda_device_present(std::string* why = nullptr);
// The CUDA backend on device 0. Throws vireo::Error (one line) when no device is usable.
std::unique_ptr<Backend> make_cuda_backend();

// Measurements for `vireo bench`, taken on the backend's device in the same run.
// Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written.
double cuda_measure_copy_gbs(Backend& cuda);
// cuBLASLt bf16 GEMM (n x n x n, random data, f32 accumulation) in TFLOP/s.
double cuda_measure_bf16_gemm_tflops(Backend& cuda, int n = 8192);
// Waits for all queued device work (for host-side timing).
void cuda_synchronize(Backend& cuda);
// VIREO_SKIP_KERNELS (a timing switch: cuda_internal.h). A kernel's name as its source names it
// (no namespace, template arguments or parameters) from the runtime's mangled name (the input
// unchanged where it cannot be read), and whether `list` (comma-separated names) holds it.
std::string cuda_kernel_name(const std::string& mangled);
bool cuda_kernel_listed(const std::string& name, const std::string& list);
// Host-to-device expert transfers ordered against `cuda`'s compute stream (transfer_link.h).
std::unique_ptr<TransferLink> make_cuda_transfer_link(Backend& cuda);
// Device memory in use (total - free, all processes), for checking the memory plan.
uint64_t cuda_device_memory_used();
// Bytes of weights the backend has uploaded (dense spine and resident experts).
uint64_t cuda_weight_bytes(Backend& cuda);
// Prefill GEMMs (T > 8 rows) on BF16 and FP8 weights, prefill attention and the indexer's prefill
// scores (--math): Split (exact, the default) runs bf16 tensor-core products on x = hi + lo (both
// bf16; FP8 weights and attention operands split too: 2 passes for BF16 weights, 3 for FP8 and
// attention), f32 accumulation: ~2^-16 relative error, fixture-exact. Bf16 (fast) rounds the
// operands to bf16 once (one pass, ~2^-9 relative error, as most engines; attention in one bf16
// pass, cuda_prefill_fast.cu; indexer scores on tensor cores, cuda_indexer_fast.cu). Fp8
// (fast-fp8) is Bf16 except that FP8 weights multiply e4m3 activations as DeepSeek's reference
// inference does, where cuBLASLt takes the shape: x quantized per (token, 128 columns), an FP8 x
// FP8 block-scaled GEMM (~2^-4 relative per element of x, output NMSE ~5e-4; cuda_fp8_gemm.h);
// and in decode products of 2..8 rows on FP8 weights (cuda_q8_gemv.h). One token's large FP8
// products (>= 4096 rows: q_b, o_proj) and its expert walks take x as f16 with a power-of-two
// scale a 128-column block, 16 products at a time summed in f16 (rounding at most 2^-11, far under e4m3's
// 2^-4; VIREO_F16_X=0 turns it off); the other one-row products keep f32 math. Both fast modes
// also run the absorbed decode attention's scores over more than 256 keys on bf16 tensor cores
// (cuda_decode_attention.cu).
// Simt: f32 CUDA-core tiles for GEMMs and attention (exact f32 math, slow).
enum class CudaGemmMode { Split, Bf16, Fp8, Simt };
void cuda_set_gemm_mode(Backend& cuda, CudaGemmMode mode);
// Fp8's one-token products on f16 x (on, the default; VIREO_F16_X=0 turns it off) or on f32 x as
// the other modes (off: the same kernels and sums as Split's). Process-wide.
void cuda_set_one_token_f16_x(bool on);
// Which kernel the last prefill (reconstructed-path) attention ran: "bf16 wgmma" or "bf16 one pass"
// (the fast modes), "tensor cores" (the split kernel), "f32", or "" before any (tests check the
// fast one is taken).
std::string cuda_last_prefill_attention(Backend& cuda);
// The fast modes' prefill attention: on Hopper's wgmma (default), or the mma.sync kernel (off;
// tests run both).
void cuda_set_prefill_wgmma(Backend& cuda, bool on);
// The absorbed attention path runs its rows in passes whose split partials and scores fit this
// many bytes (0: the default, 256 MiB). Tests set it small to cover the passes.
void cuda_set_absorbed_pass_bytes(Backend& cuda, size_t bytes);
// Decode-step BF16/FP8 products (1..8 rows) and experts read x from a copy in shared memory (on,
// the default; VIREO_GEMV_XS=0 turns it off) or through L1 (off: the kernels for shapes too large
// for shared memory; the same sums in the same order, so tests compare the two bit for bit).
void cuda_set_gemv_x_shared(Backend& cuda, bool on);
// Branches (Backend::begin_branch) on a second stream (on, the default; VIREO_BRANCHES=0 turns
// them off) or every op in order on one stream (off). The same kernels and sums either way.
void cuda_set_branches(Backend& cuda, bool on);
// Prefill's routed experts in the fast modes (BF16 weights, shapes the kernels take) as grouped
// products, every expert of a run in one launch a product (on, the default; VIREO_GROUPED=0 turns
// it off), or one expert at a time on the side lanes (off). Tests compare the two, and set
// chunk_rows (0: the default, kGroupedRows) small to cover a run split into chunks.
void cuda_set_grouped_experts(Backend& cuda, bool on, int64_t chunk_rows = 0);
// The grouped products' tile loads by TMA (on, the default where the driver's tensor-map encoder
// is found; VIREO_GROUPED_TMA=0 turns it off) or by cp.async (off): the same sums, so tests
// compare the two bit for bit.
void cuda_set_grouped_tma(Backend& cuda, bool on);
// The grouped FP8 products' tile form: 0 chosen by the rows' fill (the default), 1 row tiles,
// 2 token columns (GroupedFp8Form, cuda_grouped.h): the same sums, so tests compare them bit for bit.
void cuda_set_grouped_fp8_form(Backend& cuda, int form);
// Which grouped products walk several tiles a block, process-wide (grouped_set_walk,
// cuda_grouped.h): mode 0 none, 1 all, 2 the FP8 down products (default), -1 the default again;
// max_blocks > 0 caps those grids. The same sums, so tests compare the bits.
void cuda_set_grouped_walk(int mode, int max_blocks);
// A resident bank's experts at prefill as one grouped run with its tables made on the device
// (moe_experts, runs_moe_bank: on, the default; VIREO_BANK_GROUPED=0 turns it off) or the
// forward's grouping with the row counts read back (off). The same jobs and sums either way.
void cuda_set_bank_grouped(Backend& cuda, bool on);
// Decode's routed experts: each slot's down products begin once that slot's gate | up blocks have
// counted (on, the default; VIREO_MOE_SLOT_COUNTS=0 turns it off) or once the whole gate | up
// launch is done (off). The same kernels and sums either way.
void cuda_set_moe_slot_counts(Backend& cuda, bool on);
// Decode's FP8 gate | up for one token in blocks that stay, one an SM, each warp walking rows of
// every slot, the down products waiting for all of it (on, the default; VIREO_MOE_WALK=0 turns it
// off), or a block per 16 rows of a slot, counted per slot (off). Process-wide. The same sums.
void cuda_set_moe_walk(bool on);
// The down products after it walk too (VIREO_MOE_DOWN_WALK=0: a block per 32 row pairs of a slot);
// the same sums. moe_down_walk_kernel's launches so far (tests check that it is taken):
int64_t cuda_moe_down_walk_launches();
// The absorbed decode queries' FP8 W_UK staged in shared memory before the kernel's wait, while
// q_b streams (on, the default; VIREO_ABSORB_AHEAD=0 turns it off), or read after it (off).
// Process-wide. The same sums, so tests compare the two bit for bit.
void cuda_set_absorb_ahead(bool on);
int64_t cuda_absorb_staged_launches();  // the staged form's launches so far (tests check it is taken)
// The fast modes' decode attention over long key lists: scores, softmax and p x latent in one
// kernel, split pairs reduced in clusters (on, the default; VIREO_FUSED_ATTENTION=0 turns it off),
// or the scores and p x latent kernels (off). Process-wide. Near, not equal: the splits differ.
void cuda_set_fused_decode_attention(bool on);
// fast-fp8 products of 5-8 rows on FP8 weights of >= 8192 columns: x quantized once by act_quant
// and copied into each block (on, the default; VIREO_Q8_PREQUANT=0 turns it off), or quantized by
// every block itself (off). Process-wide. The same bits.
void cuda_set_q8_prequant(bool on);
// The fast modes' BF16 products of 2-8 rows (decode steps of several sequences) with at least
// `rows` output rows run on cuBLASLt with x rounded to bf16 (as the fast modes' prefill), where
// the f32-math GEMV is FMA-bound; 0: never. Default 4096, or VIREO_BF16_LT_DECODE=N.
void cuda_set_bf16_lt_decode_rows(Backend& cuda, int64_t rows);
// Bytes of the resident-bank prefill run's buffers now allocated (CudaBufferSizes::bank_run_bytes
// bounds them; the memory plan counts that bound).
uint64_t cuda_bank_run_buffer_bytes(Backend& cuda);
// Programmatic dependent launches for every CUDA kernel of the process (on, the default;
// VIREO_PDL=0 turns them off for A/B runs): a kernel's blocks are dispatched while the kernel
// before it runs and wait for it on the device. The same kernels and sums either way.
void cuda_set_programmatic_launch(bool on);
// Decode attention (absorbed path) and indexer kernels, each on (default) or off: the absorbed
// attention with all heads of a query per block, the indexer scores' blocked kernel with run-time
// positions, the register-resident top-k (cuda_decode_attention.cu); off: the kernels they
// replaced (kept as the fallback for shapes the fast ones do not take; tests run both).
void cuda_set_fast_decode(Backend& cuda, bool attention, bool indexer_scores, bool indexer_topk);
// Scratch bytes for an FP8 weight's bf16 hi + lo copy (prefill GEMMs dequantize in row chunks
// of this size, multiples of 128 rows; default 256 MiB). Tests set it small to cover chunking.
void cuda_set_fp8_chunk_bytes(Backend& cuda, size_t bytes);
// Op-level profile (`vireo bench --profile`): when on, every op is bracketed with CUDA events
// (the outermost waits for the stream first, unless `queued`: then nothing waits and the GPU's
// idle time between ops is measured too; cuda_profile.h), and time, calls and FLOPs accumulate
// per op name and per matmul dtype/shape/path. Turning it on or off clears it. Off: no syncs,
// nothing recorded.
void cuda_set_profile(Backend& cuda, bool on, bool queued = false);
// Marks where an external profiler started with `--profile-from-start off` (ncu, nsys) records:
// on = cudaProfilerStart, off = cudaProfilerStop. A no-op when no profiler is attached.
void cuda_profiler_range(Backend& cuda, bool on);
// The accumulated profile as a table sorted by time; `wall_ms` is the host time of the region.
std::string cuda_profile_report(Backend& cuda, double wall_ms);
#endif

inline bool cuda_compiled_in() {
#ifdef VIREO_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

// The backend a `--device` flag names ("cpu" or "cuda"); a one-line error when unavailable.
inline std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") {
#ifdef VIREO_HAVE_CUDA
    return make_cuda_backend();
#else
    fail("--device cuda: this vireo was built without CUDA (no nvcc at build time)");
#endif
  }
  fail("--device must be cpu or cuda, got '", device, "'");
}

}  // namespace vireo
