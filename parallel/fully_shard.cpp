#include "parallel/fully_shard.h"

#include "runtime/core/trace.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "comm/comm_counters.h"
#include "parallel/style.h"
#include "runtime/core/log.h"
#include "runtime/core/trace.h"
#include "runtime/kernels/ops.h"

namespace mt {

// What fully_shard tells the layers and the gradient sync about one of its parameters (ParamState): while
// the unit runs, the weight gathered over the fsdp mesh dim (the shape layers expect) and, in backward, the
// full-size gradient the layers write; the unit's hook reduce-scatters it into the sharded gradient.
struct FsdpParamState : ParamState {
  Tensor unsharded, unsharded_grad;  // undefined outside the unit's forward and backward
  int mesh_dim = -1;                 // the fsdp mesh dim: unsharded is whole on it
  Module* ready_at = nullptr;        // the unit's first module: its post_backward completes the gradient
  const Tensor* compute() const override { return unsharded.defined() ? &unsharded : nullptr; }
  const Tensor* grad() const override { return unsharded_grad.defined() ? &unsharded_grad : nullptr; }
  int whole_on_dim() const override { return mesh_dim; }
  void add_reduced_dims(std::vector<int>& dims) const override { dims.push_back(mesh_dim); }
  Module* grad_ready_at() const override { return ready_at; }
};

// One sharded parameter of a unit and where its pieces sit in the unit's flat buffers.
struct FsdpParam {
  Parameter* p = nullptr;
  std::shared_ptr<FsdpParamState> state;  // also in p->states
  int dim = 0;                 // the tensor dim sharded on the fsdp mesh dim
  Shape full;                  // the gathered shape (this rank's tp part, whole on the fsdp dim)
  Shape padded;                // full with dim = chunk: one rank's slot
  std::vector<int64_t> start;  // per fsdp rank: first index along dim of its piece, in full
  std::vector<int64_t> len;    // per fsdp rank: the piece's length along dim (torch.chunk: the last may be short)
  int64_t offset = 0;          // of the slot in a rank's flat buffer (elements)
  int64_t grad_offset = -1;    // of the slot in a rank's gradient buffer (elements); -1: frozen, no gradient
};

struct FsdpUnit {
  std::string name;
  std::vector<Module*> modules;  // forward order
  std::vector<FsdpParam> params;
  int64_t slot = 0;  // elements of one rank's flat buffer
  int64_t grad_slot = 0;  // elements of one rank's gradient buffer: the trainable parameters' slots only (LoRA)
  Group* group = nullptr;
  int n = 1, rank = 0;
  FullyShardOptions opt;
  FsdpUnit* prev = nullptr;  // units in forward order
  FsdpUnit* next = nullptr;
  Tensor own;       // (slot) this rank's shards, the gather's input (kept until it is done)
  Tensor gathered;  // (n * slot) param_dtype while a gather is in flight or unpacked
  Work pending;
  bool in_flight = false, unpacked = false;
  const bool* hold = nullptr;  // FullyShard::hold_: keep gathered and defer the reduce-scatter to release()

  Device device() const { return params.front().p->value.local.device(); }

