#include "parallel/plan_yaml.h"

#include <utility>

namespace mt {

namespace {

// The style whose name is `name`, made from its arguments; false when no style has that name.
template <size_t I = 0> bool style_from_args(const std::string& name, const StyleArgs& args, ParallelStyle& out) {
  if constexpr (I == std::variant_size_v<ParallelStyle>) {
    return false;
  } else {
    using S = std::variant_alternative_t<I, ParallelStyle>;
    if (name == S::name) {
      out = S::from_args(args);
      return true;
    }
    return style_from_args<I + 1>(name, args, out);
  }
}

template <size_t... I> std::string names(std::index_sequence<I...>) {
  constexpr size_t n = sizeof...(I);
  std::string s;
  ((s += (I == 0       ? ""
          : I + 1 == n ? " or "
                       : ", ") +
         std::string(std::variant_alternative_t<I, ParallelStyle>::name)),
   ...);
  return s;
}

}  // namespace

std::string style_names() { return names(std::make_index_sequence<std::variant_size_v<ParallelStyle>>{}); }

Placement parse_plan_placement(const std::string& text, const std::string& key) {
  // PyTorch's long names are the short notation spelt out.
  std::string t = text;
  for (auto [full, brief] : {std::pair<const char*, const char*>{"Shard", "S"}, {"Replicate", "R"}, {"Partial", "P"}})
    if (t.rfind(full, 0) == 0) t = brief + t.substr(std::string(full).size());
  ParsedPlacements p;
  try {
    p = parse_placements(t);
  } catch (const Error& e) {
    fail("config", "{} = '{}': expected a placement: Shard(d), S(d), Replicate, R, Partial or P(op) ({})", key, text,
         e.what());
  }
  MT_CHECK(p.placements.size() == 1 && p.order_marks[0] < 0, "config",
           "{} = '{}': expected a placement: Shard(d), S(d), Replicate, R, Partial or P(op) (one, for the plan's mesh "
           "dim)",
           key, text);
  return p.placements[0];
}

ParallelPlan plan_from_config(const std::vector<TpPlanEntryConfig>& entries) {
  ParallelPlan plan;
  for (size_t i = 0; i < entries.size(); ++i) {
    const TpPlanEntryConfig& e = entries[i];
    StyleArgs a;
    a.at = fmt::format("parallel.tp_plan[{}]", i);
    MT_CHECK(!e.pattern.empty(), "config", "{}.pattern is empty", a.at);
    auto opt = [&](const std::string& v, const char* k) -> std::optional<Placement> {
      if (v.empty()) return std::nullopt;
      return parse_plan_placement(v, a.at + "." + k);
    };
    a.input_layouts = opt(e.input_layouts, "input_layouts");
    a.output_layouts = opt(e.output_layouts, "output_layouts");
    a.desired_input_layouts = opt(e.desired_input_layouts, "desired_input_layouts");
    a.desired_output_layouts = opt(e.desired_output_layouts, "desired_output_layouts");
    if (e.use_local_output == "true") a.use_local_output = true;
    else if (e.use_local_output == "false") a.use_local_output = false;
    else
      MT_CHECK(e.use_local_output.empty(), "config", "{}.use_local_output = '{}': expected true, false or ''", a.at,
               e.use_local_output);
    ParallelStyle style;
    MT_CHECK(style_from_args(e.style, a, style), "config", "{}.style = '{}': expected {}", a.at, e.style,
             style_names());
    plan.push_back({e.pattern, std::move(style)});
  }
  return plan;
}

}  // namespace mt
