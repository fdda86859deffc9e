#include "parallel/module.h"

#include <set>

#include "parallel/random.h"
#include "runtime/kernels/ops.h"

namespace mt {

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
    p->compute = empty(p->value.local.shape(), dtype, device);
    p->refresh_compute();
  }
  return p;
}

Shape Parameter::compute_offset() const {
  std::vector<int> coord = value.mesh.coordinate();
  if (unshard_dim >= 0) coord[size_t(unshard_dim)] = 0;
  return value.spec.local_offset(coord);
}

void Parameter::refresh_compute() {
  if (!compute.defined()) return;
  if (compute.shape() != value.local.shape())
    compute = empty(value.local.shape(), compute.dtype(), value.local.device());
  convert(compute, value.local);
}

void zero_grads(const std::vector<Parameter*>& params) {
  for (Parameter* p : params) {
    fill_zero_(p->grad.local);
    p->grad.spec = p->value.spec;
  }
}

}  // namespace mt
