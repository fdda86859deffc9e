// The whole run's configuration: the sections of runtime/io/config.h and the model's (models/model_config.h),
// read from YAML and --set overrides, completed from model.init_from's config.json when it names a Hugging Face
// directory, and checked on every rank before any collective.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/lora.h"
#include "models/model_config.h"
#include "runtime/io/config.h"

namespace mt {

struct Config {
  ParallelConfig parallel;
  CommConfig comm;
  LogConfig log;
  ModelConfig model;
  TrainingConfig training;
  DataConfig data;
  EvalConfig eval;
  SampleConfig sample;
  CheckpointConfig checkpoint;
  ProfileConfig profile;
  LoraConfig lora;
  AttentionConfig attention;
  template <class V> void visit(V& v) {
    v("parallel", parallel, "mesh sizes");
    v("comm", comm, "communication");
    v("log", log, "logging and metrics");
    v("model", model, "the model: its family and sizes, or a Hugging Face directory to start from (init_from)");
    v("training", training, "optimizer, schedule and batch");
    v("data", data, "token shards");
    v("eval", eval, "validation");
    v("sample", sample, "generated samples during training");
    v("checkpoint", checkpoint, "checkpoints and resume");
    v("profile", profile, "traces and the slow-rank check");
    v("lora", lora, "LoRA adapters on a frozen base (rank 0: off, full training)");
    v("attention", attention, "the attention kernel on CUDA (cuDNN or the own flash kernel)");
  }
  // The rules across sections (each section's own are its keys' constraints and its check()): the model's
  // family's, and the training, data and parallel keys that depend on the model. Those that need the mesh are
  // ParallelDims' and the trainer's.
  void check() const;
};

// Loads path (empty: defaults only), applies --set overrides, converts and checks (every key's constraints, each
// section's check(), then Config::check). With model.init_from naming a directory that holds a config.json, the
// model keys come from that file; each model key the YAML gives must agree with it, or it is an error naming the
// key and the file.
Config load_config(const std::string& path, const std::vector<std::string>& overrides);
Config config_from_yaml_string(const std::string& yaml, const std::vector<std::string>& overrides = {});
std::string config_to_yaml(const Config& c);  // canonical: every key, defaults included
uint64_t config_hash(const Config& c);        // FNV-1a 64 of config_to_yaml
// The config.json beside model.init_from ('' when it names none): the directory's, or a named file's directory's.
std::string init_from_config_json(const std::string& init_from);

}  // namespace mt
