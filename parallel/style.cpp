#include "parallel/style.h"

#include "comm/comm_counters.h"
#include "parallel/parallel_dims.h"

#include <fnmatch.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string_view>
#include <utility>
#include <sstream>

namespace mt {

namespace {

Placement normalized(const Placement& p, int64_t ndim) {
  if (p.is_shard() && p.dim < 0) return Placement::Shard(int(p.dim + ndim));
  return p;
}

// "a.b.c" -> {"a", "b", "c"} (an empty name -> {}; a trailing dot adds nothing). Views into s.
std::vector<std::string_view> split_path(std::string_view s) {
  std::vector<std::string_view> out;
  out.reserve(8);
  size_t start = 0;
  while (start < s.size()) {
    const size_t dot = s.find('.', start);
    const size_t end = dot == std::string_view::npos ? s.size() : dot;
    out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace

bool has_glob(std::string_view pattern) { return pattern.find_first_of("*?[\\") != std::string_view::npos; }

namespace {

// One segment against one pattern segment: fnmatch's glob (*, ?, [...]); a segment without them compares as is.
bool segment_matches(std::string_view pat, std::string_view name) {
  if (!has_glob(pat)) return pat == name;
  if (pat == "*") return true;
  return fnmatch(std::string(pat).c_str(), std::string(name).c_str(), 0) == 0;
}

bool match_from(const std::vector<std::string_view>& pat, size_t i, const std::vector<std::string_view>& name,
                size_t j) {
  if (i == pat.size()) return j == name.size();
  if (pat[i] == "**") {
    for (size_t k = j; k <= name.size(); ++k)
      if (match_from(pat, i + 1, name, k)) return true;
    return false;
  }
  if (j == name.size()) return false;
  if (!segment_matches(pat[i], name[j])) return false;
  return match_from(pat, i + 1, name, j + 1);
}

std::string opt_str(const std::vector<std::optional<Placement>>& v) {
  std::string s;
  for (auto& p : v) s += (s.empty() ? "" : ",") + (p ? p->str() : std::string("-"));
  return s;
}

// A Linear's weight and its bias (null without one): the bias is the parameter named "<module>.bias".
bool is_lora_factor(const Parameter& p) {
  auto ends = [&](const std::string& x) {
    return p.name.size() >= x.size() && p.name.compare(p.name.size() - x.size(), x.size(), x) == 0;
  };
  return ends(".lora_A.weight") || ends(".lora_B.weight");
}

// The weight and bias of a Linear or Embedding (LoRA's factors beside them are laid out apart: lora_factors).
std::pair<Parameter*, Parameter*> weight_and_bias(Module& m, const std::string& style) {
  std::vector<Parameter*> ps = m.used_parameters();
  std::erase_if(ps, [](Parameter* p) { return is_lora_factor(*p); });
  Parameter* bias = nullptr;
  if (ps.size() == 2 && ps[1]->name == child_name(m.name(), "bias")) bias = ps[1];
  MT_CHECK(ps.size() == 1 || bias, "parallel", "{} on {} ({}): expected a weight and at most a bias, the module has {}",
           style, m.name(), m.type(), ps.size());
  return {ps[0], bias};
}

Placement single(const std::vector<std::optional<Placement>>& v, const Module& m, const char* what, const char* style,
                 const Placement& fallback) {
  MT_CHECK(v.size() <= 1, "parallel", "{} on {}: {} lists {} layouts but the module takes one tensor", style, m.name(),
           what, v.size());
  return v.empty() || !v[0] ? fallback : *v[0];
}

// A Prepare style's move on one side: from `layouts` (Replicate when unset) to `desired` (when unset, no move);
// keys name each list in errors. The three Prepare styles read each side alike.
std::pair<Placement, Placement> from_to(const std::vector<std::optional<Placement>>& layouts, const char* key,
                                        const std::vector<std::optional<Placement>>& desired, const char* desired_key,
                                        const Module& m, const char* style) {
  Placement from = single(layouts, m, key, style, Placement::Replicate());
  return {from, single(desired, m, desired_key, style, from)};
}

// "layouts -> desired", as str() shows a side of a Prepare style.
std::string from_to_str(const std::vector<std::optional<Placement>>& layouts,
                        const std::vector<std::optional<Placement>>& desired) {
  return opt_str(layouts) + " -> " + opt_str(desired);
}

void add_hook(std::vector<LayoutHook>& hooks, const DeviceMesh& mesh, int dim, Placement from, Placement to,
              Placement grad_from, int64_t global_size) {
  // Nothing to do in either direction: skip the hook.
  if (from == to && redistribute_grad_placement(from) == grad_from) return;
  hooks.push_back(layout_hook(mesh, dim, from, to, grad_from, global_size));
}

}  // namespace

void StyleArgs::only(const char* style, const std::vector<std::string>& takes) const {
  auto given = [&](const char* key, bool has) {
    if (!has || std::find(takes.begin(), takes.end(), key) != takes.end()) return;
    std::string list;
    for (auto& t : takes) list += (list.empty() ? "" : ", ") + t;
    fail("config", "{}.{}: {} takes {}", at, key, style, list.empty() ? std::string("no arguments") : list);
  };
  given("input_layouts", input_layouts.has_value());
  given("output_layouts", output_layouts.has_value());
  given("desired_input_layouts", desired_input_layouts.has_value());
  given("desired_output_layouts", desired_output_layouts.has_value());
  given("use_local_output", use_local_output.has_value());
}

// ---- ColwiseParallel

namespace {
// The state of a replicated parameter whose gradient each rank computes from its part only (ParamState): a
// sequence-parallel norm's weight (each rank normalises its own tokens), a LoRA factor beside a split one (each
// rank's gradient comes through its part of the other). The gradient is a partial sum over these mesh dims.
struct PartialGrad : ParamState {
  std::vector<int> dims;
  void add_partial_dims(std::vector<int>& out) const override { out.insert(out.end(), dims.begin(), dims.end()); }
};
}  // namespace

void grad_partial_on(Parameter& p, int mesh_dim) {
  auto* sp = p.state<PartialGrad>();
  if (!sp) {
    auto made = std::make_shared<PartialGrad>();
    sp = made.get();
    p.states.push_back(made);
  }
  if (std::find(sp->dims.begin(), sp->dims.end(), mesh_dim) == sp->dims.end()) sp->dims.push_back(mesh_dim);
}

namespace {
// A Linear's LoRA factors (models/lora.h), found by name: null when it has none.
std::pair<Parameter*, Parameter*> lora_factors(Module& m) {
  Parameter *a = nullptr, *b = nullptr;
  auto ends = [](const std::string& n, const std::string& s) {
    return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0;
  };
  for (Parameter* p : m.own_parameters()) {
    if (ends(p->name, ".lora_A.weight")) a = p;
    if (ends(p->name, ".lora_B.weight")) b = p;
  }
  return {a, b};
}

// Colwise and Rowwise shard a Linear's or an Embedding's weight; any other module is a plan mistake.
void check_linear_or_embedding(const char* style, const Module& m, const std::string& pattern) {
  MT_CHECK(m.type() == "Linear" || m.type() == "Embedding", "parallel",
           "{} cannot handle {} ({}): it applies to Linear and Embedding modules (plan entry '{}')", style, m.name(),
           m.type(), pattern);
}
}  // namespace

std::string ColwiseParallel::str() const {
  return fmt::format("ColwiseParallel(input {}, output {})", input_layouts.value_or(Placement::Replicate()).str(),
                     output_layouts.value_or(Placement::Shard(-1)).str());
}

void ColwiseParallel::check(const Module& m, const std::string& pattern) const {
  check_linear_or_embedding(name, m, pattern);
}

// A plain local input (PyTorch: from_local) gets its partial gradient made whole at once (an all-reduce,
// Megatron's "f"). An input an enclosing PrepareModuleInput keeps distributed and already Replicate is not
// redistributed at all: its partial gradient is summed with its siblings' before that module's one reduction.
void ColwiseParallel::apply(Module& m, const StyleContext& c) const {
  Placement in = input_layouts.value_or(Placement::Replicate());
  Placement out = output_layouts.value_or(Placement::Shard(-1));
  auto [wp, bias] = weight_and_bias(m, name);
  Parameter& w = *wp;
  if (m.type() == "Linear") {
    shard_param(w, c.dim, Placement::Shard(0));
    // The bias follows the output features: each rank adds its slice, and the slice's gradient (the column sums of
    // its dy over every row the rank holds) is whole on this dim.
    if (bias) shard_param(*bias, c.dim, Placement::Shard(0));
    // LoRA: B follows the output features; A stays whole, its gradient (scale dy_local B_local)^T x partial.
    if (auto [a, b] = lora_factors(m); a && b) {
      shard_param(*b, c.dim, Placement::Shard(0));
      grad_partial_on(*a, c.dim);
    }
    // x (R) @ W (S(0))^T gives S(-1); the input gradient dy W comes out Partial.
    if (!(c.input_is_dtensor && in.is_replicate()))
      add_hook(m.input_hooks, c.mesh, c.dim, in, Placement::Replicate(), Placement::Partial(), -1);
    add_hook(m.output_hooks, c.mesh, c.dim, Placement::Shard(-1), out, out, w.value.shape()[0]);
  } else {  // Embedding
    MT_CHECK(in.is_replicate(), "parallel", "ColwiseParallel on {} (Embedding): token inputs must be Replicate, got {}",
             m.name(), in.str());
    shard_param(w, c.dim, Placement::Shard(1));
    add_hook(m.output_hooks, c.mesh, c.dim, Placement::Shard(-1), out, out, w.value.shape()[1]);
  }
}

ColwiseParallel ColwiseParallel::from_args(const StyleArgs& a) {
  a.only(name, {"input_layouts", "output_layouts"});
  return {a.input_layouts, a.output_layouts};
}

// ---- RowwiseParallel

std::string RowwiseParallel::str() const {
  return fmt::format("RowwiseParallel(input {}, output {})", input_layouts.value_or(Placement::Shard(-1)).str(),
                     output_layouts.value_or(Placement::Replicate()).str());
}

void RowwiseParallel::check(const Module& m, const std::string& pattern) const {
  check_linear_or_embedding(name, m, pattern);
}

void RowwiseParallel::apply(Module& m, const StyleContext& c) const {
  Placement out = output_layouts.value_or(Placement::Replicate());
  auto [wp, bias] = weight_and_bias(m, name);
  Parameter& w = *wp;
  // Each rank's product is a partial sum: a bias added to it would be summed tp times.
  MT_CHECK(!bias, "parallel",
           "RowwiseParallel on {}: the linear has a bias ({}), which a row-wise split would add once per rank; "
           "shard it column-wise or leave it unsharded",
           m.name(), bias ? bias->name : "");
  if (m.type() == "Linear") {
    Placement in = input_layouts.value_or(Placement::Shard(-1));
    shard_param(w, c.dim, Placement::Shard(1));
    // LoRA: A follows the input features, so x A^T is partial and (x A^T) B^T joins the base's partial sum; B stays
    // whole, its gradient dy^T (x_local A_local^T) partial.
    if (auto [a, b] = lora_factors(m); a && b) {
      shard_param(*a, c.dim, Placement::Shard(1));
      grad_partial_on(*b, c.dim);
    }
    // x (S(-1)) @ W (S(1))^T is Partial; the input gradient dy W comes out S(-1).
    add_hook(m.input_hooks, c.mesh, c.dim, in, Placement::Shard(-1), Placement::Shard(-1), w.value.shape()[1]);
    add_hook(m.output_hooks, c.mesh, c.dim, Placement::Partial(), out, out, -1);
  } else {  // Embedding
    Placement in = input_layouts.value_or(Placement::Replicate());
    MT_CHECK(in.is_replicate(), "parallel", "RowwiseParallel on {} (Embedding): token inputs must be Replicate, got {}",
             m.name(), in.str());
    // Vocab-sharded table: rows outside a rank's shard give zeros, a Partial sum.
    shard_param(w, c.dim, Placement::Shard(0));
    add_hook(m.output_hooks, c.mesh, c.dim, Placement::Partial(), out, out, -1);
  }
}

RowwiseParallel RowwiseParallel::from_args(const StyleArgs& a) {
  a.only(name, {"input_layouts", "output_layouts"});
  return {a.input_layouts, a.output_layouts};
}

// ---- SequenceParallel

std::string SequenceParallel::str() const { return "SequenceParallel"; }

void SequenceParallel::check(const Module& m, const std::string& pattern) const {
  MT_CHECK(m.type() == "RMSNorm", "parallel",
           "SequenceParallel cannot handle {} ({}): it applies to norm layers (RMSNorm), whose weights stay "
           "replicated (plan entry '{}')",
           m.name(), m.type(), pattern);
}

void SequenceParallel::apply(Module& m, const StyleContext& c) const {
  // Input and output stay Shard(1); the weight's gradient is partial over the mesh dim.
  for (Parameter* p : m.own_parameters()) grad_partial_on(*p, c.dim);
}

SequenceParallel SequenceParallel::from_args(const StyleArgs& a) {
  a.only(name, {});
  return {};
}

// ---- PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput

std::string PrepareModuleInput::str() const {
  return "PrepareModuleInput(" + from_to_str(input_layouts, desired_input_layouts) + ")";
}

void PrepareModuleInput::apply(Module& m, const StyleContext& c) const {
  auto [in, want] = from_to(input_layouts, "input_layouts", desired_input_layouts, "desired_input_layouts", m, name);
  prepare_input(m, c.mesh, c.dim, in, want);
}

PrepareModuleInput PrepareModuleInput::from_args(const StyleArgs& a) {
  a.only(name, {"input_layouts", "desired_input_layouts", "use_local_output"});
  return {{a.input_layouts}, {a.desired_input_layouts}, a.use_local_output.value_or(false)};
}

std::string PrepareModuleOutput::str() const {
  return "PrepareModuleOutput(" + from_to_str(output_layouts, desired_output_layouts) + ")";
}

void PrepareModuleOutput::apply(Module& m, const StyleContext& c) const {
  auto [out, want] =
      from_to(output_layouts, "output_layouts", desired_output_layouts, "desired_output_layouts", m, name);
  prepare_output(m, c.mesh, c.dim, out, want);
}

PrepareModuleOutput PrepareModuleOutput::from_args(const StyleArgs& a) {
  a.only(name, {"output_layouts", "desired_output_layouts"});
  return {{a.output_layouts}, {a.desired_output_layouts}};
}

std::string PrepareModuleInputOutput::str() const {
  return "PrepareModuleInputOutput(input " + from_to_str(input_layouts, desired_input_layouts) + ", output " +
         from_to_str(output_layouts, desired_output_layouts) + ")";
}

void PrepareModuleInputOutput::apply(Module& m, const StyleContext& c) const {
  auto [in, in_want] =
      from_to(input_layouts, "input_layouts", desired_input_layouts, "desired_input_layouts", m, name);
  auto [out, out_want] =
      from_to(output_layouts, "output_layouts", desired_output_layouts, "desired_output_layouts", m, name);
  prepare_input_output(m, c.mesh, c.dim, in, in_want, out, out_want);
}

PrepareModuleInputOutput PrepareModuleInputOutput::from_args(const StyleArgs& a) {
  a.only(name, {"input_layouts", "desired_input_layouts", "output_layouts", "desired_output_layouts"});
  return {{a.input_layouts}, {a.desired_input_layouts}, false, {a.output_layouts}, {a.desired_output_layouts}};
}

bool pattern_matches(const std::string& pattern, const std::string& name) {
  return match_from(split_path(pattern), 0, split_path(name), 0);
}

Placements activation_placements(const DeviceMesh& mesh, int mesh_dim, const Placement& p) {
  Placements out;
  for (int d = 0; d < mesh.ndim(); ++d) {
    if (d == mesh_dim) out.push_back(p);
    else out.push_back(ParallelDims::activation_placement(mesh.dims()[size_t(d)].name));
  }
  return out;
}

LayoutHook layout_hook(const DeviceMesh& mesh, int mesh_dim, const Placement& from, const Placement& to,
                       const Placement& grad_from, int64_t global_size) {
  // The global shape of the last forward's activation, for its gradient in backward.
  auto global = std::make_shared<Shape>();
  auto make_global = [mesh, mesh_dim, global_size](const Tensor& local, const Placements& pl) {
    Shape g = local.shape();
    for (int d = 0; d < mesh.ndim(); ++d) {
      const Placement& p = pl[size_t(d)];
      if (!p.is_shard()) continue;
      if (d == mesh_dim && global_size >= 0) g[size_t(p.dim)] = global_size;
      else g[size_t(p.dim)] *= mesh.size(d);
    }
    return g;
  };
  LayoutHook h;
  h.what = fmt::format("{} -> {} on {}; gradient {} -> {}", from.str(), to.str(), mesh.dims()[size_t(mesh_dim)].name,
                       grad_from.str(), redistribute_grad_placement(from).str());
  h.forward = [=](const Tensor& x) {
    Placement f = normalized(from, x.dim()), t = normalized(to, x.dim());
    Placements fp = activation_placements(mesh, mesh_dim, f);
    *global = make_global(x, fp);
    if (f == t) return x;
    DTensor dt = from_local(x, mesh, fp, *global);
    CommTag tag(kLayoutTag);
    return redistribute(dt, activation_placements(mesh, mesh_dim, t)).local;
  };
  h.backward = [=](const Tensor& g) {
    int64_t nd = int64_t(global->size());
    Placement gf = normalized(grad_from, nd), tgt = redistribute_grad_placement(normalized(from, nd));
    if (gf == tgt) return g;
    DTensor dt = from_local(g, mesh, activation_placements(mesh, mesh_dim, gf), *global);
    CommTag tag(kLayoutTag);
    return redistribute(dt, activation_placements(mesh, mesh_dim, tgt)).local;
  };
  return h;
}

void shard_param(Parameter& p, int mesh_dim, const Placement& placement) {
  Placements pl = p.value.placements();
  Placement target = normalized(placement, int64_t(p.value.shape().size()));
  if (pl[size_t(mesh_dim)] == target) return;  // already (a tied weight met twice)
  MT_CHECK(pl[size_t(mesh_dim)].is_replicate(), "parallel", "shard_param {}: already laid out as {} on mesh dim {}",
           p.name, pl[size_t(mesh_dim)].str(), mesh_dim);
  pl[size_t(mesh_dim)] = target;
  relayout_param(p, pl);
}

void prepare_input(Module& m, const DeviceMesh& mesh, int mesh_dim, const Placement& layout, const Placement& desired,
                   std::optional<Placement> grad_layout) {
  Placement gl = grad_layout.value_or(desired.is_replicate() ? Placement::Partial() : desired);
  add_hook(m.input_hooks, mesh, mesh_dim, layout, desired, gl, -1);
}

void prepare_output(Module& m, const DeviceMesh& mesh, int mesh_dim, const Placement& layout,
                    const Placement& desired) {
  add_hook(m.output_hooks, mesh, mesh_dim, layout, desired, desired, -1);
}

void prepare_input_output(Module& m, const DeviceMesh& mesh, int mesh_dim, const Placement& in_layout,
                          const Placement& in_desired, const Placement& out_layout, const Placement& out_desired) {
  prepare_input(m, mesh, mesh_dim, in_layout, in_desired);
  prepare_output(m, mesh, mesh_dim, out_layout, out_desired);
}

void parallelize(Module& root, const DeviceMesh& mesh, const std::string& mesh_dim_name, const ParallelPlan& plan) {
  int dim = mesh.dim_index(mesh_dim_name);
  auto modules = root.modules();
  // Every name and pattern split once (a 405B model has ~2,000 modules and the plan a dozen patterns).
  std::vector<std::vector<std::string_view>> names;
  names.reserve(modules.size());
  for (Module* m : modules) names.push_back(split_path(m->name()));
  // Match every pattern first: errors before anything changes.
  std::map<Module*, const PlanEntry*> chosen;
  for (const PlanEntry& e : plan) {
    int matched = 0;
    const std::vector<std::string_view> pattern = split_path(e.pattern);
    for (size_t i = 0; i < modules.size(); ++i) {
      Module* m = modules[i];
      if (m->name().empty() || !match_from(pattern, 0, names[i], 0)) continue;
      ++matched;
      auto [it, fresh] = chosen.emplace(m, &e);
      MT_CHECK(fresh, "parallel", "{} is matched by two plan entries: '{}' ({}) and '{}' ({})", m->name(),
               it->second->pattern, style_name(it->second->style), e.pattern, style_name(e.style));
    }
    MT_CHECK(matched > 0, "parallel", "plan pattern '{}' ({}) matches no module of the model", e.pattern,
             style_name(e.style));
  }
  // Every style must fit its module's type: checked for all before any is applied.
  for (auto& [m, e] : chosen) std::visit([&](const auto& st) { st.check(*m, e->pattern); }, e->style);
  // Whether an enclosing module's PrepareModuleInput hands this module a distributed tensor: the names of the
  // modules whose style does, and each module's enclosing names looked up (its name cut at each dot).
  std::set<std::string> hands_dtensor;
  for (auto& [anc, e] : chosen) {
    const auto* pi = std::get_if<PrepareModuleInput>(&e->style);
    const auto* pio = std::get_if<PrepareModuleInputOutput>(&e->style);
    if ((pi && !pi->use_local_output) || (pio && !pio->use_local_input)) hands_dtensor.insert(anc->name());
  }
  auto input_is_dtensor = [&](const Module& m) {
    const std::string& n = m.name();
    for (size_t dot = n.find('.'); dot != std::string::npos; dot = n.find('.', dot + 1))
      if (hands_dtensor.count(n.substr(0, dot))) return true;
    return false;
  };
  for (Module* m : modules) {
    auto it = chosen.find(m);
    if (it == chosen.end()) continue;
    StyleContext c{mesh, dim, input_is_dtensor(*m)};
    std::visit([&](const auto& st) { st.apply(*m, c); }, it->second->style);
  }
}

}  // namespace mt
