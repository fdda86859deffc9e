// Sharded creation (ParamFactory::deferred, issue 25): a model described first, laid out by the parallel plan
// (tp styles, fully_shard, HSDP, cp), then allocated in its final layout with each rank drawing only its own
// elements, holds bit for bit the values of the same model made whole and then sharded, on every mesh that fits
// the world; and creating it never allocates a whole parameter that its layout shards (the host allocator's
// peak stays below the whole model). With draw_later (a run about to resume) the draw waits for draw_init and
// then gives the same bits, or is dropped by forget_init.
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstring>

#include "../skip.h"
#include "models/llama/llama.h"
#include "models/llama/parallelize.h"
#include "mpi_world.h"
#include "parallel/parallel_dims.h"
#include "runtime/core/allocator.h"
#include "runtime/kernels/ops.h"

using namespace mt;

namespace {

ModelConfig config() {
  return {.dim = 64, .n_layers = 2, .n_heads = 8, .n_kv_heads = 4, .ffn_dim = 96, .vocab_size = 128,
          .max_seq_len = 32, .init_std = 0.02};
}

struct Built {
  std::unique_ptr<LlamaForCausalLM> model;
  std::unique_ptr<FullyShard> fsdp;
  int64_t peak = 0;  // host bytes allocated at the peak of creation, above the start
};

Built build(const ParallelDims& pd, const DeviceMesh& mesh, bool deferred, DType dtype,
            bool draw_later = false) {
  ParamFactory f;
  f.mesh = mesh, f.dtype = dtype, f.seed = 11, f.init_std = 0.02, f.deferred = deferred, f.draw_later = draw_later;
  ParallelConfig p;
  p.fsdp.min_weight_size = 256;  // shard the small model's matrices
  const Device cpu = Device::cpu();
  empty_cache(cpu);
  const int64_t start = int64_t(allocator_stats(cpu).allocated_bytes);
  reset_peak_allocated(cpu);
  Built b;
  b.model = std::make_unique<LlamaForCausalLM>(config(), f);
  b.fsdp = parallelize_llama(*b.model, mesh, pd, p, 32, accum_dtype(dtype));
  b.peak = int64_t(allocator_stats(cpu).peak_allocated_bytes) - start;
  return b;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

}  // namespace

TEST_CASE("sharded creation: the same bits as whole-then-sharded, and no whole parameter allocated") {
  const int n = world_size();
  std::vector<std::vector<std::pair<std::string, int>>> meshes{{{dim::dp_shard, n}}};
  if (n % 2 == 0 && n >= 4) meshes.push_back({{dim::dp_shard, n / 2}, {dim::tp, 2}});
  if (n % 2 == 0 && n >= 4) meshes.push_back({{dim::dp_replicate, 2}, {dim::dp_shard, n / 2}});
  if (n == 8) meshes.push_back({{dim::dp_shard, 2}, {dim::cp_ring, 2}, {dim::tp, 2}});
  if (n == 1) MT_SKIP("needs more than one rank (on one rank nothing is sharded)");
  for (auto& sizes : meshes)
    for (DType dt : {DType::f32, DType::bf16}) {
      ParallelDims pd = ParallelDims::from_sizes(sizes);
      INFO(pd.describe(), ", ", dtype_name(dt));
      DeviceMesh mesh = pd.make_mesh();
      Built whole = build(pd, mesh, false, dt), sharded = build(pd, mesh, true, dt);
      auto a = whole.model->parameters(), b = sharded.model->parameters();
      REQUIRE(a.size() == b.size());
      int64_t model_bytes = 0, local_bytes = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        INFO(a[i]->name);
        CHECK_FALSE(is_deferred(*b[i]));
        CHECK(b[i]->value.spec.str() == a[i]->value.spec.str());
        CHECK(same_bits(b[i]->value.local, a[i]->value.local));
        CHECK(same_bits(b[i]->compute_local(), a[i]->compute_local()));
        CHECK(b[i]->grad.local.shape() == a[i]->grad.local.shape());
        model_bytes += shape_numel(a[i]->value.shape()) * 4;
        local_bytes += int64_t(a[i]->value.local.nbytes());
      }
      // Whole-then-sharded peaks above the whole model's f32 values; sharded creation at this rank's values and
      // gradients (f32: 2 x local), the bf16 copy (local / 2) and small temporaries: never a whole matrix.
      INFO("peak whole ", whole.peak, ", peak sharded ", sharded.peak, ", model ", model_bytes, ", local ", local_bytes);
      CHECK(whole.peak >= model_bytes);
      CHECK(sharded.peak <= 2 * local_bytes + (dt == DType::bf16 ? local_bytes / 2 : 0) + (16 << 10));
    }
}

// The trainer on resume (make_train_run's init_later): allocated as zeros, drawn only if no checkpoint loads them.
TEST_CASE("sharded creation drawn later: zeros until draw_init, then the same bits; forget_init drops the draw") {
  const int n = world_size();
  std::vector<std::pair<std::string, int>> sizes{{dim::dp_shard, n}};
  if (n % 2 == 0 && n >= 4) sizes = {{dim::dp_shard, n / 2}, {dim::tp, 2}};
  for (DType dt : {DType::f32, DType::bf16}) {
    ParallelDims pd = ParallelDims::from_sizes(sizes);
    INFO(pd.describe(), ", ", dtype_name(dt));
    DeviceMesh mesh = pd.make_mesh();
    Built now = build(pd, mesh, true, dt), later = build(pd, mesh, true, dt, true);
    Built dropped = build(pd, mesh, true, dt, true);
    auto a = now.model->parameters(), b = later.model->parameters(), c = dropped.model->parameters();
    REQUIRE(a.size() == b.size());
    int drawn_nonzero = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      INFO(b[i]->name);
      const Tensor& v = b[i]->value.local;
      CHECK(same_bits(v, zeros(v.shape(), v.dtype(), v.device())));  // nothing drawn yet
      drawn_nonzero += !same_bits(a[i]->value.local, zeros(v.shape(), v.dtype(), v.device()));
      CHECK(draw_init(*b[i]));
      CHECK(same_bits(b[i]->value.local, a[i]->value.local));
      CHECK(same_bits(b[i]->compute_local(), a[i]->compute_local()));
      CHECK_FALSE(draw_init(*b[i]));  // drawn once
      forget_init(*c[i]);
      CHECK_FALSE(draw_init(*c[i]));
    }
    CHECK(drawn_nonzero > 0);
  }
}
