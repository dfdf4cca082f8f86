// The CUDA backend: the Backend ops on one GPU, checked op by op against the CPU reference
// (tests/test_cuda_ops.cpp). All work goes on one stream in order; the host waits only when it
// reads results back (copy_to_host*), so a forward step is one long queue of kernels.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "backend/cuda/cuda_attention.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_internal.h"

namespace vireo {

using namespace vireo::cuda;

namespace {

// --- element-wise and row kernels -------------------------------------------------------------

__global__ void fill_kernel(float* y, float v, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = v;
}
__global__ void add_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] += x[i];
}
__global__ void scale_kernel(float* y, float s, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] *= s;
}
__global__ void swiglu_kernel(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void embed_kernel(DevW table, const int32_t* ids, float* out) {
  const int64_t t = blockIdx.x, n = table.in, id = ids[t];
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) out[t * n + j] = wget_rt(table, id, j);
}

__global__ void rms_norm_kernel(const float* x, int64_t xs, int64_t n, const float* w, float eps, float* y,
                                int64_t ys) {
  const float* xr = x + int64_t(blockIdx.x) * xs;
  float* yr = y + int64_t(blockIdx.x) * ys;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / float(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = w[i] * (xr[i] * inv);
}

__global__ void layer_norm_kernel(const float* x, int64_t n, const float* w, const float* b, float eps, float* y) {
  const float* xr = x + int64_t(blockIdx.x) * n;
  float* yr = y + int64_t(blockIdx.x) * n;
  __shared__ double red[256];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
  red[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double m = 0;
    for (int i = 0; i < int(blockDim.x); ++i) m += red[i];
    red[0] = m / double(n);
  }
  __syncthreads();
  const double mean = red[0];
  __syncthreads();
  double v = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v += (xr[i] - mean) * (xr[i] - mean);
  red[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double m = 0;
    for (int i = 0; i < int(blockDim.x); ++i) m += red[i];
    red[0] = m / double(n);
  }
  __syncthreads();
  const float inv = float(1.0 / sqrt(red[0] + eps));
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = float(xr[i] - mean) * inv * w[i] + b[i];
}

// One block per (token, head): every thread reads its pair, then all write (in place).
__global__ void rope_kernel(float* x, int64_t H, int64_t ts, int64_t hs, int64_t offset, int64_t width,
                            const float* cs, int interleaved) {
  const int64_t t = blockIdx.x / H, h = blockIdx.x % H, half = width / 2, i = threadIdx.x;
  float* v = x + t * ts + h * hs + offset;
  const float* c = cs + t * width;
  float a = 0, b = 0;
  if (i < half) {
    a = interleaved ? v[2 * i] : v[i];
    b = interleaved ? v[2 * i + 1] : v[half + i];
  }
  __syncthreads();
  if (i < half) {
    const float co = c[2 * i], si = c[2 * i + 1];
    v[i] = a * co - b * si;
    v[half + i] = b * co + a * si;
  }
}

__global__ void gather_rows_kernel(const float* x, const int32_t* index, int64_t n, float* rows) {
  const int64_t i = blockIdx.x, src = index[i];
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) rows[i * n + j] = x[src * n + j];
}
// Column j of every row, in order of i: repeated indices accumulate in the reference's order.
__global__ void scatter_add_rows_kernel(float* y, const int32_t* index, const float* s, const float* rows, int64_t m,
                                        int64_t n) {
  const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  for (int64_t i = 0; i < m; ++i) {  // unfused, as the reference: bit-identical sums
    float& yv = y[int64_t(index[i]) * n + j];
    yv = __fadd_rn(yv, __fmul_rn(s[i], rows[i * n + j]));
  }
}