  // Starts the all-gather of this unit's shards (no-op if started or done).
  void start_gather() {
    if (in_flight || unpacked || params.empty()) return;
    trace::UnitScope unit_memory;  // the trace's "fully_shard units" part
    own = empty({slot}, opt.param_dtype, device());
    for (FsdpParam& f : params) {
      Tensor shard = f.p->compute_local();  // the shard: nothing is gathered here
      if (shard.dtype() != opt.param_dtype) {
        Tensor c = empty(shard.shape(), opt.param_dtype, shard.device());
        convert(c, shard);
        shard = c;
      }
      copy_slice(own.view(f.offset, f.padded), 0, shard, 0, f.len[size_t(rank)], f.dim);
    }
    gathered = empty({int64_t(n) * slot}, opt.param_dtype, device());
    CommTag tag(kFsdpGatherTag);
    pending = group->all_gather(gathered, own, /*async=*/true);
    in_flight = true;
  }
  // Waits for the gather and gives every parameter its whole tensor.
  void materialize() {
    if (unpacked || params.empty()) return;
    trace::UnitScope unit_memory;  // the trace's "fully_shard units" part
    start_gather();
    pending.wait();
    in_flight = false;
    own = Tensor();
    for (FsdpParam& f : params) {
      Tensor full = empty(f.full, opt.param_dtype, device());
      for (int r = 0; r < n; ++r)
        copy_slice(full, f.start[size_t(r)], gathered.view(int64_t(r) * slot + f.offset, f.padded), 0, f.len[size_t(r)],
                   f.dim);
      f.state->unsharded = full;
    }
    gathered = Tensor();
    unpacked = true;
  }
  void free_params() {
    for (FsdpParam& f : params) f.state->unsharded = Tensor();
    unpacked = false;
  }
  // The full-size gradient buffers backward writes into.
  void give_grads() {
    trace::UnitScope unit_memory;  // the trace's "fully_shard units" part
    for (FsdpParam& f : params)
      if (f.grad_offset >= 0 && !f.state->unsharded_grad.defined())
        f.state->unsharded_grad = zeros(f.full, f.p->grad.local.dtype(), f.p->grad.local.device());
  }
  // Reduce-scatters the full-size gradients and adds each rank's piece to its sharded gradient.
  // Frozen parameters (LoRA's base) have no gradient and no slot in it: a unit of only frozen ones reduces nothing.
  void reduce_grads() {
    if (grad_slot == 0) return;
    trace::UnitScope unit_memory;  // the trace's "fully_shard units" part
    const DType rdt = opt.reduce_dtype;
    Tensor all = zeros({int64_t(n) * grad_slot}, rdt, device());  // padding summed as zeros, never read
    for (FsdpParam& f : params) {
      if (f.grad_offset < 0) continue;
      Tensor g = f.state->unsharded_grad;
      if (g.dtype() != rdt) {
        Tensor c = empty(g.shape(), rdt, g.device());
        convert(c, g);
        g = c;
      }
      for (int r = 0; r < n; ++r)
        copy_slice(all.view(int64_t(r) * grad_slot + f.grad_offset, f.padded), 0, g, f.start[size_t(r)],
                   f.len[size_t(r)], f.dim);
      // Packed: the full-size gradient is not needed any more, and the unit's peak is its reduce (flat buffer +
      // the gradients not yet packed), not the sum of both.
      f.state->unsharded_grad = Tensor();
    }
    Tensor own = empty({grad_slot}, rdt, device());
    CommTag tag(kFsdpReduceTag);
    group->reduce_scatter(own, all, ReduceOp::sum);
    for (FsdpParam& f : params) {
      if (f.grad_offset < 0) continue;
      const Tensor& dst = f.p->grad.local;  // (the shard) accumulates over micro-batches
      Tensor piece = empty(dst.shape(), rdt, dst.device());
      copy_slice(piece, 0, own.view(f.grad_offset, f.padded), 0, f.len[size_t(rank)], f.dim);
      if (rdt != dst.dtype()) {
        Tensor c = empty(dst.shape(), dst.dtype(), dst.device());
        convert(c, piece);
        piece = c;
      }
      add_(dst, piece);
    }
  }
};

namespace {

std::vector<std::string> split_plus(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string part;
  while (std::getline(ss, part, '+'))
    if (!part.empty()) out.push_back(part);
  return out;
}

// Shards p on mesh_dim along tensor_dim, applied after any other mesh dim that splits that tensor dim: a tp
// part stays the block of rows tp gives it, and dp_shard splits that block, so gathering over dp_shard gives
// exactly the tensor the tp-parallel layers compute with. Keeps this rank's part: no communication.
void shard_last(Parameter& p, int mesh_dim, int tensor_dim) {
  Placements pl = p.value.placements();
  pl[size_t(mesh_dim)] = Placement::Shard(tensor_dim);
  ShardOrder order = p.value.spec.shard_order;
  if (order.size() != p.value.shape().size()) {  // no explicit order: mesh-dim order
    order.assign(p.value.shape().size(), {});
    for (size_t m = 0; m < pl.size(); ++m)
      if (int(m) != mesh_dim && pl[m].is_shard()) order[size_t(pl[m].dim)].push_back(int(m));
  }
  order[size_t(tensor_dim)].push_back(mesh_dim);
  relayout_param(p, pl, order);
}

// A unit as the patterns give it: its name and its modules in forward order.
struct UnitSpec {
  std::string name;
  std::vector<Module*> modules;
};

// Phase 1, the units: every pattern must match; no module in two units; no parameter in two units. In forward
// order.
std::vector<UnitSpec> find_units(Module& root, const FullyShardOptions& opts) {
  auto modules = root.modules();
  std::map<Module*, size_t> order;  // forward order of modules (depth first = the order they run here)
  for (size_t i = 0; i < modules.size(); ++i) order[modules[i]] = i;
  std::vector<UnitSpec> specs;
  for (const std::string& u : opts.units) {
    auto parts = split_plus(u);
    MT_CHECK(!parts.empty(), "config", "parallel.fsdp.patterns: an empty unit pattern");
    std::vector<std::vector<Module*>> matches;
    for (const std::string& pat : parts) {
      std::vector<Module*> found;
      for (Module* m : modules)
        if (!m->name().empty() && pattern_matches(pat, m->name())) found.push_back(m);
      MT_CHECK(!found.empty(), "config", "parallel.fsdp.patterns: pattern '{}' matches no module of the model", pat);
      matches.push_back(found);
    }
    if (parts.size() == 1) {
      for (Module* m : matches[0]) specs.push_back({m->name(), {m}});
    } else {
      UnitSpec s{u, {}};
      for (auto& f : matches) s.modules.insert(s.modules.end(), f.begin(), f.end());
      std::sort(s.modules.begin(), s.modules.end(), [&](Module* a, Module* b) { return order[a] < order[b]; });
      specs.push_back(s);
    }
  }
  std::map<Module*, std::string> module_unit;
  std::map<Parameter*, std::string> param_unit;
  for (const UnitSpec& s : specs)
    for (Module* m : s.modules) {
      for (Module* sub : m->modules()) {
        auto [it, fresh] = module_unit.emplace(sub, s.name);
        MT_CHECK(fresh || it->second == s.name, "config", "fully_shard: module {} is in two units, '{}' and '{}'",
                 sub->name(), it->second, s.name);
        for (Parameter* p : sub->own_parameters()) {
          auto [pit, pfresh] = param_unit.emplace(p, s.name);
          MT_CHECK(pfresh || pit->second == s.name, "config",
                   "fully_shard: parameter {} is used by units '{}' and '{}' (tied embeddings?): put the modules that "
                   "share it in one unit ('a+b')",
                   p->name, pit->second, s.name);
        }
      }
    }
  std::sort(specs.begin(), specs.end(),
            [&](const UnitSpec& a, const UnitSpec& b) { return order[a.modules.front()] < order[b.modules.front()]; });

  return specs;
}

// Phase 2 for one parameter the rule shards: sharded, its state given to it, and where its pieces go in the
// unit's flat buffers.
FsdpParam place_param(Parameter* p, const FsdpDecision& d, const DeviceMesh& mesh, int mdim, Module* ready_at,
                      int64_t offset) {
  const int n = mesh.size(mdim);
  shard_last(*p, mdim, d.tensor_dim);
  FsdpParam f;
  f.p = p;
  f.state = std::make_shared<FsdpParamState>();
  f.state->mesh_dim = mdim;
  f.state->ready_at = ready_at;
  p->states.push_back(f.state);
  f.dim = d.tensor_dim;
  std::vector<int> coord = mesh.coordinate();
  int64_t first = 0, total = 0, chunk = 0;
  for (int r = 0; r < n; ++r) {
    coord[size_t(mdim)] = r;
    int64_t off = p->value.spec.local_offset(coord)[size_t(f.dim)];
    int64_t len = p->value.spec.local_shape(coord)[size_t(f.dim)];
    if (r == 0) first = off;
    f.start.push_back(off - first);
    f.len.push_back(len);
    total += len;
    chunk = std::max(chunk, len);
  }
  f.full = p->value.spec.local_shape(mesh.coordinate());  // the shard's shape (allocated or not yet)
  f.full[size_t(f.dim)] = total;
  f.padded = f.full;
  f.padded[size_t(f.dim)] = chunk;
  f.offset = offset;
  return f;
}

// Phase 2, one unit: every parameter's layout decided (pure, recorded in decisions), then the sharded ones placed.
std::unique_ptr<FsdpUnit> shard_unit(const UnitSpec& s, const DeviceMesh& mesh, int mdim, const FullyShardOptions& opts,
                                     std::vector<FsdpDecision>& decisions) {
  auto unit = std::make_unique<FsdpUnit>();
  unit->name = s.name;
  unit->modules = s.modules;
  unit->group = &mesh.group(mdim);
  unit->n = mesh.size(mdim), unit->rank = mesh.coordinate(mdim);
  unit->opt = opts;
  std::set<Parameter*> seen;
  for (Module* m : s.modules)
    for (Parameter* p : m->parameters()) {
      if (!seen.insert(p).second) continue;
      FsdpDecision d = decide_fsdp_layout(p->name, p->value.spec, mdim, opts.min_weight_size);
      decisions.push_back(d);
      if (d.tensor_dim < 0) {
        if (d.warn && mesh.world_rank() == 0) spdlog::warn("fully_shard: {}: {}", p->name, d.reason);
        continue;
      }
      MT_CHECK(p->value.placements()[size_t(mdim)].is_replicate(), "parallel",
               "fully_shard: {} is already laid out as {} on {}", p->name, p->value.placements()[size_t(mdim)].str(),
               opts.mesh_dim);
      unit->params.push_back(place_param(p, d, mesh, mdim, s.modules.front(), unit->slot));
      unit->slot += shape_numel(unit->params.back().padded);
      if (!p->frozen) {
        unit->params.back().grad_offset = unit->grad_slot;
        unit->grad_slot += shape_numel(unit->params.back().padded);
      }
    }
  return unit;
}

// Phase 3, the hooks: gather before a unit's forward and backward, prefetch the next one, free after,
// reduce-scatter the gradients after backward.
void install_unit_hooks(FsdpUnit* u) {
  if (u->params.empty()) return;
  Module* first = u->modules.front();
  Module* last = u->modules.back();
  first->pre_forward.push_back([u](Module&) {
    u->materialize();
    for (FsdpUnit* nx = u->next; nx; nx = nx->next)
      if (!nx->params.empty()) {
        nx->start_gather();  // in flight while this unit computes
        break;
      }
  });
  last->post_forward.push_back([u](Module&) {
    if (u->opt.reshard_after_forward) u->free_params();
  });
  last->pre_backward.push_back([u](Module&) {
    u->materialize();
    u->give_grads();
    for (FsdpUnit* pv = u->prev; pv; pv = pv->prev)
      if (!pv->params.empty()) {
        pv->start_gather();
        break;
      }
  });
  first->post_backward.push_back([u](Module&) {
    if (u->hold && *u->hold) return;  // a pipeline step: once, after its last micro-batch (FullyShard::release)
    u->free_params();  // first: the reduce needs only the gradients, so the gathered weights leave before it
    u->reduce_grads();
  });
}

}  // namespace

FsdpDecision decide_fsdp_layout(const std::string& name, const DTensorSpec& spec, int mesh_dim,
                                int64_t min_weight_size) {
  FsdpDecision d;
  d.param = name;
  const Shape& shape = spec.global_shape;
  const int64_t numel = shape_numel(shape);
  const int64_t n = spec.mesh[size_t(mesh_dim)].size;
  if (numel <= min_weight_size) {
    d.reason = fmt::format("{} elements <= min_weight_size {}", numel, min_weight_size);
    return d;
  }
  // Mesh dims other than the fsdp one that shard each tensor dim (their product).
  std::vector<int64_t> others(shape.size(), 1);
  for (size_t m = 0; m < spec.placements.size(); ++m)
    if (int(m) != mesh_dim && spec.placements[m].is_shard())
      others[size_t(spec.placements[m].dim)] *= spec.mesh[m].size;
  std::vector<int> order(shape.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return shape[size_t(a)] > shape[size_t(b)]; });
  for (int t : order)  // the largest dim nothing else shards
    if (others[size_t(t)] == 1 && shape[size_t(t)] % n == 0) {
      d.tensor_dim = t;
      d.reason = fmt::format("largest dim divisible by {} = {}: dim {} ({})", spec.mesh[size_t(mesh_dim)].name, n, t,
                             shape[size_t(t)]);
      return d;
    }
  for (int t : order)  // else a dim another mesh dim shards: sharded over both
    if (others[size_t(t)] > 1 && shape[size_t(t)] % (n * others[size_t(t)]) == 0) {
      d.tensor_dim = t;
      d.with_tp = true;
      d.reason = fmt::format("only dim {} ({}) divides, already sharded {}x: sharded over both ({} = {} x {} parts)", t,
                             shape[size_t(t)], others[size_t(t)], shape[size_t(t)], others[size_t(t)], n);
      return d;
    }
  d.warn = true;
  d.reason = fmt::format("no dim of {} divides by {} = {}: stays replicated", shape_str(shape),
                         spec.mesh[size_t(mesh_dim)].name, n);
  return d;
}

