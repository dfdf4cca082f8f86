#pragma once
// Grouped expert products for prefill in the fast math modes (cuda_grouped.cu): a run of routed
// experts' SwiGLU MLPs over their gathered rows in four launches for the whole run, instead of
// ~5 per expert on the side lanes (see experts_add in cuda_backend.cu):
//   1. the run's rows of x gathered and rounded to bf16 once: xb [R, D];
//   2. every expert's gate | up on warpgroup MMA, one launch, with silu(gate) * up in the
//      epilogue (rounded to bf16 for the next product): h [R, I];
//   3. every expert's down, one launch, each row scaled by its routing weight: y [R, D];
//   4. the additions into out in job order, one launch (grouped_combine).
// FP8 experts (--math fast-fp8) take the same steps with e4m3 operands: the gathered rows and the
// SwiGLU output are quantized per (row, 128 columns) as act_quant does (cuda_fp8_gemm.h), the
// products run on e4m3 warpgroup MMA with each 128-deep k-block's partial sums scaled by the
// row's and the weight block's scales before they are added (DeepSeek's block-scaled GEMM), and
// the SwiGLU output goes through f32 (h32) to its quantization, as on the side lanes.
// Rows are numbered from the run's first (index and scale point there); job j owns rows
// [row0_j, row0_j + rows_j), consecutive, its tokens strictly increasing (moe_group's lists: a
// token's top-k experts are distinct; a dense job, the shared expert, lists every token once).
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace vireo::cuda {

// One expert of a grouped run (device pointers to its weights: gate, up [I, D], down [D, I], all
// BF16, or all e4m3 with their 128 x 128 block scales [out / 128, in / 128], row-major).
struct GroupedJob {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
  int32_t row0 = 0, rows = 0;
  const float* gate_s = nullptr;  // FP8 only
  const float* up_s = nullptr;
  const float* down_s = nullptr;
};

// Shapes and pointers the kernels take: D a multiple of 256, I of 128, weights 16-byte aligned,
// jobs' rows consecutive from 0; FP8: every scale pointer set.
bool grouped_experts_fit(int64_t D, int64_t I, const std::vector<GroupedJob>& jobs, bool fp8 = false);

// The device-side tables of a run (jobs, spans, tiles of both products), laid out by
// grouped_tables into one byte buffer the caller uploads (GroupedRun::table).
// With tma (and the driver's tensor-map encoder found), the tables also hold the TMA descriptors
// of the run's operands, and the products load their tiles through them (n_maps > 0).
// FP8 runs have TMA loads only (fp8 set, n_maps > 0).
struct GroupedTables {
  std::vector<char> bytes;
  bool fp8 = false;
  int n_jobs = 0, gate_up_tiles = 0, down_tiles = 0, n_maps = 0;
  int64_t rows = 0, row_tiles = 0;  // the jobs' rows, and the 128-row tiles they take (a product's column tile's)
  int64_t max_row_tiles = 0;        // grouped_tables_device: the row tiles its room holds
  size_t maps_at = 0, job_maps_at = 0, jobs_at = 0, spans_at = 0, gate_up_at = 0, down_at = 0;  // into bytes
};
struct GroupedTmaOperands {
  const void* xb = nullptr;  // the chunk's gathered rows [R, D], bf16 (FP8: e4m3)
  const void* h = nullptr;   // its SwiGLU output [R, I], bf16 (FP8: e4m3)
  int64_t R = 0;
};
bool grouped_tma_available();
// fp8: the jobs' weights are e4m3; needs tma (else the tables come back with n_maps == 0).
GroupedTables grouped_tables(const std::vector<GroupedJob>& jobs, int64_t D, int64_t I,
                             const GroupedTmaOperands* tma = nullptr, bool fp8 = false);

// Runs whose rows per job are known on the device only (moe_group's offsets over a resident
// bank: every expert a job, the shared expert a dense last job), so that nothing is read back:
// grouped_tables_device makes grouped_tables' maps and job tables for jobs of 0 rows, with room
// after them for the spans and the tiles of up to max_row_tiles row tiles (grouped_max_row_tiles);
// the caller uploads the bytes once. tma->R: the rows xb and h hold (their maps cover them all; a
// run of fewer rows loads stale rows past its end into tiles' rows that are never stored).
// grouped_device_tiles then writes one run's spans and tiles into the uploaded table on `st` and
// returns the tables to run it with: routed job j has offsets[j + 1] - offsets[j] rows from
// offsets[j] (offsets [n_routed + 1], on the device), a dense last job dense_rows rows after them;
// its launches are sized for the most tiles the rows can take (the blocks past the real tiles
// leave), and the FP8 form is chosen as if the routed rows were spread evenly.
int64_t grouped_max_row_tiles(int64_t routed_rows, int n_routed, int64_t dense_rows);
GroupedTables grouped_tables_device(const std::vector<GroupedJob>& jobs, int64_t max_row_tiles, int64_t D, int64_t I,
                                    const GroupedTmaOperands* tma, bool fp8);
GroupedTables grouped_device_tiles(const GroupedTables& made, char* table, const int32_t* offsets, int n_routed,
                                   int64_t routed_rows, int64_t dense_rows, int64_t D, int64_t I, cudaStream_t st);

// The four launches above on `st`. table: the uploaded GroupedTables bytes; xb [R, D] and h
// [R, I] bf16 scratch, y [R, D] f32 scratch; out [*, D] accumulates. FP8: xb and h hold e4m3
// rows, xs [D / 128, R] and hs [I / 128, R] their scales (act_quant's layout), and the gate | up
// product writes h32 [R, I] f32, which grouped_quantize_h turns into h and hs.
// The FP8 products' two tile forms (cuda_grouped.cu): 128 rows x 128 weight columns, or the
// operands' roles swapped, 128 weight rows x a tile's tokens rounded up to 16. Auto takes token
// columns where the jobs fill less than 60% of their row tiles (measured: faster at GLM-5's ~16
// rows an expert and at ~64, slower at ~256 and more).
enum class GroupedFp8Form { Auto, RowTiles, TokenColumns };
struct GroupedRun {
  GroupedFp8Form fp8_form = GroupedFp8Form::Auto;
  const float* x = nullptr;
  const int32_t* index = nullptr;
  const float* scale = nullptr;
  int64_t R = 0, D = 0, I = 0;
  const GroupedTables* tables = nullptr;
  const char* table = nullptr;
  void* xb = nullptr;
  void* h = nullptr;
  float* y = nullptr;
  float* out = nullptr;
  float* xs = nullptr;  // FP8 only
  float* hs = nullptr;
  float* h32 = nullptr;
  // Optional: x's row count, where known (a run with a dense job); grouped_combine then runs a
  // block a token instead of a block a row. FP8, optional: x already quantized, e4m3
  // [n_tokens, D] and scales [D / 128, n_tokens] (act_quant's layout); grouped_gather then copies
  // rows index[r] of them.
  int64_t n_tokens = 0;
  bool out_overwrite = false;  // with n_tokens and a dense job: out is written, not added to
  const uint8_t* xq = nullptr;
  const float* xqs = nullptr;
};
// index_out, scale_out [rows]: index, scale [routed] then (t, 1) for each t < rows - routed, the
// rows of a dense last job (a shared expert: every token, unscaled).
void grouped_dense_rows(const int32_t* index, const float* scale, int64_t routed, int64_t rows, int32_t* index_out,
                        float* scale_out, cudaStream_t st);
void grouped_gather(const GroupedRun& r, cudaStream_t st);
// FP8: grouped_gather quantizes the gathered rows into xb, xs (or copies them from xq, xqs);
// grouped_quantize_h turns h32 into h, hs.
void grouped_quantize_h(const GroupedRun& r, cudaStream_t st);
void grouped_gate_up(const GroupedRun& r, cudaStream_t st);
void grouped_down(const GroupedRun& r, cudaStream_t st);
void grouped_combine(const GroupedRun& r, cudaStream_t st);
// Which TMA products walk several tiles a block (cuda_grouped.cu, tma_grid), for the whole
// process: mode 0 none, 1 gate | up and down, 2 the FP8 down products (the default), -1 back to the
// default (or VIREO_GROUPED_PERSISTENT); max_blocks > 0 caps the walking grids below the SM count
// (tests: a few blocks walk many tiles). The same bits in every setting.
void grouped_set_walk(int mode, int max_blocks);

}  // namespace vireo::cuda
