#include "runtime/train/stage.h"

#include "models/layers.h"
#include "runtime/kernels/ops.h"
#include "runtime/train/optimizer.h"

namespace mt {

DType training_dtype(const Config& c, Device device) {
  if (c.training.dtype == "fp64") {
    MT_CHECK(!device.is_cuda(), "train", "training.dtype = fp64 is for CPU checks; on CUDA use fp32 or bf16");
    return DType::f64;
  }
  return c.training.dtype == "bf16" ? DType::bf16 : DType::f32;
}

RunShape plan_run_shape(const Config& cfg, int world_size) {
  const auto& t = cfg.training;
  RunShape s;
  // What each mesh dim means (parallel_dims.h); every dim exists, size 1 where unused.
  s.pd = ParallelDims::from_config(cfg.parallel, world_size);
  // Batch: the global batch never depends on the mesh; each dp rank takes batch_size / dp rows, and each cp
  // rank of those its part of every sequence.
  s.dp = s.pd.dp();
  require_divisible("training.batch_size", t.batch_size, "dp (dp_replicate x dp_shard)", s.dp);
  s.pd.check_seq_len(t.seq_len);
  s.rows = t.batch_size / s.dp;
  s.micro = t.micro_batch_size > 0 ? t.micro_batch_size : s.rows;
  if (s.rows % s.micro != 0)
    fail("config",
         "training.micro_batch_size = {} must divide the rows per data-parallel rank, batch_size / dp = {} / {} = {}",
         s.micro, t.batch_size, s.dp, s.rows);
  // Pipeline parallel's schedule and stage split.
  s.pipeline = plan_pipeline(cfg, s.pd, s.micro, s.micro_batches());
  // The heads split over tp (and Ulysses), checked again when the parallelisms are applied: here every rank
  // fails alike before any collective.
  s.pd.check_heads(cfg.model.n_heads, cfg.model.n_kv_heads);
  s.dtype = training_dtype(cfg, cfg.comm.device == "cuda" ? Device::cuda(0) : Device::cpu());
  s.reduce_dtype = t.grad_reduce_dtype == "bf16" ? DType::bf16 : accum_dtype(s.dtype);
  return s;
}

Stage assemble_stage(const Config& cfg, const RunShape& shape, const DeviceMesh& mesh, Device device, int pp_rank) {
  const auto& t = cfg.training;
  Stage st;
  const ModelFamily& family = family_of(cfg.model);
  ParamFactory f{mesh, shape.dtype, device, uint64_t(t.seed), cfg.model.init_std};
  f.deferred = true;  // sharded creation: each rank allocates and draws only its part, after the plan
  f.draw_later = shape.init_later;
  st.model = family.build(cfg.model, f);
  // Pipeline parallel: the other stages' modules are dropped before any parameter has storage.
  if (shape.pd.pp_size() > 1)
    st.model->keep_chunks(
        pp_rank_chunks(shape.pipeline.split, shape.pd.pp_size(), cfg.parallel.pp_virtual, pp_rank));
  // LoRA: the adapters added to the stage's targets, the rest frozen, before any layout (styles split adapters
  // with their Linear, fully_shard gives the frozen base no gradient slot).
  apply_lora(*st.model, cfg.lora, f);
  // training.fp8: every Linear the model has not exempted (lm_head, routers) runs its GEMMs in FP8; the experts'
  // grouped GEMMs and the adapters stay bf16 (docs/design/fp8.md).
  apply_fp8(*st.model, parse_fp8_recipe(t.fp8));
  // The family's parallelisms composed: tensor (and sequence) parallel shards the parameters (no communication)
  // and installs the layout hooks; context parallel swaps the attention; recompute; fully_shard.
  st.fsdp = family.parallelize(*st.model, mesh, shape.pd, cfg.parallel, t.seq_len, shape.reduce_dtype);
  GradSyncOptions gs{shape.pd.grad_partial_dims(), size_t(t.grad_bucket_mb * double(1 << 20)), shape.reduce_dtype};
  st.grad_sync = std::make_unique<GradSync>(*st.model, mesh, gs);
  return st;
}

ParamStateBytes param_state_bytes(DType dtype) {
  const double master = double(dtype_size(accum_dtype(dtype)));
  return {master, master, dtype == DType::bf16 ? double(dtype_size(DType::bf16)) : 0.0,
          AdamW::state_element_bytes(accum_dtype(dtype))};
}

ParamStateBytes frozen_param_bytes(DType dtype) {
  // Held in the compute dtype alone (materialize): no f32 master, no copy, no gradient, no optimizer state.
  ParamStateBytes b;
  b.master = double(dtype_size(dtype));
  b.grad = 0;
  b.copy = 0;
  return b;
}

}  // namespace mt