FullyShard::~FullyShard() = default;

void FullyShard::hold() {
  MT_CHECK(!opts_.reshard_after_forward, "parallel",
           "fully_shard: hold() keeps units gathered through a step: only with reshard_after_forward false");
  hold_ = true;
}

void FullyShard::release() {
  hold_ = false;
  for (auto& u : units_) {
    if (u->params.empty() || !u->unpacked) continue;
    bool has_grads = false;
    for (FsdpParam& f : u->params) has_grads |= f.state->unsharded_grad.defined();
    u->free_params();
    if (has_grads) u->reduce_grads();
  }
}

std::string FullyShard::describe() const {
  int sharded = 0, both = 0, replicated = 0;
  for (auto& d : decisions_) {
    if (d.tensor_dim < 0) ++replicated;
    else ++sharded, both += d.with_tp;
  }
  return fmt::format("{} units; {} parameters sharded ({} over two mesh dims), {} replicated", units_.size(), sharded,
                     both, replicated);
}

FsdpStepBytes fsdp_step_bytes(const FullyShard& fs, int n) {
  const double slot = double(fs.slot_elements()), gather = double(n - 1) * slot * double(dtype_size(fs.options().param_dtype));
  FsdpStepBytes b;
  b.forward = gather;
  b.backward = (fs.options().reshard_after_forward ? gather : 0.0) +
               double(n - 1) * double(fs.grad_slot_elements()) * double(dtype_size(fs.options().reduce_dtype));
  return b;
}

