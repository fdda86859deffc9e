// Which rank writes which tensor of a checkpoint into which file, and the gathers that bring each tensor whole to
// its writer (checkpoint_plan.h).
#include "runtime/train/checkpoint_plan.h"

#include <algorithm>
#include <set>

#include "parallel/copy_block.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mt {

// The run's tokenizer files (data.tokenizer, else model.init_from's directory's): the tokenizer itself and the
// Hugging Face files describing it beside it.
std::vector<fs::path> tokenizer_files(const Config& config) {
  std::error_code ec;
  fs::path dir;
  std::vector<fs::path> out;
  if (!config.data.tokenizer.empty()) {
    fs::path t(config.data.tokenizer);
    if (fs::is_regular_file(t, ec)) out.push_back(t);
    dir = fs::is_directory(t, ec) ? t : t.parent_path();
  } else if (!config.model.init_from.empty()) {
    fs::path i(config.model.init_from);
    dir = fs::is_directory(i, ec) ? i : i.parent_path();
  }
  if (dir.empty()) return out;
  for (const char* name : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                           "generation_config.json"}) {
    fs::path f = dir / name;
    if (fs::is_regular_file(f, ec) && std::find(out.begin(), out.end(), f) == out.end() &&
        (out.empty() || out[0].filename() != name))
      out.push_back(f);
  }
  return out;
}

std::vector<CkptTensor> checkpoint_tensors(CausalLM& model, AdamW* opt) {
  std::vector<CkptTensor> out;
  // A stacked parameter is one tensor per slice, each named as the files name it.
  auto add = [&](const std::string& name, const DTensor& t, bool model_file) {
    if (!is_stacked_param(name)) {
      out.push_back({name, t, model_file});
      return;
    }
    for (int64_t j = 0; j < t.shape().at(0); ++j) out.push_back({stacked_param_name(name, j), t, model_file, j});
  };
  // With LoRA the frozen base is not saved (it comes from model.init_from or the seed): the adapters, under PEFT's
  // names, and their optimizer state.
  // A family's fused tensors (Phi-3's qkv_proj, gate_up_proj) are written joined, once (adapters never are).
  // Without LoRA a frozen parameter (DeepSeek-V3's e_score_correction_bias: a buffer in transformers) is part of the
  // model's files all the same, without optimizer state.
  const std::vector<Parameter*> all = model.parameters();
  const bool lora = std::any_of(all.begin(), all.end(), [](const Parameter* p) { return is_lora_param(*p); });
  const std::vector<Parameter*> params = trainable(all), files = lora ? params : all;
  const FileLayout layout(model);
  for (Parameter* p : files) {
    if (is_lora_param(*p) || !layout.part(p->name)) add(file_param_name(*p), p->value, true);
    else if (auto parts = layout.parts_led_by(p->name); !parts.empty())  // a fused tensor, once
      out.push_back({layout.file_name(p->name), p->value, true, -1, parts});
  }
  // The copies a family's files keep of a shared parameter, written with its values (not when it is another
  // stage's, nor with LoRA).
  if (!lora)
    for (const auto& [copy, of] : model.file_copies())
      for (Parameter* p : all)
        if (p->name == of) out.push_back({copy, p->value, true});
  if (opt)
    for (Parameter* p : params) {
      auto& s = opt->state().at(p->name);
      DTensor m = p->value, v = p->value;
      m.local = s.exp_avg, v.local = s.exp_avg_sq;
      add(p->name + ".exp_avg", m, false);
      add(p->name + ".exp_avg_sq", v, false);
    }
  return out;
}

uint64_t tensor_bytes(const CkptTensor& c) { return uint64_t(shape_numel(c.shape())) * dtype_size(c.t.local.dtype()); }