// Stable counting sort of the N * K routing slots by expert, in one block of W warps. Warp w owns
// the contiguous slot range [w * seg, (w + 1) * seg) and walks it 32 slots at a time; lanes with
// the same expert find each other with __match_any_sync, so a slot's place is fixed by the counts
// of (earlier warps, earlier steps, lower lanes): no atomics, deterministic, stable.
// Shared: cnt [W, E] (per-warp counts, then per-warp write cursors), total [E].
__global__ void moe_group_kernel(const int32_t* __restrict__ ids, const float* __restrict__ weights, int64_t S,
                                 int K, int E, int64_t seg, int32_t* __restrict__ offsets,
                                 int32_t* __restrict__ token_of, float* __restrict__ weight_of) {
  extern __shared__ int32_t sh[];
  const int W = int(blockDim.x >> 5), w = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  int32_t* cnt = sh;
  int32_t* total = sh + int64_t(W) * E;
  for (int64_t i = threadIdx.x; i < int64_t(W) * E; i += blockDim.x) cnt[i] = 0;
  __syncthreads();
  const int64_t lo = int64_t(w) * seg, hi = min(S, lo + seg);
  const unsigned lt = (1u << lane) - 1u;
  int32_t* mine = cnt + int64_t(w) * E;
  for (int64_t b = lo; b < hi; b += 32) {  // count
    const int64_t s = b + lane;
    const int e = s < hi ? ids[s] : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && (same & lt) == 0) mine[e] += __popc(same);
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {  // per-warp exclusive prefix, per expert
    int32_t run = 0;
    for (int v = 0; v < W; ++v) {
      const int32_t c = cnt[int64_t(v) * E + e];
      cnt[int64_t(v) * E + e] = run;
      run += c;
    }
    total[e] = run;
  }
  __syncthreads();
  if (w == 0) {  // exclusive scan of the totals over experts -> offsets
    int32_t carry = 0;
    for (int b = 0; b < E; b += 32) {
      const int e = b + lane;
      const int32_t v = e < E ? total[e] : 0;
      int32_t inc = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t u = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += u;
      }
      if (e < E) {
        total[e] = carry + inc - v;
        offsets[e] = carry + inc - v;
      }
      carry += __shfl_sync(0xffffffffu, inc, 31);
    }
    if (lane == 0) offsets[E] = carry;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < int64_t(W) * E; i += blockDim.x) cnt[i] += total[i % E];
  __syncthreads();
  for (int64_t b = lo; b < hi; b += 32) {  // place, in slot order
    const int64_t s = b + lane;
    const int e = s < hi ? ids[s] : -1;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    if (e >= 0) {
      const int32_t at = mine[e] + __popc(same & lt);
      token_of[at] = int32_t(s / K);
      weight_of[at] = weights[s];
    }
    __syncwarp();
    if (e >= 0 && (same & lt) == 0) mine[e] += __popc(same);
    __syncwarp();
  }
}

__global__ void random_bf16_kernel(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(float(h & 0xffff) / 65536.0f - 0.5f);
  }
}

unsigned grid_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + 255) / 256, 1, 65536)); }

int dtype_code(DType d) {
  switch (d) {
    case DType::F32: return W_F32;
    case DType::BF16: return W_BF16;
    case DType::F16: return W_F16;
    case DType::F8_E4M3: return W_FP8;
    default: fail("cuda: unsupported weight dtype ", dtype_name(d));
  }
}

template <typename T>
std::shared_ptr<T> device_alloc(size_t n) {
  void* p = nullptr;
  const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) fail("cuda: out of device memory allocating ", bytes, " bytes (", cudaGetErrorString(e), ")");
  // cudaMemset runs on the legacy default stream, which does not order against the backend's
  // non-blocking stream: without the wait, a copy or kernel queued on that stream right after
  // allocation could run first and then be zeroed (seen as a flaky all-zero matmul input).
  VIREO_CUDA_CHECK(cudaMemset(p, 0, bytes));
  VIREO_CUDA_CHECK(cudaDeviceSynchronize());
  return std::shared_ptr<T>(static_cast<T*>(p), [](T* q) { cudaFree(q); });
}