std::vector<CommBytes> fsdp_step_collectives(const FullyShard& fs, int n, int64_t micro_batches, bool pipelined) {
  const FsdpStepBytes b = fsdp_step_bytes(fs, n);
  const bool reshard = fs.options().reshard_after_forward;
  const double times = pipelined && !reshard ? 1.0 : double(micro_batches);
  const double rs = double(n - 1) * double(fs.grad_slot_elements()) * double(dtype_size(fs.options().reduce_dtype));
  const int64_t units = int64_t(fs.unit_slots().size());
  int64_t reducing = 0;  // units with a trainable parameter (all of them without LoRA)
  for (int64_t e : fs.unit_grad_slots()) reducing += e > 0;
  const std::string& group = fs.options().mesh_dim;
  return {{kFsdpGatherTag, group, "all_gather", times * (b.forward + b.backward - rs),
           int64_t(times) * units * (reshard ? 2 : 1), true},
          {kFsdpReduceTag, group, "reduce_scatter", times * rs, int64_t(times) * reducing, true}};
}

std::vector<int64_t> FullyShard::unit_slots() const {
  std::vector<int64_t> out;
  for (auto& u : units_) out.push_back(u->slot);
  return out;
}

std::vector<std::vector<int64_t>> FullyShard::unit_param_elements() const {
  std::vector<std::vector<int64_t>> out;
  for (auto& u : units_) {
    out.emplace_back();
    for (const FsdpParam& f : u->params) out.back().push_back(shape_numel(f.full));
  }
  return out;
}

