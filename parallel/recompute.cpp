#include "parallel/recompute.h"

#include <algorithm>
#include <map>

#include "parallel/style.h"

namespace mt {

std::vector<Module*> apply_recompute(Module& root, const RecomputeOptions& o, const RecomputePolicy& policy) {
  if (o.patterns.empty()) {
    MT_CHECK(o.keep.empty(), "config",
             "parallel.recompute.keep is set but parallel.recompute.patterns is empty: "
             "nothing is recomputed");
    return {};
  }
  MT_CHECK(o.every >= 1, "config", "parallel.recompute.every = {}: expected every N-th matched module, N >= 1",
           o.every);
  std::string known_keep;
  for (auto& [name, f] : policy.keep) known_keep += (known_keep.empty() ? "'" : ", '") + name + "'";
  for (size_t i = 0; i < o.keep.size(); ++i)
    MT_CHECK(policy.keep.count(o.keep[i]), "config", "parallel.recompute.keep[{}] = '{}': expected one of {}", i,
             o.keep[i], known_keep.empty() ? std::string("nothing") : known_keep);

  // Match every pattern first: errors before anything changes.
  auto modules = root.modules();           // depth first, parents first: forward order
  std::map<Module*, std::string> matched;  // module -> the first pattern that matched it
  for (size_t i = 0; i < o.patterns.size(); ++i) {
    const std::string& pat = o.patterns[i];
    MT_CHECK(!pat.empty(), "config", "parallel.recompute.patterns[{}] is empty", i);
    int n = 0;
    for (Module* m : modules) {
      if (m->name().empty() || !pattern_matches(pat, m->name())) continue;
      ++n;
      if (std::find(policy.types.begin(), policy.types.end(), m->type()) == policy.types.end()) {
        std::string types;
        for (auto& t : policy.types) types += (types.empty() ? "" : ", ") + t;
        fail("config",
             "parallel.recompute.patterns[{}] = '{}' matches {} ({}): recompute applies to {} modules "
             "only (a layer called through a fused variant would not run its forward again)",
             i, pat, m->name(), m->type(), types);
      }
      matched.emplace(m, pat);
    }
    MT_CHECK(n > 0, "config", "parallel.recompute.patterns[{}] = '{}' matches no module of the model", i, pat);
  }
  // Every N-th in forward order.
  std::vector<Module*> chosen;
  int64_t index = 0;
  for (Module* m : modules)
    if (matched.count(m) && ++index % o.every == 0) chosen.push_back(m);
  MT_CHECK(!chosen.empty(), "config",
           "parallel.recompute.every = {}: the patterns match only {} module{}, so none "
           "would be recomputed",
           o.every, matched.size(), matched.size() == 1 ? "" : "s");
  // No recomputed module inside another.
  for (Module* outer : chosen)
    for (Module* m : outer->modules())
      if (m != outer && std::find(chosen.begin(), chosen.end(), m) != chosen.end())
        fail("config",
             "parallel.recompute: {} ('{}') lies inside {} ('{}'), which is recomputed already: a module "
             "recomputed inside another would run its forward three times",
             m->name(), matched[m], outer->name(), matched[outer]);
  // Each keep entry must concern some module of a recomputed subtree.
  std::vector<std::pair<const RecomputePolicy::Keep*, std::vector<Module*>>> keeps;
  for (size_t i = 0; i < o.keep.size(); ++i) {
    const RecomputePolicy::Keep& k = policy.keep.at(o.keep[i]);
    std::vector<Module*> targets;
    for (Module* outer : chosen)
      for (Module* m : outer->modules())
        if (k.applies(*m)) targets.push_back(m);
    MT_CHECK(!targets.empty(), "config",
             "parallel.recompute.keep[{}] = '{}': no recomputed module contains one "
             "(recomputed: {}{})",
             i, o.keep[i], chosen.front()->name(), chosen.size() > 1 ? ", ..." : "");
    keeps.emplace_back(&k, std::move(targets));
  }
  // Everything checked: apply.
  for (Module* m : chosen) m->recompute = true;
  for (auto& [k, targets] : keeps)
    for (Module* m : targets) k->apply(*m);
  return chosen;
}

}  // namespace mt
