#include "models/lora.h"

#include <cmath>
#include <set>

#include "models/layers.h"

namespace mt {

void LoraConfig::check() const {
  MT_CHECK(!targets.empty(), "config", "lora.targets is empty: expected the modules to adapt (e.g. [q_proj, v_proj])");
  std::set<std::string> seen;
  for (const std::string& t : targets)
    MT_CHECK(seen.insert(t).second, "config", "lora.targets names {} twice", t);
}

double LoraConfig::scale() const { return rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank); }

std::string peft_name(const std::string& param_name) { return "base_model.model." + param_name; }

bool is_lora_param(const Parameter& p) {
  auto ends = [&](const std::string& s) {
    return p.name.size() >= s.size() && p.name.compare(p.name.size() - s.size(), s.size(), s) == 0;
  };
  return ends(".lora_A.weight") || ends(".lora_B.weight");
}

namespace {
thread_local LoraDropoutKeys g_keys;
thread_local bool g_in_step = false;
}  // namespace

const LoraDropoutKeys* lora_dropout_keys() {
  return g_in_step && g_keys.row_ids.defined() ? &g_keys : nullptr;
}
LoraDropoutStep::LoraDropoutStep(uint64_t seed, int64_t step) {
  g_keys = LoraDropoutKeys{seed, step, Tensor()};
  g_in_step = true;
}
LoraDropoutStep::~LoraDropoutStep() {
  g_in_step = false;
  g_keys = LoraDropoutKeys{};
}
void set_lora_dropout_rows(const Tensor& row_ids) {
  if (g_in_step) g_keys.row_ids = row_ids;
}

bool has_lora(Module& model) {
  for (Parameter* p : model.parameters())
    if (is_lora_param(*p)) return true;
  return false;
}

std::string file_param_name(const Parameter& p) { return is_lora_param(p) ? peft_name(p.name) : p.name; }

std::string model_files_prefix(Module& model) { return has_lora(model) ? "adapter_model" : "model"; }

int64_t apply_lora(Module& model, const LoraConfig& lora, const ParamFactory& f) {
  if (!lora.enabled()) return 0;
  std::set<std::string> wanted(lora.targets.begin(), lora.targets.end()), found;
  std::vector<Linear*> adapted;
  for (Module* m : model.modules()) {
    if (m->type() != "Linear") continue;
    const std::string& n = m->name();
    const std::string last = n.substr(n.rfind('.') + 1);
    if (!wanted.count(last)) continue;
    found.insert(last);
    adapted.push_back(static_cast<Linear*>(m));
  }
  // The default (all seven) adapts those the model has (Mixtral's experts are not Linears); a list given names
  // only modules the model has.
  const bool defaulted = lora.targets == LoraConfig{}.targets;
  for (const std::string& t : lora.targets)
    MT_CHECK(defaulted || found.count(t), "config",
             "lora.targets names {}, but this model has no Linear called {} (an MoE family's experts are not adapted; "
             "its dense layers' and attention's are)",
             t, t);
  MT_CHECK(!adapted.empty(), "config", "lora.targets: no module of this model is called any of them");
  // Frozen first, so that the adapters made next are the only trainable parameters.
  for (Parameter* p : model.parameters()) freeze(*p);
  for (Linear* l : adapted) l->add_lora(lora.rank, lora.scale(), lora.dropout, f);
  return int64_t(adapted.size());
}

}  // namespace mt