std::vector<std::vector<int64_t>> FullyShard::unit_grad_param_elements() const {
  std::vector<std::vector<int64_t>> out;
  for (auto& u : units_) {
    out.emplace_back();
    for (const FsdpParam& f : u->params)
      if (f.grad_offset >= 0) out.back().push_back(shape_numel(f.full));
  }
  return out;
}

int64_t FullyShard::slot_elements() const {
  int64_t n = 0;
  for (auto& u : units_) n += u->slot;
  return n;
}

int64_t FullyShard::grad_slot_elements() const {
  int64_t n = 0;
  for (auto& u : units_) n += u->grad_slot;
  return n;
}

std::vector<int64_t> FullyShard::unit_grad_slots() const {
  std::vector<int64_t> out;
  for (auto& u : units_) out.push_back(u->grad_slot);
  return out;
}

std::vector<std::string> FullyShard::unit_names() const {
  std::vector<std::string> out;
  for (auto& u : units_) out.push_back(u->name);
  return out;
}

std::unique_ptr<FullyShard> fully_shard(Module& root, const DeviceMesh& mesh, const FullyShardOptions& opts) {
  MT_CHECK(opts.min_weight_size >= 0, "config", "parallel.fsdp.min_weight_size = {}: expected >= 0",
           opts.min_weight_size);
  const int mdim = mesh.dim_index(opts.mesh_dim);
  std::vector<UnitSpec> specs = find_units(root, opts);  // 1. (checks everything before any parameter changes)
  auto fs = std::unique_ptr<FullyShard>(new FullyShard());
  fs->opts_ = opts;
  for (const UnitSpec& s : specs) fs->units_.push_back(shard_unit(s, mesh, mdim, opts, fs->decisions_));  // 2.
  for (size_t i = 0; i < fs->units_.size(); ++i) {
    fs->units_[i]->prev = i > 0 ? fs->units_[i - 1].get() : nullptr;
    fs->units_[i]->next = i + 1 < fs->units_.size() ? fs->units_[i + 1].get() : nullptr;
    fs->units_[i]->hold = &fs->hold_;
  }
  for (auto& u : fs->units_) install_unit_hooks(u.get());  // 3.
  return fs;
}

}  // namespace mt