// A device buffer that only grows (scratch for one op at a time on the backend's stream).
struct Scratch {
  std::shared_ptr<char> buf;
  size_t bytes = 0;
  template <typename T> T* get(size_t n) {
    const size_t need = std::max<size_t>(n, 1) * sizeof(T);
    if (need > bytes) {
      buf.reset();
      buf = device_alloc<char>(need);
      bytes = need;
    }
    return reinterpret_cast<T*>(buf.get());
  }
};

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    VIREO_CUDA_CHECK(cudaSetDevice(0));
    VIREO_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    VIREO_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, 0));
    if (cublasLtCreate(&lt_) != CUBLAS_STATUS_SUCCESS) fail("cuda: cublasLtCreate failed");
    lt_ws_bytes_ = size_t(32) << 20;
    lt_ws_ = device_alloc<char>(lt_ws_bytes_);
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    if (lt_) cublasLtDestroy(lt_);
    cudaStreamDestroy(stream_);
  }
  const char* name() const override { return "cuda"; }
  cudaStream_t stream() const { return stream_; }
  uint64_t weight_bytes() const { return weight_bytes_; }
  void set_gemm_mode(CudaGemmMode m) { mode_ = m; }
  cublasLtHandle_t lt() const { return lt_; }
  void* lt_ws() const { return lt_ws_.get(); }
  size_t lt_ws_bytes() const { return lt_ws_bytes_; }

  std::shared_ptr<float> alloc_f32(size_t n) override { return device_alloc<float>(n); }
  std::shared_ptr<int32_t> alloc_i32(size_t n) override { return device_alloc<int32_t>(n); }
  void copy_to_host(float* dst, const float* src, size_t n) override { d2h(dst, src, n * 4); }
  void copy_from_host(float* dst, const float* src, size_t n) override { h2d(dst, src, n * 4); }
  void copy_to_host_i32(int32_t* dst, const int32_t* src, size_t n) override { d2h(dst, src, n * 4); }
  void copy_from_host_i32(int32_t* dst, const int32_t* src, size_t n) override { h2d(dst, src, n * 4); }

  // Always uploads (the caller owns the host bytes and may reuse their address later); the copy
  // is also remembered under the host address for matmuls that pass the host weight itself.
  Weight upload_weight(const Weight& w) override {
    if (w.w.device == Device::CUDA) return w;
    dtype_code(w.w.dtype);
    Weight d = w;
    d.w.data = upload_bytes(w.w.data, w.w.nbytes());
    d.w.device = Device::CUDA;
    if (w.w.dtype == DType::F8_E4M3) {
      const int64_t so = (w.out() + 127) / 128, si = (w.in() + 127) / 128;
      const Tensor& s = w.scale_inv;
      if (s.empty() || s.dtype != DType::F32 || s.ndim != 2 || s.dim(0) != so || s.dim(1) != si)
        fail("cuda: FP8 weight ", w.w.shape_str(), " needs F32 block scales [", so, ", ", si, "], got ",
             s.empty() ? std::string("none") : s.shape_str());
      d.scale_inv.data = upload_bytes(s.data, s.nbytes());
      d.scale_inv.device = Device::CUDA;
    }
    uploaded_[w.w.data] = d;
    return d;
  }
  // A host weight's device copy: the remembered one if it matches (same dtype and shape), else a
  // fresh upload.
  Weight resident(const Weight& w) {
    auto it = uploaded_.find(w.w.data);
    if (it != uploaded_.end()) {
      const Tensor& d = it->second.w;
      if (d.dtype == w.w.dtype && d.ndim == w.w.ndim && d.numel() == w.w.numel() && d.dim(0) == w.w.dim(0))
        return it->second;
    }
    return upload_weight(w);
  }

  void copy_rows(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t n) override {
    if (rows <= 0 || n <= 0) return;
    VIREO_CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(ds) * 4, src, size_t(ss) * 4, size_t(n) * 4, size_t(rows),
                                       cudaMemcpyDeviceToDevice, stream_));
  }
  void fill(float* y, float v, int64_t n) override {
    if (n <= 0) return;
    fill_kernel<<<grid_for(n), 256, 0, stream_>>>(y, v, n);
    VIREO_CUDA_LAUNCHED();
  }

  void embed(const Weight& table, const int32_t* ids, int64_t T, float* out) override {
    for (int64_t t = 0; t < T; ++t)
      if (ids[t] < 0 || ids[t] >= table.out())
        fail("token id ", ids[t], " is out of range (vocab size ", table.out(), ")");
    int32_t* dids = ids_.get<int32_t>(size_t(T));
    h2d(dids, ids, size_t(T) * 4);
    embed_kernel<<<unsigned(T), 256, 0, stream_>>>(devw(table), dids, out);
    VIREO_CUDA_LAUNCHED();
  }

  void rms_norm(const float* x, int64_t xs, int64_t T, int64_t n, const float* w, float eps, float* y,
                int64_t ys) override {
    if (T <= 0) return;
    rms_norm_kernel<<<unsigned(T), n >= 2048 ? 512 : 256, 0, stream_>>>(x, xs, n, w, eps, y, ys);
    VIREO_CUDA_LAUNCHED();
  }
  void layer_norm(const float* x, int64_t T, int64_t n, const float* w, const float* b, float eps,
                  float* y) override {
    if (T <= 0) return;
    layer_norm_kernel<<<unsigned(T), 256, 0, stream_>>>(x, n, w, b, eps, y);
    VIREO_CUDA_LAUNCHED();
  }

  void matmul(const float* x, int64_t T, const Weight& wt, float* y) override {
    if (T <= 0) return;
    const DevW w = devw(wt);
    if (T <= 8) {
      matmul_small(x, T, w, y, stream_, sms_);
    } else if (!(w.dt == W_BF16 && mode_ != CudaGemmMode::Simt && lt_bf16(x, T, w, y))) {
      matmul_simt(x, T, w, y, stream_);
    }
    VIREO_CUDA_LAUNCHED();
  }

  void rope(float* x, int64_t T, int64_t H, int64_t ts, int64_t hs, int64_t offset, int64_t width, const float* cs,
            RopeKind kind) override {
    if (T <= 0 || H <= 0) return;
    const int64_t half = width / 2;
    if (half > 1024) fail("rope: width ", width, " is too wide");
    const unsigned threads = unsigned((half + 31) / 32 * 32);
    rope_kernel<<<unsigned(T * H), threads, 0, stream_>>>(x, H, ts, hs, offset, width, cs,
                                                          kind == RopeKind::Interleaved);
    VIREO_CUDA_LAUNCHED();
  }

  void add(float* y, const float* x, int64_t n) override {
    if (n <= 0) return;
    add_kernel<<<grid_for(n), 256, 0, stream_>>>(y, x, n);
    VIREO_CUDA_LAUNCHED();
  }
  void scale(float* y, float s, int64_t n) override {
    if (n <= 0) return;
    scale_kernel<<<grid_for(n), 256, 0, stream_>>>(y, s, n);
    VIREO_CUDA_LAUNCHED();
  }
  void swiglu(const float* gate, const float* up, float* out, int64_t n) override {
    if (n <= 0) return;
    swiglu_kernel<<<grid_for(n), 256, 0, stream_>>>(gate, up, out, n);
    VIREO_CUDA_LAUNCHED();
  }

  void mla_attention(const MlaAttentionArgs& a) override {
    if (a.T <= 0) return;
    if (a.absorbed) attention_absorbed(a);
    else attention_reconstructed(a);
  }

  void indexer_select(const IndexerArgs& a) override {
    if (a.T <= 0) return;
    float* scores = scores_.get<float>(size_t(a.T * a.n_keys));
    indexer_scores(a.q, a.weights, a.keys, a.T, a.n_heads, a.head_dim, a.n_keys, a.pos0, a.topk, a.scale, scores,
                   stream_);
    indexer_topk(scores, a.T, a.n_keys, a.pos0, a.topk, a.selected, a.counts, stream_);
  }

  void moe_route(const float* x, int64_t T, const RouterArgs& a, int32_t* ids, float* weights) override {
    if (T <= 0) return;
    float* logits = route_.get<float>(size_t(T * a.n_experts));
    matmul(x, T, *a.gate, logits);
    cuda::moe_route(logits, T, a.n_experts, a.n_group, a.topk_group, a.top_k, a.bias, a.norm_topk_prob,
                    a.routed_scaling_factor, ids, weights, stream_);
  }

  void moe_group(const int32_t* ids, const float* weights, int64_t N, int top_k, int n_experts, int32_t* offsets,
                 int32_t* token_of, float* weight_of) override {
    if (n_experts <= 0) fail("moe_group: no experts");
    const int64_t S = N * top_k;
    // Warps: one per 32 slots up to 32, fewer when per-warp counts for many experts would not fit
    // in 48 KiB of shared memory.
    const int64_t fit = (int64_t(48) * 1024 / 4 - n_experts) / n_experts;
    if (fit < 1) fail("moe_group: ", n_experts, " experts do not fit in shared memory");
    const int W = int(std::max<int64_t>(1, std::min<int64_t>({32, fit, (S + 31) / 32})));
    const int64_t seg = S > 0 ? (S + W - 1) / W : 0;
    const size_t smem = size_t(int64_t(W + 1) * n_experts) * 4;
    moe_group_kernel<<<1, unsigned(32 * W), smem, stream_>>>(ids, weights, S, top_k, n_experts, seg, offsets,
                                                               token_of, weight_of);
    VIREO_CUDA_LAUNCHED();
  }

  void gather_rows(const float* x, const int32_t* index, int64_t m, int64_t n, float* rows) override {
    if (m <= 0) return;
    gather_rows_kernel<<<unsigned(m), 256, 0, stream_>>>(x, index, n, rows);
    VIREO_CUDA_LAUNCHED();
  }
  void scatter_add_rows(float* y, const int32_t* index, const float* s, const float* rows, int64_t m,
                        int64_t n) override {
    if (m <= 0) return;
    scatter_add_rows_kernel<<<unsigned((n + 127) / 128), 128, 0, stream_>>>(y, index, s, rows, m, n);
    VIREO_CUDA_LAUNCHED();
  }

 private:
  void d2h(void* dst, const void* src, size_t bytes) {
    if (!bytes) return;
    VIREO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    VIREO_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  // From pageable host memory the copy is staged before cudaMemcpyAsync returns, so the caller
  // may free `src` right away (the forward pass passes short-lived vectors).
  void h2d(void* dst, const void* src, size_t bytes) {
    if (!bytes) return;
    VIREO_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  }

  void* upload_bytes(const void* src, size_t bytes) {
    auto buf = device_alloc<char>(bytes);
    VIREO_CUDA_CHECK(cudaMemcpy(buf.get(), src, bytes, cudaMemcpyHostToDevice));
    owned_.push_back(buf);
    weight_bytes_ += bytes;
    return buf.get();
  }

  // The device view of a weight: uploaded ones as they are; host ones (routed experts bound
  // straight from the mapped checkpoint) are uploaded on first use and kept, keyed by their
  // host address, which is stable for the resident expert store.
  DevW devw(const Weight& wt) {
    const Weight w = wt.w.device == Device::CUDA ? wt : resident(wt);
    if (w.w.ndim != 2) fail("matmul: weight must be 2-D, got ", w.w.shape_str());
    DevW d;
    d.w = w.w.data;
    d.s = w.scale_inv.empty() ? nullptr : w.scale_inv.f32();
    d.out = w.out();
    d.in = w.in();
    d.s_cols = (d.in + 127) / 128;
    d.dt = dtype_code(w.w.dtype);
    return d;
  }

  bool lt_bf16(const float* x, int64_t T, const DevW& w, float* y) {
    if (w.in % 8 != 0 || w.out % 4 != 0 || reinterpret_cast<uintptr_t>(y) % 16 != 0) return false;
    const bool split = mode_ == CudaGemmMode::Split;
    char* buf = xbf16_.get<char>(size_t(T * w.in) * 2 * (split ? 2 : 1));
    void* hi = buf;
    void* lo = split ? buf + size_t(T * w.in) * 2 : nullptr;
    split_bf16(x, T * w.in, hi, lo, stream_);
    bool ok = lt_matmul(lt_, lt_ws_.get(), lt_ws_bytes_, stream_, w.out, T, w.in, w.w, CUDA_R_16BF, hi, CUDA_R_16BF,
                        y, CUDA_R_32F, 1.0f, 0.0f);
    if (ok && split)
      ok = lt_matmul(lt_, lt_ws_.get(), lt_ws_bytes_, stream_, w.out, T, w.in, w.w, CUDA_R_16BF, lo, CUDA_R_16BF, y,
                     CUDA_R_32F, 1.0f, 1.0f);
    return ok;
  }

  void attention_absorbed(const MlaAttentionArgs& a) {
    const int64_t H = a.n_heads, L = a.kv_lora, qw = a.qk_nope + a.qk_rope, hw = a.qk_nope + a.v_dim;
    const DevW kvb = devw(*a.kv_b);
    float* qlat = qlat_.get<float>(size_t(a.T * H * L));
    absorb_q(a.q, a.T, H, qw, a.qk_nope, kvb, hw, L, qlat, stream_);
    const int64_t max_keys = a.selection.keys ? std::min(a.selection.stride, a.n_keys) : a.n_keys;
    DecodeAttnArgs d;
    d.qlat = qlat;
    d.q = a.q;
    d.T = a.T;
    d.H = H;
    d.qw = qw;
    d.nope = a.qk_nope;
    d.L = L;
    d.vd = a.v_dim;
    d.hw = hw;
    d.kv = a.kv;
    d.kvw = L + a.qk_rope;
    d.pos0 = a.pos0;
    d.sel = a.selection.keys;
    d.counts = a.selection.counts;
    d.sel_stride = a.selection.stride;
    d.scale = a.scale;
    d.nsplit = decode_splits(max_keys);
    const size_t parts = size_t(a.T * H * d.nsplit);
    float* buf = part_.get<float>(parts * size_t(L + 2));
    d.opart = buf;
    d.mpart = buf + parts * size_t(L);
    d.lpart = d.mpart + parts;
    d.kvb = kvb;
    d.out = a.out;
    mla_decode(d, stream_);
  }

  void attention_reconstructed(const MlaAttentionArgs& a) {
    const int64_t H = a.n_heads, nope = a.qk_nope, rope = a.qk_rope, vd = a.v_dim, L = a.kv_lora;
    const int64_t N = a.n_keys, kvw = L + rope, qw = nope + rope, hw = nope + vd;
    float* latent = latent_.get<float>(size_t(N * L));
    copy_rows(latent, L, a.kv, kvw, N, L);
    float* kvx = kvx_.get<float>(size_t(N * H * hw));
    matmul(latent, N, *a.kv_b, kvx);
    PrefillAttnArgs p;
    p.q = a.q;
    p.T = a.T;
    p.H = H;
    p.qw = qw;
    p.nope = nope;
    p.vd = vd;
    p.L = L;
    p.kv = a.kv;
    p.kvw = kvw;
    p.kvx = kvx;
    p.hw = hw;
    p.n_keys = N;
    p.pos0 = a.pos0;
    p.scale = a.scale;
    p.out = a.out;
    if (a.selection.keys) {
      p.mwords = (N + 31) / 32;
      uint32_t* mask = mask_.get<uint32_t>(size_t(a.T * p.mwords));
      build_mask(a.selection.keys, a.selection.counts, a.T, a.selection.stride, p.mwords, mask, stream_);
      p.mask = mask;
    }
    mla_prefill(p, stream_);
  }

  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  std::shared_ptr<char> lt_ws_;
  size_t lt_ws_bytes_ = 0;
  int sms_ = 132;
  CudaGemmMode mode_ = CudaGemmMode::Split;
  std::vector<std::shared_ptr<char>> owned_;
  uint64_t weight_bytes_ = 0;  // bytes of weights uploaded (owned_)
  std::unordered_map<const void*, Weight> uploaded_;
  Scratch ids_, scores_, route_, xbf16_, qlat_, part_, latent_, kvx_, mask_;
};

