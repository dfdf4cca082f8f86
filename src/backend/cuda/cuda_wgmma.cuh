#pragma once
// Hopper warpgroup MMA (wgmma, sm_90a) pieces shared by the kernels that use it: the prefill
// attention (cuda_prefill_fast.cu) and the grouped expert GEMMs (cuda_grouped.cu).
//
// Operands in shared memory are described by 64-bit descriptors; every kernel here stores its
// K-major tiles as [rows][64] bf16 "atoms" of 128-byte lines with the 128-byte swizzle (16-byte
// chunk c of line r at chunk c ^ (r % 8)), each atom 1024-byte aligned: SBO = 1024 (8-line
// groups), a k-step of 16 elements = 32 bytes along the line.
#include <cstdint>

namespace vireo::cuda {

// A wgmma shared-memory matrix descriptor, 128-byte swizzle; addresses and offsets in bytes.
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo & 0x3FFFFu) >> 4) << 16) |
         (uint64_t((sbo & 0x3FFFFu) >> 4) << 32) | (uint64_t(1) << 62);
}
// A descriptor moved by `bytes` (< 256 KB in all: the 14-bit address field cannot carry over):
// per-step operands are one 64-bit add from a base descriptor (ncu: the integer pipe was the
// busiest, 35%, with each descriptor built from its address).
__device__ __forceinline__ constexpr uint64_t desc_off(uint32_t bytes) { return uint64_t(bytes >> 4); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving reads or writes of accumulator registers across the
// asynchronous MMA's issue / wait (their values change in between without an instruction).
template <int N>
__device__ __forceinline__ void pin(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// d [64 x 64] (+)= A B^T: A [64 x 16] and B [64 x 16] K-major in shared memory; accumulate = 0
// overwrites d. d[nt][e]: this thread's elements in the m16n8 layout per warp (rows 16 w + g,
// + 8; columns 8 nt + 2 tq, + 1).
__device__ __forceinline__ void wgmma_ss_m64n64(float (&d)[8][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, "
      "1, 0, 0;\n}\n"
      : "+f"(d[0 + 0][0]), "+f"(d[0 + 0][1]), "+f"(d[0 + 0][2]), "+f"(d[0 + 0][3]), "+f"(d[0 + 1][0]),
        "+f"(d[0 + 1][1]), "+f"(d[0 + 1][2]), "+f"(d[0 + 1][3]), "+f"(d[0 + 2][0]), "+f"(d[0 + 2][1]),
        "+f"(d[0 + 2][2]), "+f"(d[0 + 2][3]), "+f"(d[0 + 3][0]), "+f"(d[0 + 3][1]), "+f"(d[0 + 3][2]),
        "+f"(d[0 + 3][3]), "+f"(d[0 + 4][0]), "+f"(d[0 + 4][1]), "+f"(d[0 + 4][2]), "+f"(d[0 + 4][3]),
        "+f"(d[0 + 5][0]), "+f"(d[0 + 5][1]), "+f"(d[0 + 5][2]), "+f"(d[0 + 5][3]), "+f"(d[0 + 6][0]),
        "+f"(d[0 + 6][1]), "+f"(d[0 + 6][2]), "+f"(d[0 + 6][3]), "+f"(d[0 + 7][0]), "+f"(d[0 + 7][1]),
        "+f"(d[0 + 7][2]), "+f"(d[0 + 7][3])
      : "l"(da), "l"(db), "r"(accumulate));
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// d [64 x 256] (+)= A B^T, as the m64n64 form with 32 column tiles of 8. Per k-step it reads A
// once for four times the columns: at the tensor cores' rate the m64n64 form needs ~128 bytes of
// shared memory a clock (the limit), this one ~80.
__device__ __forceinline__ void wgmma_ss_m64n256(float (&d)[32][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, "
      "%35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, "
      "%57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, "
      "%79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, "
      "%101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, "
      "%119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]),
        "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]),
        "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]),
        "+f"(d[17][2]), "+f"(d[17][3]), "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]),
        "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]),
        "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]),
        "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]), "+f"(d[24][1]),
        "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]),
        "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]),
        "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]),
        "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]),
        "+f"(d[31][2]), "+f"(d[31][3])
      : "l"(da), "l"(db), "r"(accumulate));
}

// The m64n128 forms' 64 accumulator operands: the register list in the instruction and the
// constraints binding d[16][4] to it, in the same order.
#define VIREO_WGMMA_R64                                                                                             \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define VIREO_WGMMA_D4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define VIREO_WGMMA_D16(d)                                                                                          \
  VIREO_WGMMA_D4(d, 0), VIREO_WGMMA_D4(d, 1), VIREO_WGMMA_D4(d, 2), VIREO_WGMMA_D4(d, 3), VIREO_WGMMA_D4(d, 4),     \
      VIREO_WGMMA_D4(d, 5), VIREO_WGMMA_D4(d, 6), VIREO_WGMMA_D4(d, 7), VIREO_WGMMA_D4(d, 8), VIREO_WGMMA_D4(d, 9), \
      VIREO_WGMMA_D4(d, 10), VIREO_WGMMA_D4(d, 11), VIREO_WGMMA_D4(d, 12), VIREO_WGMMA_D4(d, 13),                   \
      VIREO_WGMMA_D4(d, 14), VIREO_WGMMA_D4(d, 15)

// d [64 x 128] (+)= A B^T, bf16, as the m64n256 form with 16 column tiles of 8.
__device__ __forceinline__ void wgmma_ss_m64n128(float (&d)[16][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " VIREO_WGMMA_R64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : VIREO_WGMMA_D16(d)
      : "l"(da), "l"(db), "r"(accumulate));
}

// d [64 x N] (+)= A B^T with e4m3 operands (FP8, k-step 32), N = 16 .. 128 in steps of 16: A
// [64 x 32] and B [N x 32] K-major in shared memory, a row 128 bytes = 128 elements (one FP8
// scale block) in the same 128-byte swizzle as the bf16 tiles, so a k-step is again 32 bytes
// along the line. d's layout is the m64n64 form's, on d's first N / 8 column tiles (the rest is
// not touched): N = 128 for the grouped products' row tiles, less for their token columns.
template <int N>
__device__ __forceinline__ void wgmma_e4m3_m64nk32(float (&d)[16][4], uint64_t da, uint64_t db, int accumulate);
// The forms N = 16 K: the first K groups of 8 accumulator registers (in the instruction and as
// constraints), then the operands da, db and accumulate (%8K, %8K + 1, %8K + 2).
#define VIREO_WGMMA_REGS_1 "%0, %1, %2, %3, %4, %5, %6, %7"
#define VIREO_WGMMA_REGS_2 VIREO_WGMMA_REGS_1 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define VIREO_WGMMA_REGS_3 VIREO_WGMMA_REGS_2 ", %16, %17, %18, %19, %20, %21, %22, %23"
#define VIREO_WGMMA_REGS_4 VIREO_WGMMA_REGS_3 ", %24, %25, %26, %27, %28, %29, %30, %31"
#define VIREO_WGMMA_REGS_5 VIREO_WGMMA_REGS_4 ", %32, %33, %34, %35, %36, %37, %38, %39"
#define VIREO_WGMMA_REGS_6 VIREO_WGMMA_REGS_5 ", %40, %41, %42, %43, %44, %45, %46, %47"
#define VIREO_WGMMA_REGS_7 VIREO_WGMMA_REGS_6 ", %48, %49, %50, %51, %52, %53, %54, %55"
#define VIREO_WGMMA_REGS_8 VIREO_WGMMA_REGS_7 ", %56, %57, %58, %59, %60, %61, %62, %63"
#define VIREO_WGMMA_DS_1(d) VIREO_WGMMA_D4(d, 0), VIREO_WGMMA_D4(d, 1)
#define VIREO_WGMMA_DS_2(d) VIREO_WGMMA_DS_1(d), VIREO_WGMMA_D4(d, 2), VIREO_WGMMA_D4(d, 3)
#define VIREO_WGMMA_DS_3(d) VIREO_WGMMA_DS_2(d), VIREO_WGMMA_D4(d, 4), VIREO_WGMMA_D4(d, 5)
#define VIREO_WGMMA_DS_4(d) VIREO_WGMMA_DS_3(d), VIREO_WGMMA_D4(d, 6), VIREO_WGMMA_D4(d, 7)
#define VIREO_WGMMA_DS_5(d) VIREO_WGMMA_DS_4(d), VIREO_WGMMA_D4(d, 8), VIREO_WGMMA_D4(d, 9)
#define VIREO_WGMMA_DS_6(d) VIREO_WGMMA_DS_5(d), VIREO_WGMMA_D4(d, 10), VIREO_WGMMA_D4(d, 11)
#define VIREO_WGMMA_DS_7(d) VIREO_WGMMA_DS_6(d), VIREO_WGMMA_D4(d, 12), VIREO_WGMMA_D4(d, 13)
#define VIREO_WGMMA_DS_8(d) VIREO_WGMMA_DS_7(d), VIREO_WGMMA_D4(d, 14), VIREO_WGMMA_D4(d, 15)
#define VIREO_WGMMA_E4M3(N, K, A, B, ACC)                                                                             \
  template <>                                                                                                         \
  __device__ __forceinline__ void wgmma_e4m3_m64nk32<N>(float(&d)[16][4], uint64_t da, uint64_t db, int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACC ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N                 \
                 "k32.f32.e4m3.e4m3 {" VIREO_WGMMA_REGS_##K "}, " A ", " B ", p, 1, 1;\n}\n"                          \
                 : VIREO_WGMMA_DS_##K(d)                                                                              \
                 : "l"(da), "l"(db), "r"(accumulate));                                                                \
  }
VIREO_WGMMA_E4M3(16, 1, "%8", "%9", "%10")
VIREO_WGMMA_E4M3(32, 2, "%16", "%17", "%18")
VIREO_WGMMA_E4M3(48, 3, "%24", "%25", "%26")
VIREO_WGMMA_E4M3(64, 4, "%32", "%33", "%34")
VIREO_WGMMA_E4M3(80, 5, "%40", "%41", "%42")
VIREO_WGMMA_E4M3(96, 6, "%48", "%49", "%50")
VIREO_WGMMA_E4M3(112, 7, "%56", "%57", "%58")
VIREO_WGMMA_E4M3(128, 8, "%64", "%65", "%66")

// Shared-memory barriers (mbarrier) and tensor-memory-accelerator loads (TMA), for kernels whose
// operand tiles arrive by cp.async.bulk.tensor. Addresses are shared-window offsets (smem_u32).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// The barrier's current phase completes once the arrivals are in and `bytes` have landed.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nMBAR_WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra MBAR_WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// A tensor map written to global memory before the launch (by a copy, not this proxy) is read
// through the tensor-map proxy: order the two before its first use.
__device__ __forceinline__ void tensormap_acquire(const void* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}
// The box at (c0 innermost, c1) of a 2-D tensor map into shared memory at dst; its bytes count
// toward bar's transaction. Out-of-bounds elements land as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

}  // namespace vireo::cuda
