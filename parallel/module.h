// Module: a node of the model tree, named by its dotted path (the Hugging Face
// Llama names: "model.layers.3.self_attn.q_proj"). Parameters are DTensors with
// a gradient DTensor beside them. Each layer writes forward and backward side by
// side and keeps what its backward needs from the last forward.
//
// Activations are local Tensors. Parallel styles (style.h) change layouts at
// module boundaries through layout hooks: call() runs the input hooks, forward
// and the output hooks; call_backward() runs the same in reverse, each hook's
// backward on the gradient. Parameter gathering and recompute hook in with
// pre_forward / post_backward callbacks.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallel/dtensor.h"

namespace mt {

struct Parameter {
  std::string name;             // "model.layers.0.self_attn.q_proj.weight"
  DTensor value;                // the parameter as laid out on the mesh
  DTensor grad;                 // same local shape; after backward its spec says how it is partial
  bool weight_decay = true;     // AdamW decays 2-D weights only
  std::string init = "normal";  // normal | ones
  // Mesh dims over which backward leaves this gradient partial besides the data-parallel ones
  // (a sequence-parallel norm's weight: each tp rank saw part of the sequence).
  std::vector<int> grad_partial_dims;
  // Mixed precision: value and grad are the f32 master weights and gradient (what the optimizer,
  // the gradient sync and checkpoints see); compute is the bf16 copy of value.local the layers
  // run with, rewritten by the optimizer step. Undefined when the model computes in value's dtype.
  Tensor compute;
  // Fully sharded data parallel (fully_shard): while the parameter's unit runs, unsharded holds the
  // weight gathered over the fsdp mesh dim (the shape layers expect) and, in backward, unsharded_grad
  // the full-size gradient the layers write; the unit's hook reduce-scatters it into grad. Undefined
  // otherwise.
  Tensor unsharded, unsharded_grad;
  // Mesh dims whose sum backward has already done (fully_shard's reduce-scatter over dp_shard): the
  // gradient sync leaves them out. grad_ready_at: the module whose post_backward completes this
  // gradient (null: the owner).
  std::vector<int> grad_reduced_dims;
  class Module* grad_ready_at = nullptr;
  int unshard_dim = -1;  // fully_shard's mesh dim: unsharded is whole on it

  // Global offset of the tensor layers compute with: this rank's part, or with fully_shard the part
  // gathered over unshard_dim (a vocab-sharded embedding needs its first row).
  Shape compute_offset() const;

  // The local tensor layers compute with.
  const Tensor& compute_local() const {
    if (unsharded.defined()) return unsharded;
    return compute.defined() ? compute : value.local;
  }
  // The gradient buffer layers accumulate into (same shape as compute_local()).
  const Tensor& grad_local() const { return unsharded_grad.defined() ? unsharded_grad : grad.local; }
  // Rounds value.local into compute (after value changed outside the optimizer: sharding, loading).
  void refresh_compute();
};

// A layout change on an activation and its reverse on the gradient.
struct LayoutHook {
  std::string what;  // for printing plans: "Shard(1) -> Replicate over tp"
  std::function<Tensor(const Tensor&)> forward;
  std::function<Tensor(const Tensor&)> backward;
};

class Module {
 public:
  Module(std::string name, std::string type) : name_(std::move(name)), type_(std::move(type)) {}
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  const std::string& name() const { return name_; }
  const std::string& type() const { return type_; }  // "Linear", "Embedding", "RMSNorm", ...

  // Input hooks, forward, output hooks.
  Tensor call(const Tensor& x);
  // Output hooks' backward (reverse order), backward, input hooks' backward.
  Tensor call_backward(const Tensor& dy);

  const std::vector<Module*>& children() const { return children_; }
  // This module and every descendant, depth first, parents before children.
  std::vector<Module*> modules();
  // This module's own parameters (not children's).
  const std::vector<Parameter*>& own_parameters() const { return own_params_; }
  // Every parameter of the subtree once (a tied parameter appears at its owner).
  std::vector<Parameter*> parameters();

