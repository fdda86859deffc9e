#include "parallel/grad_sync.h"

#include <algorithm>
#include <map>

#include "comm/comm_counters.h"
#include "runtime/kernels/ops.h"

namespace mt {

GradSync::GradSync(Module& model, const DeviceMesh& mesh, GradSyncOptions opt) : mesh_(mesh), opt_(std::move(opt)) {
  // Owners in forward order; their parameters reversed give (about) the order backward finishes them.
  std::vector<Parameter*> order;
  for (Module* m : model.modules())
    for (Parameter* p : m->own_parameters())
      if (!p->frozen) order.push_back(p);  // a frozen parameter has no gradient to sync
  std::reverse(order.begin(), order.end());

  std::map<std::string, size_t> filling;  // group name -> index of the bucket still filling
  std::vector<int64_t> numel;             // elements per bucket
  for (Parameter* p : order) {
    std::vector<int> partial = opt_.dp_dims;
    for (int d : p->partial_dims()) partial.push_back(d);
    std::sort(partial.begin(), partial.end());
    partial.erase(std::unique(partial.begin(), partial.end()), partial.end());
    // Sums backward already did (fully_shard reduce-scatters over dp_shard) are not done again.
    const std::vector<int> reduced = p->reduced_dims();
    std::erase_if(partial, [&](int d) { return std::find(reduced.begin(), reduced.end(), d) != reduced.end(); });
    std::string dims;  // the dims that need a sum (size > 1), in mesh order
    bool general = false;
    for (int d : partial) {
      if (mesh.size(d) == 1) continue;
      dims += (dims.empty() ? "" : ",") + mesh.dims()[size_t(d)].name;
      if (!p->value.placements()[size_t(d)].is_replicate()) general = true;  // Partial -> Shard: reduce-scatter
    }
    if (dims.empty()) continue;  // one rank holds the whole gradient: nothing to sync
    if (general || opt_.bucket_bytes == 0) {
      general_.emplace_back(p, partial);
      continue;
    }
    auto it = filling.find(dims);
    bool full = it != filling.end() && size_t(numel[it->second]) * dtype_size(opt_.reduce_dtype) >= opt_.bucket_bytes;
    if (it == filling.end() || full) {
      buckets_.push_back(Bucket{dims, {}, {}, 0, Tensor(), 0, false, Work()});
      numel.push_back(0);
      it = filling.insert_or_assign(dims, buckets_.size() - 1).first;
    }
    Bucket& b = buckets_[it->second];
    b.params.push_back(p);
    b.offsets.push_back(numel[it->second]);
    // The local gradient's size from the layout: a deferred parameter (a simulated model) has no storage yet.
    numel[it->second] += shape_numel(p->value.spec.local_shape(p->value.mesh.coordinate()));
    bucket_of_[p] = it->second;
  }
  for (size_t i = 0; i < buckets_.size(); ++i) {
    buckets_[i].numel = numel[i];  // the flat buffer is made at the first launch (a simulated model never has one)
    mesh_.group(buckets_[i].dims);  // flattened groups are made collectively: here, on every rank, in one order
  }

  // The gradient of each own parameter is complete once the owner's backward has run, or, with fully_shard,
  // once its unit's backward has reduce-scattered it (grad_ready_at, whose hook runs before this one).
  if (buckets_.empty()) return;
  std::map<Module*, std::vector<Parameter*>> ready_at;
  std::vector<Module*> hooked;
  for (Module* m : model.modules())
    for (Parameter* p : m->own_parameters()) {
      if (p->frozen) continue;
      Module* at = p->grad_ready_at();
      if (!at) at = m;
      if (ready_at[at].empty()) hooked.push_back(at);
      ready_at[at].push_back(p);
    }
  for (Module* m : hooked)
    m->post_backward.push_back([this, params = ready_at[m]](Module&) {
      if (!armed_) return;
      for (Parameter* p : params) mark_ready(p);
    });
}

void GradSync::arm(bool last_micro_batch) {
  armed_ = last_micro_batch;
  if (!armed_) return;
  for (Bucket& b : buckets_) b.pending = int(b.params.size()), b.launched = false;
}

void GradSync::mark_ready(Parameter* p) {
  auto it = bucket_of_.find(p);
  if (it == bucket_of_.end()) return;
  Bucket& b = buckets_[it->second];
  if (--b.pending == 0 && !b.launched) {
    launch(b);
    ++launched_early_;
  }
}

void GradSync::launch(Bucket& b) {
  if (!b.flat.defined()) b.flat = empty({b.numel}, opt_.reduce_dtype, b.params.front()->grad.local.device());
  for (size_t i = 0; i < b.params.size(); ++i) {
    const Tensor& g = b.params[i]->grad.local;
    convert(b.flat.view(b.offsets[i], g.shape()), g);
  }
  Group& g = mesh_.group(b.dims);
  CommTag tag(kGradReduceTag);
  b.work = g.all_reduce(b.flat, ReduceOp::sum, /*async=*/true);
  b.launched = true;
}

void GradSync::finish() {
  for (Bucket& b : buckets_)
    if (!b.launched) launch(b);
  for (Bucket& b : buckets_) {
    b.work.wait();
    for (size_t i = 0; i < b.params.size(); ++i) {
      Parameter* p = b.params[i];
      convert(p->grad.local, b.flat.view(b.offsets[i], p->grad.local.shape()));
      p->grad.spec = p->value.spec;
    }
    b.launched = false;
  }
  CommTag tag(kGradRedistributeTag);
  // The general rule for the rest: mark the partial dims, redistribute to the parameter's placement
  // (in the reduce dtype, the sums widened back into the gradient).
  for (auto& [p, partial] : general_) {
    for (int d : partial)
      if (p->value.placements()[size_t(d)].is_replicate()) p->grad.spec.placements[size_t(d)] = Placement::Partial();
    if (opt_.reduce_dtype == p->grad.local.dtype()) {
      p->grad = redistribute(p->grad, p->value.spec);
      continue;
    }
    DTensor low = p->grad;
    low.local = empty(p->grad.local.shape(), opt_.reduce_dtype, p->grad.local.device());
    convert(low.local, p->grad.local);
    low = redistribute(low, p->value.spec);
    p->grad.spec = low.spec;
    if (p->grad.local.shape() != low.local.shape())
      p->grad.local = empty(low.local.shape(), p->grad.local.dtype(), low.local.device());
    convert(p->grad.local, low.local);
  }
  armed_ = false;
}

std::vector<CommBytes> GradSync::step_bytes() const {
  std::vector<CommBytes> out;
  for (const Bucket& b : buckets_) {
    const int n = mesh_.group(b.dims).size();
    const int64_t bytes = 2 * b.numel * int64_t(dtype_size(opt_.reduce_dtype)) * (n - 1) / n;
    auto it = std::find_if(out.begin(), out.end(), [&](const CommBytes& e) { return e.group == b.dims; });
    if (it == out.end()) out.push_back({kGradReduceTag, b.dims, "all_reduce", double(bytes), 1, true});
    else it->bytes += double(bytes), ++it->calls;
  }
  return out;
}

int64_t GradSync::bucket_buffer_bytes() const {
  int64_t total = 0;
  for (const Bucket& b : buckets_) total += b.numel * int64_t(dtype_size(opt_.reduce_dtype));
  return total;
}

int64_t GradSync::bucket_bytes_per_rank() const {
  int64_t total = 0;
  for (const CommBytes& c : step_bytes()) total += int64_t(c.bytes);
  return total;
}

std::string GradSync::describe() const {
  std::string s = fmt::format("{} bucket(s) ({})", buckets_.size(), dtype_name(opt_.reduce_dtype));
  for (size_t i = 0; i < buckets_.size(); ++i)
    s +=
        fmt::format("{} {:.1f} KiB over {}", i ? "," : ":", double(buckets_[i].numel * int64_t(dtype_size(opt_.reduce_dtype))) / 1024, buckets_[i].dims);
  if (!general_.empty()) s += fmt::format("; {} parameter(s) by redistribute", general_.size());
  return s;
}

}  // namespace mt
