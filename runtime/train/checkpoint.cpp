// Saving: every rank takes part, writers write whole tensors (a stacked parameter one tensor per slice, by a rank
// that holds it), the directory appears complete or not at all (checkpoint.h). Which rank writes which tensor into
// which file, and the gathers to the writers, are checkpoint_plan.cpp's; loading, verifying the checksums and
// finding partial saves are checkpoint_load.cpp's.
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

#include "runtime/train/agree.h"
#include "runtime/train/fused_tensors.h"
#include "runtime/core/fault.h"
#include "runtime/core/log.h"
#include "runtime/core/trace.h"
#include "runtime/io/checksum.h"
#include "runtime/io/safetensors.h"
#include "runtime/train/checkpoint_plan.h"
#include "runtime/train/hf_config.h"
#include "runtime/train/metrics.h"

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
            (tmp / shard_file(f.model_prefix, f.model_k.at(me), f.n_model)).string(), layout(true),
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
          sums.push_back({fs::path(w == model_.get() ? shard_file(f_.model_prefix, f_.model_k.at(me_), f_.n_model)
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
  int n_model = f.n_model;
  if (f.model_prefix == "adapter_model" && n_model > 1) {
    // LoRA under pipeline parallel: the stages' adapter files joined into one, the file PEFT reads (adapters are
    // small: a few MiB through rank 0).
    std::vector<NamedTensor> all;
    for (int k = 0; k < n_model; ++k) {
      const std::string part = shard_file(f.model_prefix, k, n_model);
      for (auto& [name, t] : read_safetensors((tmp / part).string()).tensors) all.push_back({name, t});
      fs::remove(tmp / part);
      meta["checksums"].erase(part);
    }
    write_safetensors((tmp / "adapter_model.safetensors").string(), all, {{"format", "pt"}});
    fsync_path(tmp / "adapter_model.safetensors");
    sum("adapter_model.safetensors");
    meta["files"]["model"] = n_model = 1;
  }
  write_index(f.model_prefix, true, n_model, json::object());
  write_index("optimizer", false, f.n_opt, json{{"step", std::to_string(meta["optimizer_steps"].get<int64_t>())}});
  // A model's Hugging Face config.json; with LoRA, PEFT's adapter_config.json instead (the base is model.init_from's).
  const char* config_file = config.lora.enabled() ? "adapter_config.json" : "config.json";
  write_text(tmp / config_file,
             (config.lora.enabled() ? adapter_config_json(config) : hf_config_json(config, dtype)).dump(2) + "\n");
  fsync_path(tmp / config_file);
  sum(config_file);
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
  std::atomic<bool> written{false}, cancel{false};
  double write_s = 0;
  bool committed = false;
  bool async = false;
  // async, rank 0: the directory was completed by its thread as soon as every rank's writer was done
  // (finish_when_written), at renamed_time, last_done_time being the last writer's end (unix seconds).
  bool finished = false;
  double last_done_time = 0, renamed_time = 0;

  State(const Config& c, const DeviceMesh& m, const MpiEnv& e) : config(c), mesh(m), env(e) {}
  std::string label() const { return fmt::format("the checkpoint of step {}", progress.step); }
  // Writes the snapshot (async) and closes the files; no communication.
  void write_files() {
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& [i, full] : snapshot) writer->write(i, full);
    err = writer->close(sums);
    snapshot.clear();  // the snapshot's memory goes back as soon as it is on disk
    write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  fs::path done_file(int rank) const { return tmp / fmt::format(".writer-{}.done", rank); }
  void start_writing(bool async);
  void report_done();
  void finish_when_written();
  void finish(const json& sums_by_rank);
};

// Step 2's writing: at once (synchronous), or by a thread that then reports done, and on rank 0 completes the
// directory once every rank has (asynchronous).
void PendingCheckpoint::State::start_writing(bool asynchronous) {
  async = asynchronous;
  if (!async) {
    trace::Span span("checkpoint: write files", "checkpoint");
    write_files();
    written = true;
    return;
  }
  thread = std::thread([this] {
    if (trace::on()) trace::name_thread("checkpoint writer");
    {
      trace::Span span("checkpoint: write files", "checkpoint");
      write_files();
      report_done();
    }
    if (root) {
      trace::Span span("checkpoint: commit when written", "checkpoint");
      finish_when_written();
    }
    written = true;  // rank 0: and the directory completed (or failed)
  });
}

// Async: this rank's writer is done; it says so, with its checksums or its error, in a file of the temporary
// directory (written under another name and renamed: rank 0 reads it whole or not at all). No communication.
void PendingCheckpoint::State::report_done() {
  json d = {{"sums", sums}, {"time", unix_time_s()}};
  if (err) {
    try {
      std::rethrow_exception(err);
    } catch (const std::exception& e) {
      d["error"] = e.what();
    }
  }
  const fs::path part = done_file(env.rank()).string() + ".part";
  try {
    write_text(part, d.dump());
    fsync_path(part);
    fs::rename(part, done_file(env.rank()));
  } catch (...) {
    if (!err) err = std::current_exception();
  }
}

// Async, rank 0's thread: once every rank's writer is done (their files, polled), the directory is completed and
// renamed at once, not at the next step boundary; a writer's error is left for commit() to agree on.
void PendingCheckpoint::State::finish_when_written() {
  const int n = env.size();
  json all = json::array();
  for (int r = 0; r < n && !cancel; ++r) {
    std::error_code ec;
    while (!cancel && !fs::exists(done_file(r), ec)) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (cancel) return;
    json d;
    try {
      std::ifstream f(done_file(r));
      d = json::parse(f);
    } catch (const std::exception& e) {
      if (!err) err = std::make_exception_ptr(Error(fmt::format("[checkpoint] {}: {}", done_file(r).string(), e.what())));
      return;
    }
    if (d.contains("error")) return;  // that rank reports it at commit()
    last_done_time = std::max(last_done_time, d.value("time", 0.0));
    for (auto& e : d["sums"]) all.push_back(e);
  }
  if (err) return;
  try {
    for (int r = 0; r < n; ++r) fs::remove(done_file(r));
    finish(all);
    finished = true;
    renamed_time = unix_time_s();
  } catch (...) {
    err = std::current_exception();
  }
}

// Step 3 on rank 0: meta.json with every file's checksum, then the directory finished and renamed.
void PendingCheckpoint::State::finish(const json& all_sums) {
  json meta = checkpoint_meta(progress, optimizer_steps, config, mesh, stages ? stages->size() : 0, files);
  if (!model_state.is_null()) meta["model_state"] = model_state;
  json by_file = json::object();
  for (const json& e : all_sums) by_file[e[0].get<std::string>()] = e[1];
  meta["checksums"] = by_file;
  finish_directory(entries, files, meta, dtype, config, dir, tmp, final_dir);
}

PendingCheckpoint::PendingCheckpoint(std::unique_ptr<State> s) : s_(std::move(s)) {}
PendingCheckpoint::~PendingCheckpoint() {
  // A save never committed (the run failed) keeps its .tmp, which the next run removes; rank 0's thread stops
  // waiting for writers that will not report.
  if (s_) s_->cancel = true;
  if (s_ && s_->thread.joinable()) s_->thread.join();
}
int64_t PendingCheckpoint::step() const { return s_->progress.step; }
uint64_t PendingCheckpoint::snapshot_bytes() const { return s_->snapshot_bytes; }
bool PendingCheckpoint::written() const { return s_->written.load(); }
double PendingCheckpoint::write_s() const { return s_->write_s; }
double PendingCheckpoint::renamed_time() const { return s_->finished ? s_->renamed_time : 0; }
double PendingCheckpoint::last_done_time() const { return s_->last_done_time; }

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
  trace_phase.reset();
  s->start_writing(async);
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
  // Asynchronous: rank 0's thread completed the directory when the last writer was done (its errors were agreed
  // above); every rank knows the save was asynchronous, so all take this branch together.
  if (s.async) return s.final_dir.string();
  trace::Span span("checkpoint: checksums, indexes, rename", "checkpoint");
  json sums = gather_json_array(world, s.sums, s.mesh.device());
  if (s.stages && world.rank() == 0) sums = gather_json_array(*s.stages, sums, s.mesh.device());
  std::exception_ptr err;
  if (s.root) {
    try {
      s.finish(sums);
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