namespace {

// The lowest rank of `world` whose block of t holds row `row` of dim 0 (a stacked parameter's slice).
int slice_holder(const DTensor& t, int64_t row, int world) {
  for (int r = 0; r < world; ++r) {
    const std::vector<int> c = t.mesh.coordinate_of(r);
    const Shape off = t.spec.local_offset(c), shape = t.spec.local_shape(c);
    if (shape_numel(shape) > 0 && row >= off[0] && row < off[0] + shape[0]) return r;
  }
  fail("checkpoint", "no rank holds row {} of a stacked parameter", row);
}

// Which rank writes each tensor: the largest tensors first, each to the writer with the fewest bytes so far (the
// same answer on every rank). Writers are spread evenly over the world ranks.
std::vector<int> assign_writers(const std::vector<CkptTensor>& ts, int world, int64_t writers_cfg) {
  int w = writers_cfg > 0 ? int(std::min<int64_t>(writers_cfg, world)) : world;
  w = std::max(1, std::min<int>(w, int(ts.size())));
  std::vector<size_t> order(ts.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tensor_bytes(ts[a]) > tensor_bytes(ts[b]); });
  std::vector<uint64_t> load(size_t(w), 0);
  std::vector<int> writer(ts.size());
  for (size_t i : order) {
    if (ts[i].slice >= 0) {  // an expert's slice: written where it lives, nothing gathered
      writer[i] = slice_holder(ts[i].t, ts[i].slice, world);
      continue;
    }
    size_t best = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    load[best] += tensor_bytes(ts[i]);
    writer[i] = int(int64_t(best) * world / w);
  }
  return writer;
}

}  // namespace

// Tensor i whole on its writer, one shard at a time: each distinct block is sent by the lowest world rank holding
// it (point to point over the world group, watched); the writer copies its own. Returns the whole tensor on the
// writer (host), undefined elsewhere. Every rank calls this for every tensor in the same order; no rank holds more
// than one whole tensor (the writer) plus one block.
Tensor gather_joined(const std::vector<DTensor>& parts, int writer, Group& world) {
  std::vector<Tensor> whole;
  for (const DTensor& p : parts) whole.push_back(gather_to_writer(p, writer, world));
  return world.rank() == writer ? join_rows(whole) : Tensor();
}

Tensor gather_to_writer(const DTensor& t, int writer, Group& world, int64_t slice) {
  const DeviceMesh& mesh = t.mesh;
  const int me = world.rank();
  struct Block {
    Shape off, shape;
    int sender;
  };
  // A slice (dim-0 row `slice`) gathers the blocks' parts in that row only: each block's row there.
  auto local_part = [&](const Tensor& local, const Shape& off) {
    if (slice < 0) return local;
    Shape row(local.shape().begin() + 1, local.shape().end());
    return local.view((slice - off[0]) * shape_numel(row), row);
  };
  std::vector<Block> blocks;
  std::set<std::pair<Shape, Shape>> seen;  // O(ranks log ranks) per tensor
  for (int r = 0; r < world.size(); ++r) {
    std::vector<int> c = mesh.coordinate_of(r);
    Shape off = t.spec.local_offset(c), shape = t.spec.local_shape(c);
    if (shape_numel(shape) == 0) continue;
    if (slice >= 0) {
      if (slice < off[0] || slice >= off[0] + shape[0]) continue;
      off.at(0) = slice, shape.at(0) = 1;
    }
    if (seen.insert({off, shape}).second) blocks.push_back({off, shape, r});
  }
  const Shape whole = slice < 0 ? t.shape() : Shape(t.shape().begin() + 1, t.shape().end());
  Tensor full;
  if (me == writer) full = empty(whole, t.local.dtype());
  const Shape my_off = t.spec.local_offset(mesh.coordinate());
  for (const Block& b : blocks) {
    const Shape at = slice < 0 ? b.off : Shape(b.off.begin() + 1, b.off.end());
    const Shape size = slice < 0 ? b.shape : Shape(b.shape.begin() + 1, b.shape.end());
    if (b.sender == me && me == writer) {
      copy_block(full, at, host_f(local_part(t.local, my_off)), Shape(at.size(), 0), size);
    } else if (b.sender == me) {
      world.send(local_part(t.local, my_off), writer);  // on the tensor's device: NCCL groups move device buffers
    } else if (me == writer) {
      Tensor in = empty(size, t.local.dtype(), t.local.device());
      world.recv(in, b.sender);
      copy_block(full, at, host_f(in), Shape(at.size(), 0), size);
    }
  }
  return full;
}

