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

class Module;

// What a parallelism (or the precision policy) that rewrote a parameter tells the layers and the gradient
// sync about it. The state itself lives with that code (fully_shard.cpp's FsdpParam, style.cpp's sequence
// parallel gradient, module.cpp's compute copy); the parameter holds only handles to it. Every answer is
// neutral by default.
struct ParamState {
  virtual ~ParamState() = default;
  // The tensor layers compute with and the gradient buffer they write while this state substitutes them
  // (null: it does not, now).
  virtual const Tensor* compute() const { return nullptr; }
  virtual const Tensor* grad() const { return nullptr; }
  // The mesh dim over which compute() is whole when it substitutes (compute_offset() takes coordinate 0 there), or -1.
  virtual int whole_on_dim() const { return -1; }
  // Mesh dims over which backward leaves the gradient partial besides the data-parallel ones (a
  // sequence-parallel norm's weight: each tp rank saw part of the sequence).
  virtual void add_partial_dims(std::vector<int>& /*dims*/) const {}
  // Mesh dims whose sum backward has already done (fully_shard's reduce-scatter): the gradient sync leaves them out.
  virtual void add_reduced_dims(std::vector<int>& /*dims*/) const {}
  // The module whose post_backward completes the gradient (null: the owner).
  virtual Module* grad_ready_at() const { return nullptr; }
};

// The micro-batch whose forward or backward runs now (0 outside pipelines). What a layer keeps from a forward
// for its backward is kept per micro-batch (Saved), so that a pipeline stage may run the forwards of several
// micro-batches before their backwards (1F1B keeps up to p in flight; parallel/pipeline.h).
int saved_slot();
class SavedSlot {  // sets the slot for its scope
 public:
  explicit SavedSlot(int slot);
  ~SavedSlot();
  SavedSlot(const SavedSlot&) = delete;
  SavedSlot& operator=(const SavedSlot&) = delete;

 private:
  int previous_;
};
// One T per micro-batch slot, the current slot's read and written.
template <class T> class Saved {
 public:
  T& operator*() const { return at(); }
  T* operator->() const { return &at(); }
  operator const T&() const { return at(); }
  Saved& operator=(T v) {
    at() = std::move(v);
    return *this;
  }

 private:
  T& at() const {
    const size_t s = size_t(saved_slot());
    if (slots_.size() <= s) slots_.resize(s + 1);
    return slots_[s];
  }
  mutable std::vector<T> slots_;
};

// Zero-bubble schedules split backward in two: while a queue is set (DeferWeightGrads), the layers that can
// (Linear) compute the input gradient now and leave their weight gradient's GEMM in the queue, which the schedule
// runs later, in what would be its bubble.
using WeightGradQueue = std::vector<std::function<void()>>;
WeightGradQueue* weight_grad_queue();  // null: compute weight gradients in backward
class DeferWeightGrads {
 public:
  explicit DeferWeightGrads(WeightGradQueue* q);
  ~DeferWeightGrads();
  DeferWeightGrads(const DeferWeightGrads&) = delete;
  DeferWeightGrads& operator=(const DeferWeightGrads&) = delete;

 private:
  WeightGradQueue* previous_;
};

struct Parameter {
  std::string name;             // "model.layers.0.self_attn.q_proj.weight"
  DTensor value;                // the parameter as laid out on the mesh (the f32 master copy under mixed precision)
  DTensor grad;                 // same local shape; after backward its spec says how it is partial
  bool weight_decay = true;     // AdamW decays 2-D weights only
  // Frozen (PyTorch's requires_grad = False; LoRA's base): no gradient buffer (grad.local undefined), no optimizer
  // state, no gradient sync; layers compute their input gradient through it and skip its own. Set before
  // materialize (freeze()), so that no buffer is ever made.
  bool frozen = false;
  std::string init = "normal";  // normal | ones
  // The states of the code that rewrote it, in the order applied: a later one's compute() and grad() take
  // precedence (fully_shard's gathered weight over the bf16 copy it was gathered from).
  std::vector<std::shared_ptr<ParamState>> states;

