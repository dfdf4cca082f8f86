#include "experts/expert_layout.h"

#include <algorithm>
#include <map>

namespace vireo {

namespace {

uint64_t align_down(uint64_t x) { return x / kIoAlign * kIoAlign; }
uint64_t align_up(uint64_t x) { return (x + kIoAlign - 1) / kIoAlign * kIoAlign; }

// Tensors closer than this in a file are read as one extent: reading a small gap costs less
// than another request.
constexpr uint64_t kMergeGap = uint64_t(1) << 20;

}  // namespace

uint64_t estimate_slot_bytes(uint64_t payload_bytes) { return align_up(payload_bytes) + 2 * kIoAlign; }

ExpertLayout::ExpertLayout(const Checkpoint& ck, const ExpertStoreParams& p, bool packed) : p_(p), packed_(packed) {
  if (ck.files().empty() && !packed) fail(ck.dir(), ": streaming experts needs a checkpoint on disk");
  std::map<std::string, int> file_index;
  for (const auto& f : ck.files()) {
    file_index[f->path()] = int(files_.size());
    files_.push_back(f->path());
  }
  records_.resize(size_t(p.n_layers) * size_t(p.n_experts));
  for (int l : p.moe_layers) {
    for (int e = 0; e < p.n_experts; ++e) {
      const std::string x = p.layer_prefix + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".";
      ExpertRecord& r = records_[size_t(l) * size_t(p.n_experts) + size_t(e)];
      const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
      struct Src { const TensorInfo* info; int piece; };
      std::vector<Src> srcs;
      for (int k = 0; k < 3; ++k) {
        const bool down = k == 2;
        const std::string prefix = x + names[k];
        Weight w = bind_weight(ck, prefix, down ? p.hidden : p.moe_intermediate, down ? p.moe_intermediate : p.hidden);
        srcs.push_back({ck.find(prefix + ".weight"), 2 * k});
        if (!w.scale_inv.empty()) srcs.push_back({ck.find(prefix + ".weight_scale_inv"), 2 * k + 1});
      }
      if (packed) {
        uint64_t cursor = 0;
        for (const Src& src : srcs) {
          ExpertPiece& pc = r.pieces[src.piece];
          pc.view = src.info->view();
          pc.src = pc.view.data;
          pc.view.data = nullptr;
          pc.slot_offset = cursor;
          r.payload_bytes += src.info->nbytes;
          cursor += (src.info->nbytes + kPackAlign - 1) / kPackAlign * kPackAlign;
        }
        r.transfer_bytes = cursor;
        slot_bytes_ = std::max(slot_bytes_, cursor);
        expert_bytes_ = std::max(expert_bytes_, r.payload_bytes);
        continue;
      }
      std::sort(srcs.begin(), srcs.end(), [&](const Src& a, const Src& b) {
        const int fa = file_index.at(a.info->file), fb = file_index.at(b.info->file);
        return fa != fb ? fa < fb : a.info->file_offset < b.info->file_offset;
      });
      // Merge neighbours into extents; place each extent at the next aligned slot offset.
      uint64_t cursor = 0;
      for (size_t i = 0; i < srcs.size();) {
        const int file = file_index.at(srcs[i].info->file);
        const uint64_t begin = srcs[i].info->file_offset;
        uint64_t end = begin + srcs[i].info->nbytes;
        size_t j = i + 1;
        while (j < srcs.size() && file_index.at(srcs[j].info->file) == file &&
               srcs[j].info->file_offset <= end + kMergeGap) {
          end = std::max<uint64_t>(end, srcs[j].info->file_offset + srcs[j].info->nbytes);
          ++j;
        }
        ExpertExtent ext;
        ext.file = file;
        ext.file_offset = align_down(begin);
        ext.length = align_up(end) - ext.file_offset;
        ext.slot_offset = cursor;
        for (size_t k = i; k < j; ++k) {
          ExpertPiece& pc = r.pieces[srcs[k].piece];
          pc.view = srcs[k].info->view();
          pc.view.data = nullptr;
          pc.slot_offset = ext.slot_offset + (srcs[k].info->file_offset - ext.file_offset);
          r.payload_bytes += srcs[k].info->nbytes;
        }
        r.transfer_bytes += ext.length;
        cursor += ext.length;
        r.extents.push_back(ext);
        i = j;
      }
      slot_bytes_ = std::max(slot_bytes_, cursor);
      expert_bytes_ = std::max(expert_bytes_, r.payload_bytes);
    }
  }
}

ExpertWeights ExpertLayout::bind(int layer, int expert, char* base) const {
  const ExpertRecord& r = record(layer, expert);
  auto piece = [&](int i) {
    Tensor t = r.pieces[i].view;
    if (t.ndim) t.data = base + r.pieces[i].slot_offset;
    return t;
  };
  ExpertWeights w;
  w.gate = {piece(0), piece(1)};
  w.up = {piece(2), piece(3)};
  w.down = {piece(4), piece(5)};
  return w;
}

}  // namespace vireo
