#include "parallel/module.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "parallel/random.h"
#include "runtime/kernels/ops.h"

namespace mt {

namespace {
// Mixed precision's state: value.local rounded to the compute dtype, what layers compute with.
struct ComputeCopy : ParamState {
  Tensor copy;
  const Tensor* compute() const override { return copy.defined() ? &copy : nullptr; }
};

// Sharded creation's state until materialize(): how to draw the parameter's elements.
struct DeferredInit : ParamState {
  std::string init;  // normal | ones
  uint64_t seed = 0;
  double std = 0;
  DType master = DType::f32, compute = DType::f32;
  Device device = Device::cpu();
  bool draw_later = false;
};

// A parameter allocated without its draw (ParamFactory::draw_later): what the draw needs, until drawn or loaded.
struct UndrawnInit : ParamState {
  DeferredInit init;
};

// Only this rank's elements of p, drawn by their global index: the bits of the whole parameter's part.
// kaiming_uniform (LoRA's A, as PEFT draws it: kaiming_uniform_ with a = sqrt(5)): uniform in [-b, b), b =
// 1 / sqrt(fan_in), fan_in = the global shape's last dim.
Tensor draw_local(const Parameter& p, const DeferredInit& init) {
  if (init.init == "kaiming_uniform") {
    const double b = 1.0 / std::sqrt(double(p.value.spec.global_shape.back()));
    Tensor t = make_local(p.value.spec, p.value.mesh.coordinate(), "rand", init.master, RandomKey{init.seed, p.name});
    scale_(t, 2 * b);
    add_(t, make_local(p.value.spec, p.value.mesh.coordinate(), "full", init.master, {}, -b));
    return t;
  }
  return make_local(p.value.spec, p.value.mesh.coordinate(), init.init == "normal" ? "randn" : init.init, init.master,
                    RandomKey{init.seed, p.name}, 0, 0.0, init.std);
}

template <class S> void erase_state(Parameter& p) {
  p.states.erase(std::remove_if(p.states.begin(), p.states.end(),
                                [](const std::shared_ptr<ParamState>& s) { return dynamic_cast<S*>(s.get()); }),
                 p.states.end());
}

// The gradient and the compute copy of a parameter whose value was just allocated.
void finish_param(Parameter& p, DType compute) {
  const DType master = p.value.local.dtype();
  p.grad = p.value;
  p.grad.local = p.frozen ? Tensor() : zeros(p.value.local.shape(), master, p.value.local.device());
  if (master != compute) {
    auto copy = std::make_shared<ComputeCopy>();
    copy->copy = empty(p.value.local.shape(), compute, p.value.local.device());
    // First: the copy of this rank's value is the base that layout states (fully_shard's gathered weight) override
    // while they hold a tensor. Under sharded creation they were added before the value existed.
    p.states.insert(p.states.begin(), copy);
    refresh_compute_copy(p);
  }
}
}  // namespace

namespace {
thread_local int g_saved_slot = 0;
}
int saved_slot() { return g_saved_slot; }
SavedSlot::SavedSlot(int slot) : previous_(g_saved_slot) { g_saved_slot = slot; }
SavedSlot::~SavedSlot() { g_saved_slot = previous_; }

namespace {
thread_local WeightGradQueue* g_wgrad_queue = nullptr;
}
WeightGradQueue* weight_grad_queue() { return g_wgrad_queue; }
DeferWeightGrads::DeferWeightGrads(WeightGradQueue* q) : previous_(g_wgrad_queue) { g_wgrad_queue = q; }
DeferWeightGrads::~DeferWeightGrads() { g_wgrad_queue = previous_; }

Tensor Module::call(const Tensor& x) {
  return call_around([&] {
    Tensor h = x;
    for (auto& hook : input_hooks) h = hook.forward(h);
    Tensor y = forward(h);
    if (recompute) {  // keep the input only
      recompute_input_ = h;
      for (Module* m : modules()) m->drop_saved();
    }
    return y;
  });
}

Tensor Module::call_backward(const Tensor& dy) {
  return call_backward_around(dy, [&](const Tensor& g) {
    if (recompute) {  // forward again on the kept input: the subtree saves what its backward needs
      MT_CHECK(recompute_input_->defined(), "module", "{}: backward without a forward to recompute", name_);
      auto sub = modules();
      for (Module* m : sub) m->recomputing_ = true;
      forward(recompute_input_);
      for (Module* m : sub) m->recomputing_ = false;
      recompute_input_ = Tensor();
    }
    Tensor dx = backward(g);
    for (auto it = input_hooks.rbegin(); it != input_hooks.rend(); ++it)
      if (dx.defined()) dx = it->backward(dx);
    return dx;
  });
}

void Module::remove_children(const std::function<bool(const Module*)>& drop) {
  std::erase_if(children_, [&](Module* c) { return drop(c); });
  std::erase_if(owned_, [&](const std::unique_ptr<Module>& c) { return drop(c.get()); });
}

std::vector<Module*> Module::modules() {
  std::vector<Module*> out{this};
  for (Module* c : children_) {
    auto sub = c->modules();
    out.insert(out.end(), sub.begin(), sub.end());
  }
  return out;
}

std::vector<Parameter*> Module::parameters() {
  std::vector<Parameter*> out;
  std::set<Parameter*> seen;
  for (Module* m : modules())
    for (Parameter* p : m->own_parameters())
      if (seen.insert(p).second) out.push_back(p);
  return out;
}

std::vector<Parameter*> Module::used_parameters() const {
  std::vector<Parameter*> out = borrowed_params_;
  out.insert(out.end(), own_params_.begin(), own_params_.end());
  return out;
}

Parameter* Module::add_parameter(std::unique_ptr<Parameter> p) {
  Parameter* raw = p.get();
  own_params_.push_back(raw);
  owned_params_.push_back(std::move(p));
  return raw;
}

std::string child_name(const std::string& parent, const std::string& child) {
  return parent.empty() ? child : parent + "." + child;
}

std::unique_ptr<Parameter> ParamFactory::make(const std::string& name, const Shape& shape,
                                              const std::string& init) const {
  auto p = std::make_unique<Parameter>();
  p->name = name;
  p->init = init;
  p->weight_decay = shape.size() >= 2;
  MT_CHECK(init == "ones" || init == "zeros" || init == "normal" || init == "kaiming_uniform", "model",
           "{}: unknown init '{}'", name, init);
  Placements rep(size_t(mesh.ndim()), Placement::Replicate());
  const DType master = accum_dtype(dtype);  // initialised in f32 and rounded: the same draw as an f32 model
  if (deferred) {
    p->value.mesh = mesh;
    p->value.spec = DTensorSpec::make(mesh.dims(), rep, shape);
    p->grad = p->value;
    auto d = std::make_shared<DeferredInit>();
    d->init = init, d->seed = seed, d->std = init_std, d->master = master, d->compute = dtype, d->device = device;
    d->draw_later = draw_later;
    p->states.push_back(d);
    return p;
  }
  if (init == "ones") p->value = ones(mesh, shape, rep, master);
  else if (init == "zeros") p->value = zeros(mesh, shape, rep, master);
  else if (init == "kaiming_uniform") {
    p->value = zeros(mesh, shape, rep, master);
    DeferredInit d;
    d.init = init, d.seed = seed, d.master = master;
    p->value.local = draw_local(*p, d);
  } else p->value = randn(mesh, shape, rep, RandomKey{seed, name}, master, 0.0, init_std);
  if (device.is_cuda()) p->value.local = p->value.local.to(device);
  finish_param(*p, dtype);
  return p;
}

bool is_deferred(const Parameter& p) { return p.state<DeferredInit>() != nullptr; }

DType compute_dtype(const Parameter& p) {
  if (const DeferredInit* d = p.state<DeferredInit>()) return d->compute;
  return p.compute_local().dtype();
}

void materialize(Parameter& p) {
  const DeferredInit* d = p.state<DeferredInit>();
  if (!d) return;
  const DeferredInit init = *d;
  erase_state<DeferredInit>(p);
  // A frozen parameter (LoRA's base) is held in the compute dtype alone: no optimizer updates it, so it needs no
  // f32 master (bf16: 2 bytes an element instead of 6).
  const DType held = p.frozen ? init.compute : init.master;
  if (init.draw_later) {
    p.value.local = zeros(p.value.spec.local_shape(p.value.mesh.coordinate()), held, init.device);
    auto u = std::make_shared<UndrawnInit>();
    u->init = init;
    p.states.push_back(u);
  } else {
    Tensor local = draw_local(p, init);  // drawn in the master dtype, rounded once: the bits of the copy it replaces
    if (held != local.dtype()) {
      Tensor c = empty(local.shape(), held);
      convert(c, local);
      local = c;
    }
    p.value.local = init.device.is_cuda() ? local.to(init.device) : local;
  }
  finish_param(p, init.compute);
}

bool draw_init(Parameter& p) {
  const UndrawnInit* u = p.state<UndrawnInit>();
  if (!u) return false;
  const Tensor local = draw_local(p, u->init);
  erase_state<UndrawnInit>(p);
  const Tensor src = p.value.local.device().is_cuda() ? local.to(p.value.local.device()) : local;
  if (src.dtype() == p.value.local.dtype()) copy_(p.value.local, src);
  else convert(p.value.local, src);  // a frozen parameter held in the compute dtype
  refresh_compute_copy(p);
  return true;
}

void forget_init(Parameter& p) { erase_state<UndrawnInit>(p); }

const Tensor& Parameter::compute_local() const {
  for (auto it = states.rbegin(); it != states.rend(); ++it)
    if (const Tensor* t = (*it)->compute()) return *t;
  return value.local;
}

const Tensor& Parameter::grad_local() const {
  MT_CHECK(!frozen, "model", "{} is frozen: it has no gradient", name);
  for (auto it = states.rbegin(); it != states.rend(); ++it)
    if (const Tensor* t = (*it)->grad()) return *t;
  return grad.local;
}

Shape Parameter::compute_offset() const {
  std::vector<int> coord = value.mesh.coordinate();
  // Whole on a dim whether or not it is gathered right now: the loss asks lm_head's vocabulary offset after its
  // unit has been freed, and the offset of what layers compute with inside the unit is what it needs.
  for (auto& s : states)
    if (int d = s->whole_on_dim(); d >= 0) coord[size_t(d)] = 0;
  return value.spec.local_offset(coord);
}

std::vector<int> Parameter::partial_dims() const {
  std::vector<int> dims;
  for (auto& s : states) s->add_partial_dims(dims);
  return dims;
}

std::vector<int> Parameter::reduced_dims() const {
  std::vector<int> dims;
  for (auto& s : states) s->add_reduced_dims(dims);
  return dims;
}

Module* Parameter::grad_ready_at() const {
  for (auto it = states.rbegin(); it != states.rend(); ++it)
    if (Module* m = (*it)->grad_ready_at()) return m;
  return nullptr;
}

void relayout_param(Parameter& p, const Placements& placements, const ShardOrder& order) {
  if (is_deferred(p)) {  // only the description changes: storage comes in the final layout
    p.value.spec = DTensorSpec::make(p.value.spec.mesh, placements, p.value.spec.global_shape, order);
    p.grad = p.value;
    return;
  }
  p.value = redistribute(p.value, placements, {}, order);
  p.grad = p.value;
  p.grad.local = p.frozen ? Tensor() : zeros(p.value.local.shape(), p.value.local.dtype(), p.value.local.device());
  refresh_compute_copy(p);
}

Tensor compute_copy(const Parameter& p) {
  const ComputeCopy* c = p.state<ComputeCopy>();
  return c ? c->copy : Tensor();
}

void refresh_compute_copy(Parameter& p) {
  ComputeCopy* c = p.state<ComputeCopy>();
  if (!c) return;
  if (c->copy.shape() != p.value.local.shape())
    c->copy = empty(p.value.local.shape(), c->copy.dtype(), p.value.local.device());
  convert(c->copy, p.value.local);
}

void freeze(Parameter& p) {
  p.frozen = true;
  p.grad.local = Tensor();
}

std::vector<Parameter*> trainable(const std::vector<Parameter*>& params) {
  std::vector<Parameter*> out;
  for (Parameter* p : params)
    if (!p->frozen) out.push_back(p);
  return out;
}

void zero_grads(const std::vector<Parameter*>& params) {
  for (Parameter* p : params) {
    if (p->frozen) continue;
    fill_zero_(p->grad.local);
    p->grad.spec = p->value.spec;
  }
}

}  // namespace mt
