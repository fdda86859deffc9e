// The sparse mixture-of-experts block (Mixtral's block_sparse_moe, Qwen2-MoE's and Qwen3-MoE's mlp), in place of a
// decoder layer's MLP:
//   probs = softmax(gate(x)) in f32 (or sigmoid); the top-k experts of each token by probs (+ a selection bias);
//   y[t] = sum_k w[t,k] * expert_{e[t,k]}(x[t]), expert(x) = down(silu(gate_proj x) * up_proj x)
//   (+ sigmoid(shared_expert_gate(x)) * shared_expert(x): qwen2_moe).
// The experts' weights are stacked per projection, one parameter (E, F, C) or (E, C, F) whose checkpoint names
// are its slices' (Hugging Face's "...experts.{j}.w1.weight": stacked_param_name). Tokens are grouped by expert
// (dispatch), run through grouped GEMMs and weighted back (combine). Under expert parallel (MoeContext::ep) each
// rank holds E/ep experts, Shard(0) of the stacked weights, and rows travel to their expert's rank and back by
// all-to-all-v over the ep group.
// The balance loss (transformers' load_balancing_loss_func) pools every sparse layer of the micro-batch and every
// rank holding its other tokens: coef * E / R^2 * sum_e C_e S_e (C_e rows routed to e, S_e the sum of e's probs,
// R the rows routed: tokens x sparse layers). Its gradient on probs is the same row for every token,
// coef * E * C / R^2, added in the router's backward once the first backward of the micro-batch has the
// statistics summed (one all-reduce of (L E + E + 2) numbers).
// No host read per layer (docs/design/moe.md, "Host synchronisations"): the routing (moe_route), the groups' sizes
// (device offsets read by the grouped GEMM), the statistics and the gradient row stay on the device; the host reads
// the step's statistics once, with the trainer's read of loss and norm (pending_stats).
// Dropless expert parallel: NCCL's all-to-all takes its sizes on the host, so a training forward sends fixed blocks
// of cap = ceil(f N K / E) rows per expert (N tokens here, f the bound: model.moe.dropless_bound, then raised),
// padded, like a capacity; rows past cap count as dropped, which the step's one read brings, and such a step is
// not applied but run again with f x 1.5 (MoeContext::raise_bound, called by the trainer through
// CausalLM::redo_overflowed_step), up to cap = N, which no routing overflows. So every applied step is dropless.
// An evaluation forward, and dropless_bound 0, take the exact sizes: the host reads each sparse layer's counts once
// per forward.
#pragma once
#include <memory>
#include <vector>

#include "comm/group.h"
#include "models/layers.h"
#include "models/model.h"

