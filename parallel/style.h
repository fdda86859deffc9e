// Parallel styles (PyTorch's torch.distributed.tensor.parallel semantics) as
// plain value types, and the free functions that apply them: parallelize() by
// name patterns, shard_param(), prepare_input() / prepare_output() /
// prepare_input_output().
//
// Activations between modules are local Tensors; a style installs layout
// hooks on its module (Module::call runs them around forward, call_backward
// runs their backward in reverse) that redistribute the activation over one
// mesh dim (tp) in forward and its gradient in backward. On the other mesh
// dims an activation is Shard(0) over the data-parallel dims (batch rows) and
// Replicate elsewhere.
//
// A style is one type: its keyword fields, and beside them its name, its text
// form, the modules it fits (check), how it lays a module out (apply) and how
// a plan file's arguments make one (from_args). ParallelStyle lists the types;
// everything else (parallelize, style_name, style_str, the YAML plan reader in
// parallel/plan_yaml.h) dispatches over that list. Adding a style is adding a
// type with these members and naming it in ParallelStyle.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "parallel/module.h"

namespace mt {

// The tag the styles' layout changes are counted under (comm_counters.h).
inline constexpr const char* kLayoutTag = "layout";

// What applying a style needs besides its module.
struct StyleContext {
  const DeviceMesh& mesh;
  int dim;                // the mesh dim laid out (tp)
  bool input_is_dtensor;  // an enclosing PrepareModuleInput keeps this module's input distributed
};

// A style's keyword arguments as a plan file writes them (PyTorch's names), placements parsed;
// `at` names the entry ("parallel.tp_plan[3]") in errors.
struct StyleArgs {
  std::string at;
  std::optional<Placement> input_layouts, output_layouts, desired_input_layouts, desired_output_layouts;
  std::optional<bool> use_local_output;
  // Errors naming the key unless every argument given is one of `takes`.
  void only(const char* style, const std::vector<std::string>& takes) const;
};

// Shards a Linear's output features (weight Shard(0)) or an Embedding's columns (Shard(1)).
struct ColwiseParallel {
  static constexpr const char* name = "ColwiseParallel";
  std::optional<Placement> input_layouts;                         // default Replicate
  std::optional<Placement> output_layouts;                        // default Shard(-1)
  std::string str() const;                                        // "ColwiseParallel(input R, output S(-1))"
  void check(const Module& m, const std::string& pattern) const;  // a Linear or an Embedding
  void apply(Module& m, const StyleContext& c) const;
  static ColwiseParallel from_args(const StyleArgs& a);
};
// Shards a Linear's input features (weight Shard(1)) or an Embedding's rows (the vocabulary, Shard(0)).
struct RowwiseParallel {
  static constexpr const char* name = "RowwiseParallel";
  std::optional<Placement> input_layouts;   // default Shard(-1)
  std::optional<Placement> output_layouts;  // default Replicate
  std::string str() const;
  void check(const Module& m, const std::string& pattern) const;  // a Linear or an Embedding
  void apply(Module& m, const StyleContext& c) const;
  static RowwiseParallel from_args(const StyleArgs& a);
};
// A norm over tokens split along the sequence (dim 1, the layout its neighbours' hooks give it): the
// weight stays replicated and its gradient is a partial sum over the mesh dim.
struct SequenceParallel {
  static constexpr const char* name = "SequenceParallel";
  std::string str() const;
  void check(const Module& m, const std::string& pattern) const;  // an RMSNorm
  void apply(Module& m, const StyleContext& c) const;
  static SequenceParallel from_args(const StyleArgs& a);
};
// Modules here take one input and give one output: the layout lists hold one entry
// (std::nullopt: leave that input as it is).
// use_local_output false: the module's children receive the input as a distributed tensor, so their
// partial input gradients are summed before one reduction (instead of each being reduced at once).
struct PrepareModuleInput {
  static constexpr const char* name = "PrepareModuleInput";
  std::vector<std::optional<Placement>> input_layouts, desired_input_layouts;
  bool use_local_output = false;
  std::string str() const;
  void check(const Module&, const std::string&) const {}  // any module
  void apply(Module& m, const StyleContext& c) const;
  static PrepareModuleInput from_args(const StyleArgs& a);
};
struct PrepareModuleOutput {
  static constexpr const char* name = "PrepareModuleOutput";
  std::vector<std::optional<Placement>> output_layouts, desired_output_layouts;
  std::string str() const;
  void check(const Module&, const std::string&) const {}  // any module
  void apply(Module& m, const StyleContext& c) const;
  static PrepareModuleOutput from_args(const StyleArgs& a);
};
// use_local_input: as PrepareModuleInput's use_local_output.
struct PrepareModuleInputOutput {
  static constexpr const char* name = "PrepareModuleInputOutput";
  std::vector<std::optional<Placement>> input_layouts, desired_input_layouts;
  bool use_local_input = false;
  std::vector<std::optional<Placement>> output_layouts, desired_output_layouts;
  std::string str() const;
  void check(const Module&, const std::string&) const {}  // any module
  void apply(Module& m, const StyleContext& c) const;
  static PrepareModuleInputOutput from_args(const StyleArgs& a);
};
using ParallelStyle = std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput,
                                   PrepareModuleOutput, PrepareModuleInputOutput>;
inline std::string style_name(const ParallelStyle& s) {  // "ColwiseParallel"
  return std::visit([](const auto& x) { return std::string(x.name); }, s);
}
inline std::string style_str(const ParallelStyle& s) {  // "ColwiseParallel(input R, output S(-1))"
  return std::visit([](const auto& x) { return x.str(); }, s);
}

struct PlanEntry {
  std::string pattern;  // module path; '*' one segment (or part of one), '**' any number of segments
  ParallelStyle style;
};
using ParallelPlan = std::vector<PlanEntry>;

bool pattern_matches(const std::string& pattern, const std::string& name);
// Whether a pattern (or one segment of it) has fnmatch's glob characters (*, ?, [, \\); without them it names
// exactly one module and compares as a string.
bool has_glob(std::string_view pattern);

// Applies the plan over the mesh dim `mesh_dim`. Every pattern must match a
// module, no module may match two patterns, and each style must fit its
// module's type; errors name the pattern, the module path and its type.
// Parameters are sharded by keeping this rank's part of their current (full,
// replicated) value, so a model initialised by the invariant factories or
// loaded whole is sharded without communication.
void parallelize(Module& root, const DeviceMesh& mesh, const std::string& mesh_dim, const ParallelPlan& plan);

// Lays one parameter out with `placement` on mesh dim `mesh_dim` (other dims unchanged),
// keeping this rank's part of the current value; its gradient buffer follows.
void shard_param(Parameter& p, int mesh_dim, const Placement& placement);
// A replicated parameter whose gradient each rank computes from its part only (a sequence-parallel norm's weight, a
// LoRA factor beside a split one, latent attention's projections before the heads are split): the gradient is a
// partial sum over mesh_dim, summed there by the gradient sync.
void grad_partial_on(Parameter& p, int mesh_dim);

// Layout hooks on any module, as PrepareModuleInput/Output do: forward
// redistributes from `layout` to `desired`; backward brings the gradient back.
// grad_layout is the gradient's placement as the module produces it (default:
// Partial when desired is Replicate, since a module fed a replicated input
// through column-parallel layers gives a partial input gradient; else desired).
void prepare_input(Module& m, const DeviceMesh& mesh, int mesh_dim, const Placement& layout, const Placement& desired,
                   std::optional<Placement> grad_layout = std::nullopt);
void prepare_output(Module& m, const DeviceMesh& mesh, int mesh_dim, const Placement& layout, const Placement& desired);
void prepare_input_output(Module& m, const DeviceMesh& mesh, int mesh_dim, const Placement& in_layout,
                          const Placement& in_desired, const Placement& out_layout, const Placement& out_desired);

// The placements an activation has on every mesh dim when it has `p` on mesh_dim.
Placements activation_placements(const DeviceMesh& mesh, int mesh_dim, const Placement& p);

// A hook moving an activation from `from` to `to` on mesh_dim; its backward moves
// the gradient (arriving as `grad_from`) back by redistribute's gradient rule
// (redistribute_grad_placement: to `from`, Partial replaced by Replicate).
// global_size: the global size of the sharded tensor dim when it cannot be
// inferred from the local size (uneven shards), -1 otherwise.
LayoutHook layout_hook(const DeviceMesh& mesh, int mesh_dim, const Placement& from, const Placement& to,
                       const Placement& grad_from, int64_t global_size = -1);

}  // namespace mt
