// The pipeline executor (runtime/train/pipeline.cpp) against the local loop (step_executor.cpp): one step's
// forwards and backwards of a small Llama over 8 micro-batches, on pp = 2 and pp = 4 with every schedule, give
// every parameter gradient and every micro-batch's token losses bit for bit the whole model's, run by the local
// loop on every rank (f32). The ranks a pipeline does not use hold replicas running the same batch (dp_replicate,
// no gradient sync), so every rank compares. Both runs are built by make_train_run, as `meshtrain train` builds them.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>

#include "../skip.h"
#include "models/model.h"
#include "mpi_world.h"
#include "parallel/pipeline_schedule.h"
#include "runtime/train/pipeline.h"
#include "runtime/train/run.h"

using namespace mt;

namespace {

constexpr int64_t kMicroBatches = 8, kSeq = 16, kVocab = 64;

// 8 decoder layers: pp 4 x pp_virtual 2 gives every stage one. Each of `replicas` data-parallel ranks runs 8
// micro-batches of one sequence. No gradient buckets: the sync would all-reduce over the replicas.
Config step_config(int pp, const std::string& schedule, int replicas) {
  Config c = config_from_yaml_string(fmt::format(R"(
model: {{dim: 32, n_layers: 8, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, vocab_size: {}, max_seq_len: {},
        tie_embeddings: false}}
training: {{batch_size: {}, seq_len: {}, micro_batch_size: 1, grad_bucket_mb: 0, threads: {}, seed: 3}}
parallel: {{pp: {}, pp_schedule: {}, pp_virtual: {}, dp_replicate: {}}}
)",
                                                 kVocab, kSeq, kMicroBatches * replicas, kSeq, cpu_threads(), pp,
                                                 schedule, schedule == "interleaved_1f1b" ? 2 : 1, replicas));
  return c;
}

// The same random (8, 16) batch on every rank.
Batch random_batch() {
  std::mt19937 gen(7);
  Batch b;
  b.inputs = empty({kMicroBatches, kSeq}, DType::i32), b.targets = empty({kMicroBatches, kSeq}, DType::i32);
  for (int64_t i = 0; i < b.inputs.numel(); ++i) {
    b.inputs.at<int32_t>(i) = int32_t(gen() % uint32_t(kVocab));
    b.targets.at<int32_t>(i) = int32_t(gen() % uint32_t(kVocab));
  }
  return b;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const std::vector<double> x = to_f64(a), y = to_f64(b);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - y[i]));
  return worst;
}

double max_abs(const Tensor& a) {
  double worst = 0;
  for (double v : to_f64(a)) worst = std::max(worst, std::abs(v));
  return worst;
}

// Each parameter's gradient by name (copies: the next step zeroes them).
std::map<std::string, Tensor> grads_of(const TrainRun& run) {
  std::map<std::string, Tensor> g;
  for (Parameter* p : run.params) g[p->name] = p->grad.local.clone();
  return g;
}

// One step's forwards and backwards from zeroed gradients; the losses of each micro-batch.
std::vector<Tensor> run_step(TrainRun& run, const Batch& batch) {
  zero_grads(run.params);
  return run.executor->forward_backward(run, batch, 1.0 / double(kMicroBatches * kSeq));
}

void check_pipeline_step(int pp) {
  ThreadsPerRank threads;
  const int np = world_size();
  if (np % pp != 0) {
    MT_SKIP(fmt::format("pp = {} does not divide {} ranks", pp, np));
  }
  const MpiEnv& env = test_env();
  const Batch batch = random_batch();

  // The whole model on every rank (dp_replicate = np), 8 rows each: the same batch everywhere.
  TrainRun whole = make_train_run(step_config(1, "1f1b", np), env, false);
  REQUIRE(whole.executor->pipeline() == nullptr);
  const std::vector<Tensor> want_losses = run_step(whole, batch);
  REQUIRE(want_losses.size() == size_t(kMicroBatches));
  const std::map<std::string, Tensor> want = grads_of(whole);
  // The control: the same step with its last micro-batch dropped, which every stage must tell apart.
  whole.rows -= whole.micro;
  run_step(whole, batch);
  whole.rows += whole.micro;
  const std::map<std::string, Tensor> dropped = grads_of(whole);

  for (const std::string& schedule : pp_schedule_kinds()) {
    CAPTURE(schedule);
    TrainRun run = make_train_run(step_config(pp, schedule, np / pp), env, false);
    const PipelineState* plan = run.executor->pipeline();
    REQUIRE(plan != nullptr);
    REQUIRE(plan->schedule.kind == schedule);
    REQUIRE(plan->schedule.m == kMicroBatches);
    // This rank's stages hold a part of the whole model's parameters, the rest are elsewhere, and they start
    // from the same values.
    REQUIRE(run.params.size() + run.model->elsewhere().size() == whole.params.size());
    REQUIRE(!run.params.empty());
    for (Parameter* p : run.params) {
      REQUIRE(want.count(p->name) == 1);
      const auto it =
          std::find_if(whole.params.begin(), whole.params.end(), [&](Parameter* q) { return q->name == p->name; });
      CHECK(max_abs_diff(p->value.local, (*it)->value.local) == 0);
    }

    const std::vector<Tensor> got_losses = run_step(run, batch);
    // The losses exist on the last stage only, one per micro-batch in order.
    CHECK(got_losses.size() == (run.model->has_output() ? size_t(kMicroBatches) : 0));
    for (size_t i = 0; i < got_losses.size(); ++i) {
      CAPTURE(i);
      CHECK(max_abs_diff(got_losses[i], want_losses[i]) == 0);
    }
    double worst = 0, control = 0;
    for (Parameter* p : run.params) {
      CAPTURE(p->name);
      const Tensor& g = p->grad.local;
      CHECK(max_abs(g) > 0);  // a real gradient, not two zeros compared
      worst = std::max(worst, max_abs_diff(g, want.at(p->name)));
      control = std::max(control, max_abs_diff(g, dropped.at(p->name)));
    }
    CHECK(worst == 0);
    CHECK(control > 0);  // the comparison notices one micro-batch missing
  }
}

}  // namespace

TEST_CASE("pipeline executor: pp = 2, every schedule, the local loop's gradients and losses bit for bit") {
  check_pipeline_step(2);
}

TEST_CASE("pipeline executor: pp = 4, every schedule, the local loop's gradients and losses bit for bit") {
  check_pipeline_step(4);
}