  std::vector<LayoutHook> input_hooks;   // applied in order in forward
  std::vector<LayoutHook> output_hooks;  // applied in order in forward
  // Callbacks around forward and backward (fully_shard: gather before, free after; gradient sync).
  // A module's call() runs pre_forward, the input hooks, forward, the output hooks, post_forward;
  // call_backward() runs pre_backward, the output hooks' backward, backward, the input hooks'
  // backward, post_backward.
  std::vector<std::function<void(Module&)>> pre_forward;
  std::vector<std::function<void(Module&)>> post_forward;
  std::vector<std::function<void(Module&)>> pre_backward;
  std::vector<std::function<void(Module&)>> post_backward;

  // Activation recompute (apply_recompute): forward keeps only the module's input and releases what the
  // subtree saved for backward (drop_saved); backward first runs forward again on that input.
  bool recompute = false;
  // True on every module of a subtree while its forward runs again inside backward.
  bool recomputing() const { return recomputing_; }

 protected:
  virtual Tensor forward(const Tensor& x) = 0;
  virtual Tensor backward(const Tensor& dy) = 0;
  // What this module saved in forward for its backward, released (recompute). Layers that save override it.
  virtual void drop_saved() {}
  // The callbacks and output hooks of call() / call_backward() around a body: call() passes the input hooks
  // and forward(), a fused variant its fused op (RMSNorm::call_add, Linear::call_backward_into).
  template <class F> Tensor call_around(F&& body) {
    for (auto& f : pre_forward) f(*this);
    Tensor y = body();
    for (auto& hook : output_hooks) y = hook.forward(y);
    for (auto& f : post_forward) f(*this);
    return y;
  }
  template <class F> Tensor call_backward_around(const Tensor& dy, F&& body) {
    for (auto& f : pre_backward) f(*this);
    Tensor g = dy;
    for (auto it = output_hooks.rbegin(); it != output_hooks.rend(); ++it) g = it->backward(g);
    Tensor dx = body(g);
    for (auto& f : post_backward) f(*this);
    return dx;
  }
  // Registers a child; the child's name must extend this one's.
  template <class M> M* add_child(std::unique_ptr<M> m) {
    M* p = m.get();
    children_.push_back(p);
    owned_.push_back(std::move(m));
    return p;
  }
  Parameter* add_parameter(std::unique_ptr<Parameter> p);

 private:
  std::string name_, type_;
  bool recomputing_ = false;
  Tensor recompute_input_;  // the input forward ran on, kept for backward when recompute is set
  std::vector<Module*> children_;
  std::vector<std::unique_ptr<Module>> owned_;
  std::vector<Parameter*> own_params_;
  std::vector<std::unique_ptr<Parameter>> owned_params_;
};

// "model.layers.0" + "mlp" -> "model.layers.0.mlp"; "" + "model" -> "model".
std::string child_name(const std::string& parent, const std::string& child);

// How parameters are made: dtype, the mesh and a seed for the invariant init.
struct ParamFactory {
  DeviceMesh mesh;
  DType dtype = DType::f32;  // the compute dtype: bf16 makes f32 master weights with a bf16 copy
  Device device = Device::cpu();
  uint64_t seed = 0;
  double init_std = 0.02;
  // A parameter of global `shape`, Replicate on every mesh dim (styles reshard it),
  // initialised by the invariant factories keyed by its name; its gradient zeroed.
  std::unique_ptr<Parameter> make(const std::string& name, const Shape& shape, const std::string& init) const;
};

// Zeroes every gradient and marks it as produced by this rank alone (Replicate spec
// with the local layout of the parameter); the trainer marks the dp dims Partial.
void zero_grads(const std::vector<Parameter*>& params);

}  // namespace mt
