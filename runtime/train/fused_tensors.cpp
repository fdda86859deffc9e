#include "runtime/train/fused_tensors.h"

#include "parallel/copy_block.h"
#include "runtime/kernels/ops.h"

namespace mt {

namespace {

// The fused tensor a parameter name belongs to: (file name, its index among the parts), or nullopt.
std::optional<std::pair<std::string, size_t>> match(const ModelFamily& f, const std::string& name) {
  for (const FusedWeight& w : f.fused_weights)
    for (size_t i = 0; i < w.parts.size(); ++i) {
      const std::string part = w.parts[i];
      if (name.size() <= part.size() || !name.ends_with(part) || name[name.size() - part.size() - 1] != '.')
        continue;
      return std::make_pair(name.substr(0, name.size() - part.size()) + w.file, i);
    }
  return std::nullopt;
}

}  // namespace

FileLayout::FileLayout(CausalLM& model) : family_(&family_of(model.config)) {
  if (family_->fused_weights.empty()) return;
  std::map<std::string, std::vector<Parameter*>> slots;
  for (Parameter* p : model.parameters()) {
    auto m = match(*family_, p->name);
    if (!m) continue;
    std::vector<Parameter*>& g = slots[m->first];
    if (g.size() <= m->second) g.resize(m->second + 1, nullptr);
    g[m->second] = p;
  }
  for (auto& [file, parts] : slots) {
    size_t want = 0;
    for (const FusedWeight& w : family_->fused_weights)
      if (file.ends_with(w.file)) want = w.parts.size();
    bool whole = parts.size() == want;
    for (Parameter* p : parts) whole = whole && p != nullptr;
    MT_CHECK(whole, "checkpoint", "{}: the model holds only some of the parameters fused in it", file);
    groups_[file] = parts;
  }
}

std::string FileLayout::file_name(const std::string& param) const {
  auto m = match(*family_, param);
  return m ? m->first : param;
}

std::optional<FusedPart> FileLayout::part(const std::string& param) const {
  auto m = match(*family_, param);
  if (!m) return std::nullopt;
  const std::vector<Parameter*>& parts = groups_.at(m->first);
  FusedPart out{m->first, parts[0]->value.shape(), 0};
  out.file_shape[0] = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    MT_CHECK(parts[i]->value.shape().size() == out.file_shape.size(), "checkpoint", "{}: parts of different ranks",
             m->first);
    if (i < m->second) out.row += parts[i]->value.shape()[0];
    out.file_shape[0] += parts[i]->value.shape()[0];
  }
  return out;
}

std::vector<DTensor> FileLayout::parts_led_by(const std::string& param) const {
  auto m = match(*family_, param);
  if (!m || m->second != 0) return {};
  std::vector<DTensor> out;
  for (Parameter* p : groups_.at(m->first)) out.push_back(p->value);
  return out;
}

Shape joined_shape(const std::vector<DTensor>& parts) {
  Shape shape = parts.at(0).shape();
  for (size_t i = 1; i < parts.size(); ++i) shape[0] += parts[i].shape()[0];
  return shape;
}

Tensor join_rows(const std::vector<Tensor>& parts) {
  Shape shape = parts.at(0).shape();
  shape[0] = 0;
  for (const Tensor& t : parts) shape[0] += t.size(0);
  Tensor out = empty(shape, parts[0].dtype());
  Shape at(shape.size(), 0);
  for (const Tensor& t : parts) {
    copy_block(out, at, t, Shape(shape.size(), 0), t.shape());
    at[0] += t.size(0);
  }
  return out;
}

}  // namespace mt
