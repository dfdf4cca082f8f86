#include "runtime/speculative.h"

#include <algorithm>

#include "core/error.h"

namespace vireo {

WarpedCandidates warped_distribution(const float* logits, int64_t vocab, const SampleRowArgs& a, SampleWorkspace& ws,
                                     std::vector<double>& prob) {
  const WarpedCandidates w = sample_warp(logits, vocab, a, ws);
  prob.assign(size_t(vocab), 0.0);
  for (int64_t i = 0; i < w.keep; ++i) prob[size_t(ws.ids[size_t(i)])] = double(ws.prob[size_t(i)]) / w.mass;
  return w;
}

namespace {

// The first x whose running sum of weight(x) (ascending x, positive terms only) exceeds
// u * total; the last positive x if rounding leaves the sum short.
template <class Weight>
int32_t draw_by_id(size_t n, double u, Weight weight) {
  double total = 0.0;
  for (size_t x = 0; x < n; ++x) total += weight(x);
  const double target = u * total;
  double run = 0.0;
  int32_t last = -1;
  for (size_t x = 0; x < n; ++x) {
    const double w = weight(x);
    if (w <= 0.0) continue;
    run += w;
    last = int32_t(x);
    if (run > target) return last;
  }
  return last;
}

}  // namespace

DraftVerdict verify_draft(const std::vector<double>& p, const std::vector<double>& q, int32_t draft, double u_keep,
                          double u_redraw) {
  if (p.size() != q.size() || p.empty()) fail("verify_draft: p has ", p.size(), " entries, q ", q.size());
  if (draft < 0 || size_t(draft) >= q.size() || !(q[size_t(draft)] > 0.0))
    fail("verify_draft: draft ", draft, " is not a token q can draw");
  if (!(u_keep >= 0 && u_keep < 1) || !(u_redraw >= 0 && u_redraw < 1))
    fail("verify_draft: uniforms must be in [0, 1), got ", u_keep, " and ", u_redraw);
  const double pd = p[size_t(draft)], qd = q[size_t(draft)];
  if (u_keep * qd < pd) return {true, draft};
  int32_t t = draw_by_id(p.size(), u_redraw, [&](size_t x) { return std::max(0.0, p[x] - q[x]); });
  if (t < 0) t = draw_by_id(p.size(), u_redraw, [&](size_t x) { return p[x]; });
  return {false, t};
}

int32_t draw_draft(const float* mtp_logits, int64_t vocab, Sampler& s, SampleWorkspace& ws, std::vector<double>& q) {
  const SampleRowArgs args = s.next_row_args();
  return sample_draw(warped_distribution(mtp_logits, vocab, args, ws, q), args.uniform, ws);
}

DraftVerdict judge_sampled_draft(const float* rows, int64_t vocab, int32_t draft, const std::vector<double>& q,
                                 Sampler& s, SampleWorkspace& ws, std::vector<double>& p, int32_t* bonus) {
  const SampleRowArgs args = s.next_row_args();
  warped_distribution(rows, vocab, args, ws, p);
  const DraftVerdict v = verify_draft(p, q, draft, args.uniform, s.next_uniform());
  if (v.kept) *bonus = s.sample(rows + vocab, vocab);
  return v;
}

}  // namespace vireo