namespace mt {

// What a family calls an expert's projections ("w1", "w3", "w2" in Mixtral; "gate_proj", "up_proj", "down_proj").
struct MoeNames {
  std::string gate, up, down;
  // The shared expert: its name in the block, and whether a sigmoid gate scales it (qwen2_moe's shared_expert_gate;
  // DeepSeek's shared_experts have none).
  std::string shared = "shared_expert";
  bool shared_gate = true;
  // DeepSeek-V3: the router's selection bias is the file's gate.e_score_correction_bias (a frozen parameter).
  bool score_bias = false;
};



// Shared by the model's sparse blocks (one per model, like SequenceContext).
class MoeContext {
 public:
  MoeContext(const MoeConfig& c, int64_t n_sparse_layers, DType acc_dtype, Device dev)
      : config(c), n_sparse(n_sparse_layers), acc(acc_dtype), device(dev), bound(c.dropless_bound) {}
  MoeConfig config;
  int64_t n_sparse;            // sparse layers of the whole model
  DType acc;                   // the router's dtype (probs, weights): accum_dtype of the model's
  Device device;
  // The ranks holding the micro-batch's other tokens: the router statistics are summed over it (the loss group of
  // the model's mesh; under pp the last stage's, the other stages' arriving with the activations). null: this rank.
  Group* tokens = nullptr;
  Group* ep = nullptr;         // expert parallel: the experts split over it; null: all here
  double loss_scale = 0;       // a training forward's loss per token (1 / the step's tokens); 0: no balance loss
  double dispatch_s = 0;       // the step's wall time in the ep all-to-alls so far
  // Bounded dropless expert parallel (moe.h's header): the bound factor now (model.moe.dropless_bound, only raised,
  // between steps: every forward of a step, recomputed ones included, uses the same), and the tokens of the last
  // training forward here (the log's rows per expert).
  double bound;
  int64_t bound_tokens = 0;
  // Whether a forward runs bounded: ep > 1, dropless, dropless_bound > 0, and a training forward (loss_scale > 0:
  // an evaluation takes the exact sizes and never drops a row). The same on every ep rank.
  bool bounded_forward() const;
  bool bounded() const;  // the run trains bounded (the three config conditions)
  // Rows per expert per rank of a bounded forward of N tokens: max(1, ceil(bound N K / E)), at most N (a rank's
  // tokens can send an expert no more: cap N never overflows).
  int64_t bound_cap(int64_t n_tokens) const;
  // After a step whose summed statistics had rows past the bound (1-based step for the log): bound x 1.5, clamped
  // to E / K (cap = N); logs it (rank 0). Fails if the bound was already that (an overflow cannot happen there).
  void raise_bound(int64_t step);
  // After a step with no row past the bound: once kBoundSettleSteps such steps in a row have passed, bound / 1.5
  // (not below model.moe.dropless_bound), logged, so that an early imbalance (a fresh router) does not keep the
  // blocks at their worst case; a step that then overflows is recomputed and raises it again (at most one step in
  // kBoundSettleSteps recomputed where the need sits between two bounds).
  static constexpr int64_t kBoundSettleSteps = 100;
  void settle_bound(int64_t step);
  int64_t clean_steps = 0;  // steps since the bound last moved or overflowed
  // Called by a sparse block (index among the sparse layers) in forward: its tokens here, their rows selected per
  // expert (E) i32, prob sums (E) and rows dropped (1) i32, all on the device.
  void record(int64_t layer, int64_t tokens_here, const Tensor& selected, const Tensor& prob_sums,
              const Tensor& dropped);
  // After this rank's last forward of a training micro-batch (its last pipeline chunk): the statistics' sum over
  // `tokens` starts, asynchronously (every rank of it reaches this point for every micro-batch in the same order,
  // whatever the schedule: no stage waits for another's backward).
  void forward_done();
  // Under pipeline parallel the statistics travel with the micro-batch instead of a sum over the stages (whose
  // all-reduce, ordered among the stages' sends on NCCL, hung): the executor's messages carry them (pipeline.cpp).
  // stats_numel: one message's f64 numbers (L E + E + 2). chunk_flow, after a chunk's forward: this chunk's
  // statistics plus `in` (what arrived with the activation; undefined on the first stage), restarted; on the last
  // stage (last) that flow, summed over `tokens` (the stage's ranks holding the micro-batch's other tokens), becomes
  // the micro-batch's sum and nothing is returned. chunk_total, before a chunk's backward: `in` (the sum that arrived
  // with the gradient) becomes the micro-batch's sum, or on the last stage (in undefined) its own sum is waited for;
  // returns it, for the gradient's message.
  int64_t stats_numel() const { return config.n_experts * (n_sparse + 1) + 2; }
  Tensor chunk_flow(const Tensor& in, bool last);
  Tensor chunk_total(const Tensor& in);
  // In backward: the balance loss's gradient row for probs, (E) accum dtype, or undefined (the sum waited for).
  Tensor aux_grad_row();
  // The step's statistics not read yet (every micro-batch's summed buffer, one after another) as one f64 tensor on
  // the device, for the step's one host read (train_step appends it to loss and norm); undefined: none.
  Tensor pending_stats();
  // And clears them. values: the host copy of pending_stats() (null: read here, one host sync).
  RouterStepStats take_step_stats(const std::vector<double>* values = nullptr);
  std::vector<Tensor> biases;         // per sparse layer (E) accum dtype: the selection bias (bias_update_rate)
  // Their values on the host, kept beside them (every change goes through set_bias), so that neither the update
  // nor the metrics read the device.
  std::vector<std::vector<double>> bias_values;
  void add_bias(int64_t n_experts);                          // a sparse layer's, zero
  void set_bias(size_t layer, const std::vector<double>& v);  // rounded to the bias's dtype, both copies
  void update_biases();               // after the optimizer step: bias += rate * sign(mean load - load)