CudaBackend& as_cuda(Backend& b) {
  auto* c = dynamic_cast<CudaBackend*>(&b);
  if (!c) fail("internal error: not the CUDA backend");
  return *c;
}

}  // namespace

bool cuda_device_present(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(e);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device found";
    return false;
  }
  return true;
}

std::unique_ptr<Backend> make_cuda_backend() {
  std::string why;
  if (!cuda_device_present(&why)) fail("--device cuda: ", why);
  return std::make_unique<CudaBackend>();
}

cudaStream_t cuda::compute_stream_of(Backend& b) { return as_cuda(b).stream(); }

uint64_t cuda_weight_bytes(Backend& b) { return as_cuda(b).weight_bytes(); }

void cuda_synchronize(Backend& b) { VIREO_CUDA_CHECK(cudaStreamSynchronize(as_cuda(b).stream())); }

void cuda_set_gemm_mode(Backend& b, CudaGemmMode mode) { as_cuda(b).set_gemm_mode(mode); }

double cuda_measure_copy_gbs(Backend& b) {
  CudaBackend& c = as_cuda(b);
  const size_t bytes = size_t(1) << 31;  // 2 GiB each way: far past the 60 MB L2
  auto src = device_alloc<char>(bytes), dst = device_alloc<char>(bytes);
  cudaEvent_t e0, e1;
  VIREO_CUDA_CHECK(cudaEventCreate(&e0));
  VIREO_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    VIREO_CUDA_CHECK(cudaEventRecord(e0, c.stream()));
    VIREO_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, c.stream()));
    VIREO_CUDA_CHECK(cudaEventRecord(e1, c.stream()));
    VIREO_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    VIREO_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return 2.0 * double(bytes) / (double(ms[ms.size() / 2]) * 1e-3) / 1e9;
}

