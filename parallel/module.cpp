#include "parallel/module.h"

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
}  // namespace

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
      MT_CHECK(recompute_input_.defined(), "module", "{}: backward without a forward to recompute", name_);
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
  Placements rep(size_t(mesh.ndim()), Placement::Replicate());
  const DType master = accum_dtype(dtype);  // initialised in f32 and rounded: the same draw as an f32 model
  if (init == "ones") {
    p->value = ones(mesh, shape, rep, master);
  } else if (init == "normal") {
    p->value = randn(mesh, shape, rep, RandomKey{seed, name}, master, 0.0, init_std);
  } else {
    fail("model", "{}: unknown init '{}'", name, init);
  }
  if (device.is_cuda()) p->value.local = p->value.local.to(device);
  p->grad = p->value;
  p->grad.local = zeros(p->value.local.shape(), master, device);
  if (master != dtype) {
    auto copy = std::make_shared<ComputeCopy>();
    copy->copy = empty(p->value.local.shape(), dtype, device);
    p->states.push_back(copy);
    refresh_compute_copy(*p);
  }
  return p;
}

const Tensor& Parameter::compute_local() const {
  for (auto it = states.rbegin(); it != states.rend(); ++it)
    if (const Tensor* t = (*it)->compute()) return *t;
  return value.local;
}

const Tensor& Parameter::grad_local() const {
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
  p.value = redistribute(p.value, placements, {}, order);
  p.grad = p.value;
  p.grad.local = zeros(p.value.local.shape(), p.value.local.dtype(), p.value.local.device());
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

void zero_grads(const std::vector<Parameter*>& params) {
  for (Parameter* p : params) {
    fill_zero_(p->grad.local);
    p->grad.spec = p->value.spec;
  }
}

}  // namespace mt
