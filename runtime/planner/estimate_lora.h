// What `meshtrain estimate` adds for LoRA (models/lora.h): the adapters' work and the activations they keep, read
// off the stage's own modules (the adapted Linears of the simulated layout). The frozen base's state and its
// missing gradients are estimate.cpp's (frozen_param_bytes, fully_shard's gradient slots).
#pragma once
#include "models/model.h"
#include "comm/mesh.h"

namespace mt {

// The adapters' elements each rank computes with under tp (a replicated A or B whole, a split one its tp part;
// fully_shard gathers them whole), summed over the stage's trainable parameters: 6 FLOPs each a token.
double adapter_tp_elements(Module& stage, const DeviceMesh& mesh);
// What one micro-batch's adapters keep from forward to backward: each adapted Linear outside a recomputed module
// keeps h = scale x A^T, (rows, rank) in the compute dtype (models/linear.cpp), in rank's allocator bytes.
double lora_saved_bytes(Module& stage, const RankShape& rank);

}  // namespace mt