// The concatenation of every member's JSON array, in rank order (collective over g).
json gather_json_array(Group& g, const json& mine, Device device) {
  const std::string text = mine.dump();
  Tensor len = empty({1}, DType::i64);
  len.at<int64_t>(0) = int64_t(text.size());
  Tensor lens = empty({int64_t(g.size())}, DType::i64, device);
  g.all_gather(lens, len.to(device));
  const Tensor lens_h = lens.to(Device::cpu());
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (int r = 0; r < g.size(); ++r) total += counts.emplace_back(lens_h.at<int64_t>(r));
  Tensor chars = empty({int64_t(text.size())}, DType::i32);  // one character per element: no byte dtype
  for (size_t i = 0; i < text.size(); ++i) chars.at<int32_t>(int64_t(i)) = int32_t((unsigned char)text[i]);
  Tensor all = empty({total}, DType::i32, device);
  g.all_gather_v(all, chars.to(device), counts);
  const Tensor all_h = all.to(Device::cpu());
  json out = json::array();
  int64_t at = 0;
  for (int64_t c : counts) {
    std::string part(size_t(c), '\0');
    for (int64_t i = 0; i < c; ++i) part[size_t(i)] = char(all_h.at<int32_t>(at + i));
    at += c;
    for (auto& e : json::parse(part)) out.push_back(e);
  }
  return out;
}

std::string shard_file(const std::string& prefix, int k, int n) {
  return n == 1 ? prefix + ".safetensors" : fmt::format("{}-{:05d}-of-{:05d}.safetensors", prefix, k + 1, n);
}

FilePlan plan_files(const std::vector<CkptTensor>& ts, int n_world, const Config& config, const DeviceMesh& mesh,
                    Group* stages) {
  FilePlan f;
  const int n_stages = stages ? stages->size() : 1;
  const int64_t writers_cfg =
      config.checkpoint.writers > 0 ? std::max<int64_t>(1, config.checkpoint.writers / n_stages) : 0;
  f.writer = assign_writers(ts, n_world, writers_cfg);
  // LoRA: a stage's adapters go to one writer, one adapter_model file (PEFT reads one file).
  if (config.lora.enabled()) {
    f.model_prefix = "adapter_model";
    int first = -1;
    for (size_t i = 0; i < ts.size(); ++i)
      if (ts[i].model) f.writer[i] = first < 0 ? (first = f.writer[i]) : first;
  }
  for (size_t i = 0; i < ts.size(); ++i) (ts[i].model ? f.model_k : f.opt_k)[f.writer[i]] = 0;
  for (auto& [w, k] : f.model_k) k = f.n_model++;
  for (auto& [w, k] : f.opt_k) k = f.n_opt++;
  if (!stages) return f;
  Tensor mine = empty({2}, DType::i64), all = empty({2 * int64_t(n_stages)}, DType::i64);
  mine.at<int64_t>(0) = f.n_model, mine.at<int64_t>(1) = f.n_opt;
  Tensor all_d = all.to(mesh.device());
  stages->all_gather(all_d, mine.to(mesh.device()));
  all = all_d.to(Device::cpu());
  int off_model = 0, off_opt = 0, tot_model = 0, tot_opt = 0;
  for (int s = 0; s < n_stages; ++s) {
    const int a = int(all.at<int64_t>(2 * s)), b = int(all.at<int64_t>(2 * s + 1));
    if (s < stages->rank()) off_model += a, off_opt += b;
    tot_model += a, tot_opt += b;
  }
  for (auto& [w, k] : f.model_k) k += off_model;
  for (auto& [w, k] : f.opt_k) k += off_opt;
  f.n_model = tot_model, f.n_opt = tot_opt;
  return f;
}

}  // namespace mt
