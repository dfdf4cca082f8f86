// `vireo synth`: writes a random checkpoint with real GLM-5 layer shapes to disk (one safetensors
// shard per layer plus one for embeddings and lm_head, an index and config.json), for
// benchmarking expert streaming. Tensors are generated and written a chunk at a time, so memory
// stays far below one layer however large the checkpoint.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "experts/memory_plan.h"

namespace vireo::cli {

namespace {

struct Shape {
  int64_t vocab, hidden, inter, moe_inter, heads, q_lora, kv_lora, nope, rope, v, idx_heads, idx_dim, idx_topk;
};

// GLM-5 (spec §1) and a tiny model of the same structure for tests.
Shape arch_shape(const std::string& arch) {
  if (arch == "glm5") return {154880, 6144, 12288, 2048, 64, 2048, 512, 192, 64, 256, 32, 128, 2048};
  return {1024, 512, 1024, 256, 4, 128, 64, 32, 32, 32, 2, 64, 64};
}

struct TensorSpec {
  DType dtype;
  std::vector<int64_t> shape;
  float amp;        // values uniform in [-amp, amp)
  bool constant;    // all values = amp (norm weights, biases, block scales)
};

uint64_t spec_bytes(const TensorSpec& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape) n *= uint64_t(d);
  return n * dtype_size(t.dtype);
}

float hash_uniform(uint64_t key, float a) {
  uint64_t z = key * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (float(z >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * a;
}

class ShardWriter {
 public:
  explicit ShardWriter(uint64_t seed) : seed_(seed) {}
  void add_matrix(const std::string& name, int64_t out, int64_t in, DType dt) {
    const float a = 1.0f / std::sqrt(float(in));
    tensors_[name + ".weight"] = {dt, {out, in}, a, false};
    if (dt == DType::F8_E4M3)
      tensors_[name + ".weight_scale_inv"] = {DType::F32, {(out + 127) / 128, (in + 127) / 128}, a / 448.0f, true};
  }
  void add_vector(const std::string& name, int64_t n, float v) { tensors_[name] = {DType::F32, {n}, v, true}; }
  const std::map<std::string, TensorSpec>& tensors() const { return tensors_; }

  // Writes the shard; progress(bytes) after every chunk.
  void write(const std::string& path, const std::function<void(uint64_t)>& progress) {
    nlohmann::json header = nlohmann::json::object();
    uint64_t off = 0;
    for (const auto& [name, t] : tensors_) {
      header[name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {off, off + spec_bytes(t)}}};
      off += spec_bytes(t);
    }
    std::string h = header.dump();
    while ((h.size() + 8) % 4096) h += ' ';  // tensor data starts block-aligned
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail(path, ": cannot create: ", std::strerror(errno));
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = uint8_t(uint64_t(h.size()) >> (8 * i));
    write_all(fd, path, len, 8);
    write_all(fd, path, h.data(), h.size());
    const size_t chunk = size_t(64) << 20;
    std::vector<uint8_t> buf(chunk);
    for (const auto& [name, t] : tensors_) {
      const uint64_t total = spec_bytes(t), esz = dtype_size(t.dtype);
      const uint64_t tensor_key = std::hash<std::string>{}(name) ^ (seed_ * 0x100000001b3ull);
      for (uint64_t b = 0; b < total; b += chunk) {
        const uint64_t n = std::min<uint64_t>(chunk, total - b) / esz, first = b / esz;
        ThreadPool::global().parallel_for(int64_t(n), [&](int64_t i0, int64_t i1, int) {
          for (int64_t i = i0; i < i1; ++i) {
            const float v = t.constant ? t.amp : hash_uniform(tensor_key + first + uint64_t(i), t.amp);
            switch (t.dtype) {
              case DType::F32: std::memcpy(&buf[size_t(i) * 4], &v, 4); break;
              case DType::BF16: {
                const uint16_t x = uint16_t(bits_from_f32(v) >> 16);
                std::memcpy(&buf[size_t(i) * 2], &x, 2);
                break;
              }
              default: {  // F8_E4M3: a random finite code (exponent field < 15 avoids NaN)
                uint8_t code = uint8_t(bits_from_f32(v) >> 13);
                if ((code & 0x78) == 0x78) code &= 0xf7;
                buf[size_t(i)] = code;
              }
            }
          }
        }, 4096);
        write_all(fd, path, buf.data(), size_t(n * esz));
        progress(n * esz);
      }
    }
    // Written pages are not ours to keep in the page cache.
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }

 private:
  static void write_all(int fd, const std::string& path, const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n) {
      const ssize_t w = ::write(fd, c, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail(path, ": write failed: ", std::strerror(errno));
      c += w;
      n -= size_t(w);
    }
  }
  uint64_t seed_;
  std::map<std::string, TensorSpec> tensors_;
};

}  // namespace

Action add_synth(CLI::App& app) {
  struct Opts {
    std::string out, arch = "glm5", dtype = "bf16";
    int layers = 4, experts = 256;
    uint64_t seed = 1;
    bool quiet = false;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--out,-o", o->out, "Output directory (created)")->required();
  app.add_option("--arch", o->arch, "Layer shapes: glm5 (real GLM-5) or tiny (tests)")
      ->check(CLI::IsMember({"glm5", "tiny"}));
  app.add_option("--layers", o->layers, "MoE layers")->check(CLI::Range(1, 200));
  app.add_option("--experts", o->experts, "Routed experts per layer")->check(CLI::Range(1, 256));
  app.add_option("--dtype", o->dtype, "Weight dtype")->check(CLI::IsMember({"bf16", "fp8"}));
  app.add_option("--seed", o->seed, "Random seed");
  app.add_flag("--quiet", o->quiet, "No progress line");
  return [o]() {
    const Shape s = arch_shape(o->arch);
    const DType dt = o->dtype == "fp8" ? DType::F8_E4M3 : DType::BF16;
    const int top_k = std::min(8, o->experts);
    std::filesystem::create_directories(o->out);
    // Shards: embeddings + lm_head + final norm, then one per layer.
    std::vector<std::pair<std::string, ShardWriter>> shards;
    shards.emplace_back("model-embed.safetensors", ShardWriter(o->seed));
    shards.back().second.add_matrix("model.embed_tokens", s.vocab, s.hidden, DType::BF16);
    shards.back().second.add_matrix("lm_head", s.vocab, s.hidden, DType::BF16);
    shards.back().second.add_vector("model.norm.weight", s.hidden, 1.0f);
    for (int l = 0; l < o->layers; ++l) {
      char fname[64];
      std::snprintf(fname, sizeof fname, "model-layer-%03d.safetensors", l);
      shards.emplace_back(fname, ShardWriter(o->seed + uint64_t(l) + 1));
      ShardWriter& w = shards.back().second;
      const std::string p = "model.layers." + std::to_string(l) + ".", a = p + "self_attn.";
      w.add_vector(p + "input_layernorm.weight", s.hidden, 1.0f);
      w.add_vector(p + "post_attention_layernorm.weight", s.hidden, 1.0f);
      w.add_matrix(a + "q_a_proj", s.q_lora, s.hidden, dt);
      w.add_vector(a + "q_a_layernorm.weight", s.q_lora, 1.0f);
      w.add_matrix(a + "q_b_proj", s.heads * (s.nope + s.rope), s.q_lora, dt);
      w.add_matrix(a + "kv_a_proj_with_mqa", s.kv_lora + s.rope, s.hidden, dt);
      w.add_vector(a + "kv_a_layernorm.weight", s.kv_lora, 1.0f);
      w.add_matrix(a + "kv_b_proj", s.heads * (s.nope + s.v), s.kv_lora, dt);
      w.add_matrix(a + "o_proj", s.hidden, s.heads * s.v, dt);
      w.add_matrix(a + "indexer.wq_b", s.idx_heads * s.idx_dim, s.q_lora, dt);
      w.add_matrix(a + "indexer.wk", s.idx_dim, s.hidden, dt);
      w.add_vector(a + "indexer.k_norm.weight", s.idx_dim, 1.0f);
      w.add_vector(a + "indexer.k_norm.bias", s.idx_dim, 0.0f);
      w.add_matrix(a + "indexer.weights_proj", s.idx_heads, s.hidden, DType::BF16);
      w.add_matrix(p + "mlp.gate", o->experts, s.hidden, DType::BF16);
      w.add_vector(p + "mlp.gate.e_score_correction_bias", o->experts, 0.0f);
      for (int e = 0; e < o->experts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        w.add_matrix(x + "gate_proj", s.moe_inter, s.hidden, dt);
        w.add_matrix(x + "up_proj", s.moe_inter, s.hidden, dt);
        w.add_matrix(x + "down_proj", s.hidden, s.moe_inter, dt);
      }
      w.add_matrix(p + "mlp.shared_experts.gate_proj", s.moe_inter, s.hidden, dt);
      w.add_matrix(p + "mlp.shared_experts.up_proj", s.moe_inter, s.hidden, dt);
      w.add_matrix(p + "mlp.shared_experts.down_proj", s.hidden, s.moe_inter, dt);
    }
    uint64_t total = 0;
    nlohmann::json weight_map = nlohmann::json::object();
    for (auto& [file, w] : shards)
      for (const auto& [name, t] : w.tensors()) {
        total += spec_bytes(t);
        weight_map[name] = file;
      }
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t done = 0, last_print = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      shards[i].second.write(o->out + "/" + shards[i].first, [&](uint64_t n) {
        done += n;
        if (o->quiet || (done - last_print < (uint64_t(256) << 20) && done != total)) return;
        last_print = done;
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "\rsynth: shard %zu/%zu  %s / %s  %.0f MB/s   ", i + 1, shards.size(),
                     format_bytes(done).c_str(), format_bytes(total).c_str(), double(done) / 1e6 / std::max(secs, 1e-9));
        std::fflush(stderr);
      });
    }
    if (!o->quiet) std::fprintf(stderr, "\n");
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::ofstream(o->out + "/model.safetensors.index.json") << index.dump(1) << "\n";
    std::vector<std::string> full(size_t(o->layers), "full"), sparse(size_t(o->layers), "sparse");
    nlohmann::json cfg = {
        {"architectures", {"GlmMoeDsaForCausalLM"}}, {"model_type", "glm_moe_dsa"},
        {"vocab_size", s.vocab}, {"hidden_size", s.hidden}, {"intermediate_size", s.inter},
        {"moe_intermediate_size", s.moe_inter}, {"num_hidden_layers", o->layers},
        {"num_attention_heads", s.heads}, {"num_key_value_heads", s.heads}, {"q_lora_rank", s.q_lora},
        {"kv_lora_rank", s.kv_lora}, {"qk_nope_head_dim", s.nope}, {"qk_rope_head_dim", s.rope},
        {"v_head_dim", s.v}, {"n_routed_experts", o->experts}, {"n_shared_experts", 1},
        {"num_experts_per_tok", top_k}, {"n_group", 1}, {"topk_group", 1}, {"norm_topk_prob", true},
        {"routed_scaling_factor", 2.5}, {"first_k_dense_replace", 0}, {"mlp_layer_types", sparse},
        {"index_topk", s.idx_topk}, {"index_n_heads", s.idx_heads}, {"index_head_dim", s.idx_dim},
        {"indexer_types", full}, {"rms_norm_eps", 1e-5}, {"max_position_embeddings", 202752},
        {"rope_parameters", {{"rope_theta", 1e6}, {"rope_type", "default"}}}, {"tie_word_embeddings", false},
        {"eos_token_id", {s.vocab - 1}}, {"hidden_act", "silu"}, {"attention_bias", false}};
    std::ofstream(o->out + "/config.json") << cfg.dump(2) << "\n";
    std::printf("wrote %s: %d layers x %d experts, %s, %s\n", o->out.c_str(), o->layers, o->experts,
                o->dtype.c_str(), format_bytes(total).c_str());
    return 0;
  };
}

}  // namespace vireo::cli
