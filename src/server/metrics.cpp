#include "server/metrics.h"

#include <algorithm>
#include <cstdio>

namespace vireo::server {

namespace {
std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
}  // namespace

void Histogram::observe(double v) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t b = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  ++counts_[b];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  std::lock_guard<std::mutex> lock(mu_);
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
  out += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
}

Metrics::Metrics()
    : ttft_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      itl_({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}) {}

void Metrics::request(int http_status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++by_status_[http_status];
}

void Metrics::finished(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  ++by_reason_[reason];
}

std::string Metrics::render(const SchedulerStats* s) const {
  std::string out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out += "# HELP vireo_requests_total HTTP requests answered, by status code.\n# TYPE vireo_requests_total counter\n";
    for (auto& [code, n] : by_status_)
      out += "vireo_requests_total{status=\"" + std::to_string(code) + "\"} " + std::to_string(n) + "\n";
    out += "# HELP vireo_requests_finished_total Generation requests ended, by reason.\n"
           "# TYPE vireo_requests_finished_total counter\n";
    for (auto& [reason, n] : by_reason_)
      out += "vireo_requests_finished_total{reason=\"" + reason + "\"} " + std::to_string(n) + "\n";
  }
  out += "# HELP vireo_prompt_tokens_total Prompt tokens of accepted requests.\n# TYPE vireo_prompt_tokens_total counter\n";
  out += "vireo_prompt_tokens_total " + std::to_string(prompt_tokens_.load()) + "\n";
  out += "# HELP vireo_generation_tokens_total Tokens generated.\n# TYPE vireo_generation_tokens_total counter\n";
  out += "vireo_generation_tokens_total " + std::to_string(generated_tokens_.load()) + "\n";
  const SchedulerStats z{};
  const SchedulerStats& st = s ? *s : z;
  auto gauge = [&](const char* name, const char* help, double v) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " gauge\n" + name + " " + num(v) + "\n";
  };
  gauge("vireo_queue_depth", "Requests waiting for admission.", double(st.waiting));
  gauge("vireo_running_batch_size", "Sequences in the running batch.", double(st.running));
  gauge("vireo_cache_bytes_in_use", "MLA cache bytes holding running requests' entries.",
        double(st.cache_bytes_in_use));
  gauge("vireo_cache_bytes_kept", "MLA cache bytes free rows keep for requests sharing their prompts' prefixes.",
        double(st.cache_bytes_kept));
  gauge("vireo_cache_bytes_reserved", "MLA cache bytes reserved by admitted requests (prompt + max_tokens).",
        double(st.cache_bytes_reserved));
  gauge("vireo_cache_bytes_allocated", "MLA cache bytes allocated.", double(st.cache_bytes_allocated));
  out += "# HELP vireo_engine_steps_total Batched forward steps run.\n# TYPE vireo_engine_steps_total counter\n";
  out += "vireo_engine_steps_total " + std::to_string(st.steps) + "\n";
  out +=
      "# HELP vireo_mtp_drafts_total MTP drafts verified (serve --mtp), by outcome.\n"
      "# TYPE vireo_mtp_drafts_total counter\n";
  out += "vireo_mtp_drafts_total{outcome=\"kept\"} " + std::to_string(st.drafts_kept) + "\n";
  out += "vireo_mtp_drafts_total{outcome=\"rejected\"} " + std::to_string(st.drafted - st.drafts_kept) + "\n";
  out +=
      "# HELP vireo_prefix_tokens_reused_total Prompt tokens whose cache entries a request found kept by an earlier "
      "one (serve --prefix-reuse).\n# TYPE vireo_prefix_tokens_reused_total counter\n";
  out += "vireo_prefix_tokens_reused_total " + std::to_string(st.prefix_tokens_reused) + "\n";
  ttft_.render(out, "vireo_time_to_first_token_seconds", "Time from request arrival to its first generated token.");
  itl_.render(out, "vireo_inter_token_latency_seconds", "Time between consecutive generated tokens of a request.");
  return out;
}

}  // namespace vireo::server
