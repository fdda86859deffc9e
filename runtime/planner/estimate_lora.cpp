#include "runtime/planner/estimate_lora.h"

#include <string>
#include <vector>

#include "models/layers.h"
#include "runtime/planner/estimate.h"

namespace mt {

double adapter_tp_elements(Module& stage, const DeviceMesh& mesh) {
  const int t = mesh.dim_index(dim::tp), tp = mesh.size(t);
  double n = 0;
  for (Parameter* p : stage.parameters())
    if (!p->frozen)
      n += double(shape_numel(p->value.spec.global_shape)) / (p->value.placements()[size_t(t)].is_shard() ? tp : 1);
  return n;
}

double lora_saved_bytes(Module& stage, const RankShape& rank) {
  std::vector<std::string> recomputed;  // the names of recomputed modules: what is inside them is made again
  double bytes = 0;
  for (Module* m : stage.modules()) {
    if (m->recompute) recomputed.push_back(m->name() + ".");
    if (m->type() != "Linear") continue;
    const Linear* l = static_cast<const Linear*>(m);
    if (!l->lora_A) continue;
    bool again = false;
    for (const std::string& r : recomputed) again = again || m->name().compare(0, r.size(), r) == 0;
    // The input rows: the rank's tokens of its micro-batch (sequence parallel gathers them before the Linear).
    const double rows = double(rank.micro) * double(rank.tokens), r = double(l->lora_A->value.spec.global_shape[0]);
    if (!again) bytes += rank.alloc(rows * r * rank.elem);
  }
  return bytes;
}

std::string lora_line(const Estimate& e) {
  double all = 0, trainable = 0;
  for (const StageEstimate& s : e.stages) all += s.params, trainable += s.trainable_params;
  const LoraConfig& l = e.config.lora;
  return fmt::format(
      "  LoRA rank {} (scale {:g}) on {}: {:.0f} trainable parameters of {:.0f} ({:.3f}%); the base frozen: its "
      "weights only (no gradient, no optimizer state, not reduced), its weight gradients not computed\n",
      l.rank, l.scale(), fmt::join(l.targets, ","), trainable, all, 100.0 * trainable / std::max(1.0, all));
}

}  // namespace mt
