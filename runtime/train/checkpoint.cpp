// Saving: every rank takes part, writers write whole tensors (a stacked parameter one tensor per slice, by a rank
// that holds it), the directory appears complete or not at all (checkpoint.h). Loading, verifying the checksums and
// finding partial saves are in checkpoint_load.cpp.
#include "runtime/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>
#include <atomic>
#include <chrono>

#include "parallel/copy_block.h"
#include "runtime/train/agree.h"
#include "runtime/train/fused_tensors.h"
#include "runtime/core/fault.h"
#include "runtime/core/log.h"
#include "runtime/core/trace.h"
#include "runtime/io/checksum.h"
#include "runtime/io/safetensors.h"
#include "runtime/train/hf_config.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace mt {

namespace {

std::string step_dir_name(int64_t step) { return fmt::format("step_{:08d}", step); }

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

Tensor host_f(const Tensor& t) { return t.device().is_cuda() ? t.to(Device::cpu()) : t; }

// The complete checkpoints in dir (step_XXXXXXXX directories with a meta.json), oldest first; with_damaged: every
// step_XXXXXXXX directory, those whose meta.json has gone too (renamed into place only once it was written).
std::vector<fs::path> complete_checkpoints(const std::string& dir, bool with_damaged = false) {
  std::error_code ec;
  std::vector<fs::path> all;
  if (dir.empty() || !fs::is_directory(dir, ec)) return all;
  const std::regex re("step_[0-9]{8}");
  for (auto& e : fs::directory_iterator(dir, ec))
    if (e.is_directory() && std::regex_match(e.path().filename().string(), re) &&
        (with_damaged || fs::exists(e.path() / "meta.json")))
      all.push_back(e.path());
  std::sort(all.begin(), all.end());
  return all;
}

// The index of the first NaN or infinity in a host tensor, or -1 (integer tensors: -1).
int64_t first_nonfinite(const Tensor& t) {
  int64_t bad = -1;
  if (!dtype_is_float(t.dtype())) return bad;
  dispatch_dtype(t.dtype(), [&](auto zero) {
    using T = decltype(zero);
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, bf16>) {
      const T* p = t.data<T>();
      for (int64_t i = 0, n = t.numel(); i < n; ++i) {
        double x;
        if constexpr (std::is_same_v<T, bf16>) x = double(float(p[i]));
        else x = double(p[i]);
        if (!std::isfinite(x)) {
          bad = i;
          return;
        }
      }
    }
  });
  return bad;
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream f(p);
  f << text;
  f.flush();
  MT_CHECK(f.good(), "checkpoint", "cannot write {}", p.string());
}

}  // namespace

namespace {

// One tensor of a checkpoint: its name and the DTensor whose local part this rank holds (a parameter's f32
// master value, or an AdamW moment laid out like it).
struct CkptTensor {
  std::string name;
  DTensor t;
  bool model = true;  // model file (else optimizer file)
  // A stacked parameter's (an MoE layer's experts) slice along dim 0, written as its own tensor by a rank that
  // holds it: -1, the whole of t.
  int64_t slice = -1;
  // A tensor the family's files hold fused (fused_tensors.h): its parameters, joined along dim 0 (t: the first).
  std::vector<DTensor> parts;
  Shape shape() const {
    if (!parts.empty()) return joined_shape(parts);
    return slice < 0 ? t.shape() : Shape(t.shape().begin() + 1, t.shape().end());
  }
};

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
  const FileLayout layout(model);
  for (Parameter* p : model.parameters()) {
    if (!layout.part(p->name)) add(p->name, p->value, true);
    else if (auto parts = layout.parts_led_by(p->name); !parts.empty())  // a fused tensor, once
      out.push_back({layout.file_name(p->name), p->value, true, -1, parts});
  }
  if (opt)
    for (Parameter* p : model.parameters()) {
      auto& s = opt->state().at(p->name);
      DTensor m = p->value, v = p->value;
      m.local = s.exp_avg, v.local = s.exp_avg_sq;
      add(p->name + ".exp_avg", m, false);
      add(p->name + ".exp_avg_sq", v, false);
    }
  return out;
}

