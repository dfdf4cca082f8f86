#pragma once
// Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): a draft token d drawn from a
// draft distribution q is kept with probability min(1, p(d) / q(d)); otherwise the token is drawn
// from max(0, p - q), normalized. The kept-or-redrawn token is distributed as p exactly, whatever
// q is; q only sets how often the draft is kept (sum over x of min(p(x), q(x))).
//
// p and q are the distributions the sampler draws from (sample_warp: temperature, top-k, top-p,
// min-p applied), dense over the vocabulary, so the target is what plain sampling draws from.
#include <cstdint>
#include <vector>

#include "backend/sampling.h"
#include "runtime/sampler.h"

namespace vireo {

// prob[x] (x < vocab) = the probability sample_row(logits, vocab, a) draws x (0 outside the kept
// candidates). Exact up to rounding of the sampler's own float probabilities. The candidates stay
// in ws: sample_draw(returned, a.uniform, ws) is sample_row's token.
WarpedCandidates warped_distribution(const float* logits, int64_t vocab, const SampleRowArgs& a, SampleWorkspace& ws,
                                     std::vector<double>& prob);

struct DraftVerdict {
  bool kept = false;
  int32_t token = -1;  // the draft if kept, else the redrawn token
};

// The verdict on `draft` (drawn from q) with two uniforms in [0, 1): u_keep decides keeping it
// (kept iff u_keep * q(d) < p(d)), u_redraw the token drawn from max(0, p - q) when not, by
// ascending token id. Where rounding leaves that residual empty, the token is drawn from p.
DraftVerdict verify_draft(const std::vector<double>& p, const std::vector<double>& q, int32_t draft, double u_keep,
                          double u_redraw);

// Sampled drafting's draws from a request's sampler, in the one order `generate` and the
// scheduler both take them (so a request's tokens are the same through either).
// The next draft from the MTP layer's logits (one row): q, then a draw from it.
int32_t draw_draft(const float* mtp_logits, int64_t vocab, Sampler& s, SampleWorkspace& ws, std::vector<double>& q);
// The verdict on `draft` from the verification step's logits ([2, vocab]): p at the draft's
// position from the first row, keep or redraw, and when kept *bonus, the second row's draw.
DraftVerdict judge_sampled_draft(const float* rows, int64_t vocab, int32_t draft, const std::vector<double>& q,
                                 Sampler& s, SampleWorkspace& ws, std::vector<double>& p, int32_t* bonus);

}  // namespace vireo
