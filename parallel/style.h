// Parallel styles (PyTorch's torch.distributed.tensor.parallel semantics, see
// seeds/notes_parallel_styles_dtensor.txt) as plain value types, and the free
// functions that apply them: parallelize() by name patterns, shard_param(),
// prepare_input() / prepare_output() / prepare_input_output().
//
// Activations between modules are local Tensors; a style installs layout
// hooks on its module (Module::call runs them around forward, call_backward
// runs their backward in reverse) that redistribute the activation over one
// mesh dim (tp) in forward and its gradient in backward. On the other mesh
// dims an activation is Shard(0) over the data-parallel dims (batch rows) and
// Replicate elsewhere. use_local_output is kept for PyTorch parity: modules
// always exchange local tensors here, whose layouts the hooks know.
#pragma once
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "parallel/module.h"

namespace mt {

struct ColwiseParallel {
  std::optional<Placement> input_layouts;   // default Replicate
  std::optional<Placement> output_layouts;  // default Shard(-1)
  bool use_local_output = true;
};
struct RowwiseParallel {
  std::optional<Placement> input_layouts;   // default Shard(-1)
  std::optional<Placement> output_layouts;  // default Replicate
  bool use_local_output = true;
};
struct SequenceParallel {
  int sequence_dim = 1;
  bool use_local_output = false;
};
// Modules here take one input and give one output: the layout lists hold one entry
// (std::nullopt: leave that input as it is).
struct PrepareModuleInput {
  std::vector<std::optional<Placement>> input_layouts, desired_input_layouts;
  bool use_local_output = false;
};
struct PrepareModuleOutput {
  std::vector<std::optional<Placement>> output_layouts, desired_output_layouts;
  bool use_local_output = true;
};
struct PrepareModuleInputOutput {
  std::vector<std::optional<Placement>> input_layouts, desired_input_layouts;
  bool use_local_input = false;
  std::vector<std::optional<Placement>> output_layouts, desired_output_layouts;
  bool use_local_output = true;
};
using ParallelStyle = std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput,
                                   PrepareModuleOutput, PrepareModuleInputOutput>;
std::string style_name(const ParallelStyle& s);  // "ColwiseParallel"
std::string style_str(const ParallelStyle& s);   // "ColwiseParallel(input R, output S(-1))"

struct PlanEntry {
  std::string pattern;  // module path; '*' one segment (or part of one), '**' any number of segments
  ParallelStyle style;
};
using ParallelPlan = std::vector<PlanEntry>;

bool pattern_matches(const std::string& pattern, const std::string& name);

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
// the gradient (arriving as `grad_from`) back by redistribute's gradient rule.
// global_size: the global size of the sharded tensor dim when it cannot be
// inferred from the local size (uneven shards), -1 otherwise. local_input: the
// activation arrives as a plain local tensor (PyTorch's from_local), so a partial
// gradient is made whole before it leaves (an all-reduce) instead of staying partial.
LayoutHook layout_hook(const DeviceMesh& mesh, int mesh_dim, const Placement& from, const Placement& to,
                       const Placement& grad_from, int64_t global_size = -1, bool local_input = false);

}  // namespace mt