 private:
  // One micro-batch's statistics on their way to the sum: buf (L E + E + 2) f64 = counts (L, E), prob sums (E),
  // rows, dropped (ops.h moe_stats_record).
  struct Sum {
    Tensor buf;  // f64, on the device; summed in place
    Work work;   // the all-reduce (undefined: summed already, or nothing to sum over)
    double loss_scale = 0;  // the forward's (the balance loss's weight)
    bool waited = false;    // work waited for (stream-ordered on a device)
    bool grad_done = false;
    bool taken = false;     // read at the step's end
    Tensor grad_row;        // (E) accum dtype, on the device; undefined: no balance loss
  };
  struct Micro {
    Tensor stats;                // (L E + E + 2) f64 on the device, this rank's
    std::vector<bool> seen;      // (L) layers recorded
    Tensor prob_sums;            // (E) accum dtype
    std::shared_ptr<Sum> sum;    // started by forward_done (or by the first backward)
  };
  void start_sum(Micro& m);
  void wait(Sum& s);
  void parse(Sum& s, const double* buf);  // the step's statistics and the balance loss from a summed buffer's values
  Micro& fresh_micro();
  std::vector<std::shared_ptr<Sum>> reading_;  // pending_stats()'s, in its order
  Saved<Micro> micro_;
  std::vector<std::shared_ptr<Sum>> pending_;  // started, not yet taken
  RouterStepStats step_;
  std::vector<double> last_load_;  // (L, E) the step's global load, for the bias update
};

// An expert's stacked weights and the grouped GEMMs through them: rows grouped by local expert.
class MoeExperts : public Module {
 public:
  MoeExperts(const std::string& name, int64_t n_experts, int64_t dim, int64_t ffn_dim, const MoeNames& names,
             const ParamFactory& f);
  Parameter *gate_proj, *up_proj, *down_proj;  // (E, F, C), (E, F, C), (E, C, F); Shard(0) over ep
  int64_t n_experts, dim, ffn_dim;
  // (E_local + 1) i32 on the device: the local experts' first rows in the next forward's input (set by the block).
  Tensor offsets;

 protected:
  Tensor forward(const Tensor& x) override;  // (M, C) grouped by local expert (M an upper bound) -> (M, C)
  Tensor backward(const Tensor& dy) override;
  void drop_saved() override;

 private:
  Saved<Tensor> x_, gate_, up_;  // (M, C), (M, F), (M, F)
  Saved<Tensor> offsets_;
};

class SparseMoeBlock : public Module {
 public:
  SparseMoeBlock(const std::string& name, const ModelConfig& c, const MoeNames& names, int64_t sparse_index,
                 const ParamFactory& f, std::shared_ptr<MoeContext> ctx);
  Linear* gate;                  // the router (E, C)
  MoeExperts* experts;
  Module* shared_expert = nullptr;       // LlamaMLP (qwen2_moe's shared_expert, DeepSeek's shared_experts)
  Linear* shared_expert_gate = nullptr;  // (1, C) qwen2_moe
  Parameter* score_bias = nullptr;       // (E) DeepSeek-V3's gate.e_score_correction_bias, frozen
  int64_t sparse_index;                  // among the model's sparse layers

 protected:
  Tensor forward(const Tensor& x) override;  // (B, T, C) -> (B, T, C)
  Tensor backward(const Tensor& dy) override;
  void drop_saved() override;

 private:
  struct Route;
  // (M, C): local or over ep. counts (E) i32 and offsets (E + 1) i32 on the device; capacity 0: dropless.
  Tensor run_experts(const Tensor& xp, const Tensor& counts, const Tensor& offsets, int64_t capacity);
  Tensor run_experts_backward(const Tensor& dh);
  std::shared_ptr<MoeContext> ctx_;
  // Per micro-batch: the router's output, the routing, what combine and the shared expert need.
  Saved<Tensor> probs_, weights_, experts_idx_, slot_, h_, shared_out_, shared_w_, shared_slot_;
  Saved<std::vector<int64_t>> send_, recv_;  // expert parallel: rows per peer
  Saved<Tensor> order_;                      // expert parallel: (R, 1) each arrived row's expert-major row
  Saved<Tensor> local_offsets_;              // expert parallel with a capacity: (E_local + 1) i32
  Saved<Shape> in_shape_;
};

}  // namespace mt