double cuda_measure_bf16_gemm_tflops(Backend& b, int n) {
  CudaBackend& c = as_cuda(b);
  const size_t nn = size_t(n) * size_t(n);
  auto A = device_alloc<__nv_bfloat16>(nn), B = device_alloc<__nv_bfloat16>(nn), D = device_alloc<__nv_bfloat16>(nn);
  random_bf16_kernel<<<4096, 256, 0, c.stream()>>>(A.get(), int64_t(nn), 1u);
  random_bf16_kernel<<<4096, 256, 0, c.stream()>>>(B.get(), int64_t(nn), 2u);
  VIREO_CUDA_LAUNCHED();
  cudaEvent_t e0, e1;
  VIREO_CUDA_CHECK(cudaEventCreate(&e0));
  VIREO_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 13; ++i) {
    VIREO_CUDA_CHECK(cudaEventRecord(e0, c.stream()));
    if (!lt_matmul(c.lt(), c.lt_ws(), c.lt_ws_bytes(), c.stream(), n, n, n, A.get(), CUDA_R_16BF, B.get(),
                   CUDA_R_16BF, D.get(), CUDA_R_16BF, 1.0f, 0.0f))
      fail("cuda: cuBLASLt has no bf16 GEMM for ", n, "^3");
    VIREO_CUDA_CHECK(cudaEventRecord(e1, c.stream()));
    VIREO_CUDA_CHECK(cudaEventSynchronize(e1));
    float t = 0;
    VIREO_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 3) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return 2.0 * double(n) * double(n) * double(n) / (double(ms[ms.size() / 2]) * 1e-3) / 1e12;
}

}  // namespace vireo