uint64_t tensor_bytes(const CkptTensor& c) { return uint64_t(shape_numel(c.shape())) * dtype_size(c.t.local.dtype()); }

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

// Tensor i whole on its writer, one shard at a time: each distinct block is sent by the lowest world rank holding
// it (point to point over the world group, watched); the writer copies its own. Returns the whole tensor on the
// writer (host), undefined elsewhere. Every rank calls this for every tensor in the same order; no rank holds more
// than one whole tensor (the writer) plus one block.
Tensor gather_to_writer(const DTensor& t, int writer, Group& world, int64_t slice = -1) {
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

// A fused tensor whole on its writer: its parts gathered one by one and joined (undefined elsewhere).
Tensor gather_joined(const std::vector<DTensor>& parts, int writer, Group& world) {
  std::vector<Tensor> whole;
  for (const DTensor& p : parts) whole.push_back(gather_to_writer(p, writer, world));
  return world.rank() == writer ? join_rows(whole) : Tensor();
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

}  // namespace

namespace {

// Which rank writes each tensor and into which file: one model and one optimizer file per writer that has such
// tensors, numbered in rank order (under pipeline parallel stage by stage: each stage's numbers follow the previous
// stages', which one all-gather over the stages tells).
struct FilePlan {
  std::vector<int> writer;             // per tensor: its writer's rank in the model's ranks
  std::map<int, int> model_k, opt_k;   // writer -> file index
  int n_model = 0, n_opt = 0;          // files of the whole checkpoint
};

FilePlan plan_files(const std::vector<CkptTensor>& ts, int n_world, const Config& config, const DeviceMesh& mesh,
                    Group* stages) {
  FilePlan f;
  const int n_stages = stages ? stages->size() : 1;
  const int64_t writers_cfg =
      config.checkpoint.writers > 0 ? std::max<int64_t>(1, config.checkpoint.writers / n_stages) : 0;
  f.writer = assign_writers(ts, n_world, writers_cfg);
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

// Step 2 of a save: a writer's files, one whole tensor at a time, each hashed as it is written. Errors are kept, not
// thrown: a writer that fails keeps taking part in the gathers (no rank is left waiting) and reports at the
// agreement that follows.
class ShardWriter {
 public:
  ShardWriter(const std::vector<CkptTensor>& ts, const FilePlan& f, int me, const fs::path& tmp,
              int64_t optimizer_steps, int64_t step, bool root)
      : ts_(ts), f_(f), me_(me), tmp_(tmp), step_(step), root_(root) {
    for (size_t i = 0; i < ts.size(); ++i) total_ += f.writer[i] == me;
    auto layout = [&](bool model_file) {
      std::vector<SafetensorsWriter::Layout> l;
      for (size_t i = 0; i < ts.size(); ++i)
        if (f.writer[i] == me && ts[i].model == model_file) l.push_back({ts[i].name, ts[i].t.local.dtype(), ts[i].shape()});
      return l;
    };
    try {
      if (f.model_k.count(me))
        model_ = std::make_unique<SafetensorsWriter>(
            (tmp / shard_file("model", f.model_k.at(me), f.n_model)).string(), layout(true),
            std::map<std::string, std::string>{{"format", "pt"}});
      if (f.opt_k.count(me))
        opt_ = std::make_unique<SafetensorsWriter>(
            (tmp / shard_file("optimizer", f.opt_k.at(me), f.n_opt)).string(), layout(false),
            std::map<std::string, std::string>{{"step", std::to_string(optimizer_steps)}});
    } catch (...) {
      err_ = std::current_exception();
    }
  }
  // Tensor i, whole, on this writer (host).
  void write(size_t i, const Tensor& full) {
    if (err_) return;
    try {
      (ts_[i].model ? model_ : opt_)->write(ts_[i].name, full);
      ++written_;
      if (root_ && 2 * written_ >= total_) {
        if (fault_checkpoint_at(step_, true)) fail("checkpoint", "MT_FAULT_CHECKPOINT={}:error: writing {} fails", step_, tmp_.string());
        if (fault_checkpoint_at(step_, false)) {
          spdlog::error("[checkpoint] MT_FAULT_CHECKPOINT={}: rank 0 dies while writing {}", step_, tmp_.string());
          spdlog::default_logger()->flush();
          std::_Exit(9);
        }
      }
    } catch (...) {
      err_ = std::current_exception();
    }
  }
  // Syncs and closes the files; returns the first error. The checksums: [[file name, checksum], ...].
  std::exception_ptr close(json& sums) {
    try {
      for (auto* w : {model_.get(), opt_.get()})
        if (!err_ && w) {
          w->close();
          sums.push_back({fs::path(w == model_.get() ? shard_file("model", f_.model_k.at(me_), f_.n_model)
                                                     : shard_file("optimizer", f_.opt_k.at(me_), f_.n_opt))
                              .string(),
                          w->checksum()});
        }
    } catch (...) {
      err_ = std::current_exception();
    }
    model_.reset(), opt_.reset();  // an unclosed file's .tmp is removed
    return err_;
  }

 private:
  const std::vector<CkptTensor>& ts_;
  const FilePlan& f_;
  int me_;
  fs::path tmp_;
  int64_t step_;
  bool root_;
  int64_t total_ = 0, written_ = 0;
  std::unique_ptr<SafetensorsWriter> model_, opt_;
  std::exception_ptr err_;
};

// meta.json: what a resume needs beyond the tensors (step, data position, the mesh saved on, the config).
json checkpoint_meta(const TrainProgress& progress, int64_t optimizer_steps, const Config& config,
                     const DeviceMesh& mesh, int n_stages /* 0: no pipeline */, const FilePlan& f) {
  json meta;
  meta["format_version"] = 4;  // 3: meta.json lists every file's checksum; 4: and has one of its own (meta_checksum)
  meta["step"] = progress.step;
  meta["optimizer_steps"] = optimizer_steps;
  meta["data"] = {{"epoch", progress.data_epoch}, {"offset", progress.data_offset}, {"next_step", progress.step}};
  meta["rng"] = {{"seed", progress.seed},
                 {"generator", "philox4x32-10 keyed by (seed, stream name, index): no hidden state"}};
  json mesh_json = json::array();
  if (n_stages > 0) mesh_json.push_back({{"name", dim::pp}, {"size", n_stages}});
  for (auto& d : mesh.dims()) mesh_json.push_back({{"name", d.name}, {"size", d.size}});
  meta["mesh"] = mesh_json;
  meta["files"] = {{"model", f.n_model}, {"optimizer", f.n_opt}};
  meta["config"] = config_to_yaml(config);
  meta["model"] = {{"dim", config.model.dim},         {"n_layers", config.model.n_layers},
                   {"n_heads", config.model.n_heads}, {"n_kv_heads", config.model.n_kv_heads},
                   {"ffn_dim", config.model.ffn_dim}, {"vocab_size", config.model.vocab_size}};
  return meta;
}

// Step 3 on rank 0: the indexes (when there are several files), config.json, the tokenizer, meta.json, then the
// rename and the rotation. entries: [name, model file?, file index, bytes] of every stage's tensors.
void finish_directory(const json& entries, const FilePlan& f, json meta, DType dtype, const Config& config,
                      const std::string& dir, const fs::path& tmp, const fs::path& final_dir) {
  // Every file rank 0 writes is in meta.json's checksums too (the shards' come from their writers).
  auto sum = [&](const std::string& name) { meta["checksums"][name] = file_checksum((tmp / name).string()); };
  auto write_index = [&](const std::string& prefix, bool model_file, int n_files, json metadata) {
    if (n_files <= 1) return;
    json map = json::object();
    uint64_t total = 0;
    for (const json& e : entries)
      if (e[1].get<bool>() == model_file) {
        map[e[0].get<std::string>()] = shard_file(prefix, e[2].get<int>(), n_files);
        total += e[3].get<uint64_t>();
      }
    metadata["total_size"] = total;
    write_text(tmp / (prefix + ".safetensors.index.json"), json{{"metadata", metadata}, {"weight_map", map}}.dump(2) + "\n");
    fsync_path(tmp / (prefix + ".safetensors.index.json"));
    sum(prefix + ".safetensors.index.json");
  };
  write_index("model", true, f.n_model, json::object());
  write_index("optimizer", false, f.n_opt, json{{"step", std::to_string(meta["optimizer_steps"].get<int64_t>())}});
  write_text(tmp / "config.json", hf_config_json(config, dtype).dump(2) + "\n");
  fsync_path(tmp / "config.json");
  sum("config.json");
  // The tokenizer travels with the weights, so that the directory is a whole Hugging Face model.
  for (const fs::path& t : tokenizer_files(config)) {
    fs::copy_file(t, tmp / t.filename(), fs::copy_options::overwrite_existing);
    fsync_path(tmp / t.filename());
    sum(t.filename().string());
  }
  meta["meta_checksum"] = meta_checksum(meta);  // last: it covers every other key
  write_text(tmp / "meta.json", meta.dump(2) + "\n");
  fsync_path(tmp / "meta.json");
  fsync_path(tmp);
  std::error_code ec;
  // A directory of this step already there is one this run did not resume from (resume: auto skipped it as
  // damaged, or the run started from an older one): never replaced without a word.
  if (fs::exists(final_dir, ec))
    spdlog::warn("{} is replaced by this save: it held a checkpoint of the same step that this run did not resume "
                 "from (skipped as damaged, or newer than the one the run started from)",
                 final_dir.string());
  fs::remove_all(final_dir, ec);
  fs::rename(tmp, final_dir, ec);
  MT_CHECK(!ec, "checkpoint", "cannot rename {} to {}: {}", tmp.string(), final_dir.string(), ec.message());
  fsync_path(dir);
  if (config.checkpoint.keep > 0) {  // keep the newest `keep` complete checkpoints
    std::vector<fs::path> all = complete_checkpoints(dir);
    for (size_t i = 0; i + size_t(config.checkpoint.keep) < all.size(); ++i) fs::remove_all(all[i], ec);
  }
}

}  // namespace

struct PendingCheckpoint::State {
  std::string dir;
  fs::path tmp, final_dir;
  const Config& config;
  const DeviceMesh& mesh;
  const MpiEnv& env;
  Group* stages;
  TrainProgress progress;
  int64_t optimizer_steps = 0;
  bool root = false;
  std::vector<CkptTensor> ts;
  FilePlan files;
  json entries;      // rank 0: [name, model file?, file index, bytes] of every stage's tensors
  json model_state;  // rank 0: the model's own state at the save step (an MoE model's selection bias)
  DType dtype = DType::f32;
  std::vector<std::pair<size_t, Tensor>> snapshot;  // async: this writer's tensors, whole, on the host
  uint64_t snapshot_bytes = 0;
  std::unique_ptr<ShardWriter> writer;
  json sums = json::array();
  std::exception_ptr err;
  std::thread thread;
  std::atomic<bool> written{false};
  double write_s = 0;
  bool committed = false;

  State(const Config& c, const DeviceMesh& m, const MpiEnv& e) : config(c), mesh(m), env(e) {}
  std::string label() const { return fmt::format("the checkpoint of step {}", progress.step); }
  // Writes the snapshot (async) and closes the files; no communication.
  void write_files() {
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& [i, full] : snapshot) writer->write(i, full);
    err = writer->close(sums);
    snapshot.clear();  // the snapshot's memory goes back as soon as it is on disk
    write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    written = true;
  }
};

PendingCheckpoint::PendingCheckpoint(std::unique_ptr<State> s) : s_(std::move(s)) {}
PendingCheckpoint::~PendingCheckpoint() {
  // A save never committed (the run failed) keeps its .tmp, which the next run removes.
  if (s_ && s_->thread.joinable()) s_->thread.join();
}
int64_t PendingCheckpoint::step() const { return s_->progress.step; }
uint64_t PendingCheckpoint::snapshot_bytes() const { return s_->snapshot_bytes; }
bool PendingCheckpoint::written() const { return s_->written.load(); }
double PendingCheckpoint::write_s() const { return s_->write_s; }

std::unique_ptr<PendingCheckpoint> begin_checkpoint(const std::string& dir, const TrainProgress& progress,
                                                    CausalLM& model, AdamW& opt, const Config& config,
                                                    const DeviceMesh& mesh, const MpiEnv& env, Group* stages,
                                                    bool async) {
  auto s = std::make_unique<PendingCheckpoint::State>(config, mesh, env);
  s->dir = dir, s->stages = stages, s->progress = progress, s->optimizer_steps = opt.steps_taken();
  WatchdogPhase phase(fmt::format("saving the checkpoint of step {} to {}", progress.step, dir));
  const int64_t step = progress.step;
  s->ts = checkpoint_tensors(model, &opt);
  // The model's ranks: the world, or under pipeline parallel this stage's, which write this stage's tensors.
  Group& world = mesh.group("world");
  s->root = env.rank() == 0;  // makes the directory, writes the indexes and meta.json, renames
  s->files = plan_files(s->ts, world.size(), config, mesh, stages);
  s->final_dir = fs::path(dir) / step_dir_name(step);
  s->tmp = fs::path(dir) / (step_dir_name(step) + ".tmp");
  s->dtype = s->ts.front().t.local.dtype();
  const std::string label = s->label();

  // 1. Every rank checks its own shards (a NaN model never replaces, or through rotation deletes, a good checkpoint);
  // rank 0 makes the temporary directory. Agreed before anything is written. Each step is a span in a trace.
  std::optional<trace::Span> trace_phase(std::in_place, "checkpoint: check shards", "checkpoint");
  std::exception_ptr err;
  try {
    for (const CkptTensor& c : s->ts)
      for (const DTensor& t : c.parts.empty() ? std::vector<DTensor>{c.t} : c.parts) {
        Tensor h = host_f(t.local);
        int64_t i = first_nonfinite(h);
        MT_CHECK(i < 0, "checkpoint",
                 "step {}: {} tensor '{}' holds a non-finite value ({} at element {} of this rank's part): the "
                 "checkpoint is not written, the previous ones are kept",
                 step, c.model ? "parameter" : "optimizer", c.name, to_f64(h.reshape({-1}).slice0(i, i + 1))[0], i);
      }
    if (s->root) {
      std::error_code ec;
      fs::remove_all(s->tmp, ec);
      fs::create_directories(s->tmp, ec);
      MT_CHECK(!ec, "checkpoint", "cannot create {}: {}", s->tmp.string(), ec.message());
      if (json extra = model.extra_state(); !extra.is_null()) s->model_state = extra;
    }
  } catch (...) {
    err = std::current_exception();
  }
  agree_on_error(env, err, label);

  // 2. Every tensor goes whole to its writer. Synchronous: written at once, one tensor at a time. Asynchronous: kept
  // in host memory (the snapshot: copies, never views of the training state) and written by a thread.
  trace_phase.emplace(async ? "checkpoint: gather and snapshot" : "checkpoint: gather and write", "checkpoint");
  s->writer = std::make_unique<ShardWriter>(s->ts, s->files, world.rank(), s->tmp, s->optimizer_steps, step, s->root);
  for (size_t i = 0; i < s->ts.size(); ++i) {
    trace::SnapshotScope snapshot_memory;  // the trace's "checkpoint snapshot" part, followed until written
    Tensor full = s->ts[i].parts.empty() ? gather_to_writer(s->ts[i].t, s->files.writer[i], world, s->ts[i].slice)
                                         : gather_joined(s->ts[i].parts, s->files.writer[i], world);
    if (s->files.writer[i] != world.rank()) continue;
    if (async) {
      s->snapshot_bytes += full.nbytes();
      s->snapshot.emplace_back(i, std::move(full));
    } else {
      s->writer->write(i, full);
    }
  }
  // Where every stage's tensors went, for the indexes: each stage's first rank tells rank 0.
  s->entries = json::array();
  for (size_t i = 0; i < s->ts.size(); ++i)
    s->entries.push_back({s->ts[i].name, s->ts[i].model,
                          (s->ts[i].model ? s->files.model_k : s->files.opt_k).at(s->files.writer[i]),
                          tensor_bytes(s->ts[i])});
  if (stages && world.rank() == 0) s->entries = gather_json_array(*stages, s->entries, mesh.device());
  if (async) {
    PendingCheckpoint::State* raw = s.get();
    s->thread = std::thread([raw] {
      if (trace::on()) trace::name_thread("checkpoint writer");
      trace::Span span("checkpoint: write files", "checkpoint");
      raw->write_files();
    });
  } else {
    trace_phase.emplace("checkpoint: write files", "checkpoint");
    s->write_files();
  }
  return std::unique_ptr<PendingCheckpoint>(new PendingCheckpoint(std::move(s)));
}

std::string PendingCheckpoint::commit() {
  State& s = *s_;
  WatchdogPhase phase(fmt::format("completing the checkpoint of step {} in {}", s.progress.step, s.dir));
  MT_CHECK(!s.committed, "checkpoint", "the checkpoint of step {} is committed twice", s.progress.step);
  s.committed = true;
  if (s.thread.joinable()) s.thread.join();
  Group& world = s.mesh.group("world");
  const std::string label = s.label();
  try {
    agree_on_error(s.env, s.err, label);
  } catch (...) {
    std::error_code ec;
    if (s.root) fs::remove_all(s.tmp, ec);
    throw;
  }
  // 3. Every writer's checksums reach rank 0 (over the stage's ranks, then from each stage's first rank), which
  // finishes the directory and renames it. Agreed again, so that no rank goes on (or reads) before the rename and
  // every rank fails when it fails.
  trace::Span span("checkpoint: checksums, indexes, rename", "checkpoint");
  json sums = gather_json_array(world, s.sums, s.mesh.device());
  if (s.stages && world.rank() == 0) sums = gather_json_array(*s.stages, sums, s.mesh.device());
  std::exception_ptr err;
  if (s.root) {
    try {
      json meta = checkpoint_meta(s.progress, s.optimizer_steps, s.config, s.mesh, s.stages ? s.stages->size() : 0,
                                  s.files);
      if (!s.model_state.is_null()) meta["model_state"] = s.model_state;
      json by_file = json::object();
      for (const json& e : sums) by_file[e[0].get<std::string>()] = e[1];
      meta["checksums"] = by_file;
      finish_directory(s.entries, s.files, meta, s.dtype, s.config, s.dir, s.tmp, s.final_dir);
    } catch (...) {
      err = std::current_exception();
      std::error_code ec;
      fs::remove_all(s.tmp, ec);
    }
  }
  agree_on_error(s.env, err, label);
  return s.final_dir.string();
}

std::string save_checkpoint(const std::string& dir, const TrainProgress& progress, CausalLM& model, AdamW& opt,
                            const Config& config, const DeviceMesh& mesh, const MpiEnv& env, Group* stages) {
  return begin_checkpoint(dir, progress, model, opt, config, mesh, env, stages, false)->commit();
}

std::vector<std::string> checkpoints_in(const std::string& dir) {
  std::vector<std::string> out;
  for (auto& p : complete_checkpoints(dir, true)) out.push_back(p.string());
  return out;
}

std::string meta_checksum(json meta) {
  meta.erase("meta_checksum");
  // As a load sees it: the text of the parsed file (numbers and strings as the parser gives them back).
  const std::string text = json::parse(meta.dump()).dump();
  StreamChecksum sum;
  sum.update(text.data(), text.size());
  return sum.hex();
}

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  std::vector<fs::path> all = complete_checkpoints(dir);
  if (all.empty()) return std::nullopt;
  return all.back().string();
}

}  // namespace mt