  // The local tensor layers compute with: value.local unless a state substitutes it.
  const Tensor& compute_local() const;
  // The gradient buffer layers accumulate into (same shape as compute_local()); an error on a frozen parameter.
  const Tensor& grad_local() const;
  // grad_local(), or an undefined tensor for a frozen parameter (the ops skip an undefined dweight).
  Tensor grad_or_none() const { return frozen ? Tensor() : grad_local(); }
  // Global offset of what layers compute with inside its unit: this rank's part, or with a state whole on a mesh
  // dim (fully_shard's) the part at coordinate 0 there, gathered or not (a vocab-sharded embedding needs its
  // first row, the vocab-parallel loss lm_head's first row after the unit is freed).
  Shape compute_offset() const;
  // The states' answers, gathered (ParamState).
  std::vector<int> partial_dims() const;
  std::vector<int> reduced_dims() const;
  Module* grad_ready_at() const;
  // The state of type S, or null.
  template <class S> S* state() const {
    for (auto& s : states)
      if (auto* r = dynamic_cast<S*>(s.get())) return r;
    return nullptr;
  }
};

// The one way a parallelism re-lays a parameter out (tp styles' shard_param, fully_shard's shard_last): the
// value redistributed to `placements` (Replicate -> Shard keeps this rank's part: no communication), the
// gradient zeroed in the new layout, the compute copy rounded again.
void relayout_param(Parameter& p, const Placements& placements, const ShardOrder& order = {});

// Mixed precision: the parameter's copy in the compute dtype (bf16) beside its f32 master value, made by
// ParamFactory, rewritten by the optimizer step. Undefined when the model computes in value's dtype.
Tensor compute_copy(const Parameter& p);
// Rounds value.local into the compute copy (after value changed outside the optimizer: sharding, loading).
void refresh_compute_copy(Parameter& p);

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
  // The parameters this module computes with, in order: a tied weight it borrows from another module (lm_head's
  // embedding) first, then its own. The styles shard these (a tied weight met twice must get one layout).
  std::vector<Parameter*> used_parameters() const;
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
  // Releases what the subtree saved for backward in the current micro-batch slot (a forward that will have no
  // backward: evaluation under pipeline parallel, which runs several micro-batches' forwards).
  void release_saved() {
    for (Module* m : modules()) m->drop_saved();
  }

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
  // Another module's parameter this one computes with (tied weights); it stays that module's.
  void borrow_parameter(Parameter* p) { borrowed_params_.push_back(p); }
  // Destroys the children for which drop(child) is true, with their subtrees (pipeline parallel keeps a stage's).
  void remove_children(const std::function<bool(const Module*)>& drop);

 private:
  std::string name_, type_;
  bool recomputing_ = false;
  Saved<Tensor> recompute_input_;  // the input forward ran on, kept for backward when recompute is set
  std::vector<Module*> children_;
  std::vector<std::unique_ptr<Module>> owned_;
  std::vector<Parameter*> own_params_;
  std::vector<Parameter*> borrowed_params_;
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
  // Sharded creation: parameters are described (name, global shape, layout) but hold no storage until
  // materialize(), after the parallel plan has laid them out: each rank then allocates and draws only its own
  // elements, the same bits as a whole parameter made and then sharded (the factories are keyed by
  // (seed, name, global index)). No rank ever holds a whole parameter that its layout does not replicate.
  bool deferred = false;
  // With deferred: materialize() allocates zeros and leaves the draw for draw_init(), so that a run about to load
  // every parameter from a checkpoint does not draw values it overwrites (the trainer on resume: 0.3-0.9 s).
  bool draw_later = false;
  // A parameter of global `shape`, Replicate on every mesh dim (styles reshard it),
  // initialised by the invariant factories keyed by its name; its gradient zeroed (deferred: both later).
  std::unique_ptr<Parameter> make(const std::string& name, const Shape& shape, const std::string& init) const;
};

// Whether p is described but not yet allocated (ParamFactory::deferred).
bool is_deferred(const Parameter& p);
// The dtype layers compute p in (known before materialize).
DType compute_dtype(const Parameter& p);
// Allocates p in its current layout and draws its local elements, zeroes its gradient, makes its compute copy.
// Nothing when p is not deferred. With ParamFactory::draw_later: zeros, the draw kept for draw_init.
void materialize(Parameter& p);
// The draw materialize() left (ParamFactory::draw_later), into p's storage in place, the same bits as drawn then;
// its compute copy refreshed. Returns false when none was left.
bool draw_init(Parameter& p);
// Forgets the draw materialize() left: every element of p was loaded.
void forget_init(Parameter& p);

// Freezes p (Parameter::frozen) and releases its gradient buffer.
void freeze(Parameter& p);
// The parameters that train (not frozen), in order.
std::vector<Parameter*> trainable(const std::vector<Parameter*>& params);

// Zeroes every gradient (frozen parameters have none) and marks it as produced by this rank alone (Replicate spec
// with the local layout of the parameter); the trainer marks the dp dims Partial.
void zero_grads(const std::vector<Parameter*>& params);

}  // namespace mt
