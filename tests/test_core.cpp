#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

using namespace vireo;

// An error's message is one line whatever it quotes: control characters become escapes, every other
// byte (UTF-8 included) stays.
TEST(Error, MessagesAreOneLine) {
  EXPECT_EQ(std::string(Error("role 'a\nb'\r\tx\x01\x7f \xc3\xa9 \\n").what()),
            "role 'a\\nb'\\r\\tx\\x01\\x7f \xc3\xa9 \\n");
  try {
    fail("tensor '", std::string("w\n1"), "': bad dtype");
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "tensor 'w\\n1': bad dtype");
  }
}

TEST(DType, Bf16RoundTripAndRounding) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.5f)), 1.5f);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down to 1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
}

TEST(DType, F16AllCodesRoundTrip) {
  for (uint32_t c = 0; c < 65536; ++c) {
    float f = f16_to_f32(uint16_t(c));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), c) << c;
  }
}

TEST(DType, Fp8E4M3KnownValues) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_to_f32(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(0x7f)));
  for (int c = 0; c < 256; ++c) {
    float f = fp8_e4m3_to_f32(uint8_t(c));
    if (std::isnan(f) || c == 0x80) continue;
    ASSERT_EQ(f32_to_fp8_e4m3(f), c) << c;
  }
  EXPECT_EQ(f32_to_fp8_e4m3(1000.0f), 0x7e);  // saturates
}

// f32 -> e4m3 by bits against the definition: the nearest of the 127 non-negative codes, ties
// to the even code, saturating at 448, NaN to 0x7f. Every code, the midpoints between neighbours
// (ties) and a float either side of each, and 4096 mantissas at every exponent from 2^-12 to 2^8.
TEST(DType, Fp8E4M3RoundingEqualsNearestSearch) {
  auto nearest = [](float f) -> uint8_t {
    if (std::isnan(f)) return 0x7f;
    const uint8_t sign = std::signbit(f) ? 0x80 : 0;
    const float a = std::fabs(f);
    if (a >= 448.0f) return sign | 0x7e;
    uint8_t best = 0;
    float best_err = INFINITY;
    for (uint8_t c = 0; c < 0x7f; ++c) {
      const float err = std::fabs(fp8_e4m3_to_f32(c) - a);
      if (err < best_err || (err == best_err && (c & 1) == 0)) best = c, best_err = err;
    }
    return sign | best;
  };
  std::vector<float> probe = {0.0f, -0.0f, 448.0f, 449.0f, 464.0f, 1e30f, INFINITY, -INFINITY, NAN, 1e-45f};
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = fp8_e4m3_to_f32(uint8_t(c)), hi = fp8_e4m3_to_f32(uint8_t(c + 1));
    const float mid = 0.5f * (lo + hi);
    probe.insert(probe.end(), {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)});
  }
  for (uint32_t i = 0; i < 21u * 4096u; ++i)
    probe.push_back(std::ldexp(1.0f + float(i % 4096) / 4096.0f, int(i / 4096) - 12));
  const size_t n = probe.size();
  for (size_t i = 0; i < n; ++i) probe.push_back(-probe[i]);
  for (float f : probe) ASSERT_EQ(f32_to_fp8_e4m3(f), nearest(f)) << f;
}

TEST(ThreadPool, PartitionCoversEveryIndexOnce) {
  ThreadPool pool(3);
  for (int64_t n : {1, 2, 7, 128, 1000}) {
    std::vector<int> hits(n, 0);
    pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    }, 4);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << "n=" << n << " i=" << i;
  }
}

// The hand-over between the caller and the workers, spinning or asleep: many short jobs back to
// back (the workers spin between them), jobs after the workers fell asleep (a pause longer than
// the spin), and a pool destroyed while its workers sleep. A lost wake-up hangs the test.
TEST(ThreadPool, JobsBackToBackAndAfterSleepingAllComplete) {
  for (int threads : {2, 4}) {
    ThreadPool pool(threads);
    std::vector<int64_t> sums(64, 0);
    for (int round = 0; round < 2000; ++round) {
      std::atomic<int64_t> total{0};
      pool.parallel_for(64, [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) sums[size_t(i)] += i;
        total += e - b;
      });
      ASSERT_EQ(total.load(), 64) << "round " << round;
      if (round % 500 == 499) std::this_thread::sleep_for(std::chrono::microseconds(3 * ThreadPool::kSpinMicros));
    }
    for (int64_t i = 0; i < 64; ++i) EXPECT_EQ(sums[size_t(i)], 2000 * i);
    std::this_thread::sleep_for(std::chrono::microseconds(3 * ThreadPool::kSpinMicros));  // asleep when destroyed
  }
}
