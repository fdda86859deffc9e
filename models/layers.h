// The generic layers: Linear (weight [out, in], optional bias [out]), Embedding, RMSNorm.
// Each keeps what its backward needs from its last forward (drop_saved releases
// it: activation recompute). Shapes are local
// (what this rank holds); the leading dims of an activation are (B, T).
#pragma once
#include "parallel/module.h"

namespace mt {

// training.fp8 (docs/design/fp8.md): a Linear's three GEMMs in FP8, torchao's float8 recipes.
enum class Fp8Recipe : uint8_t { none, tensorwise, rowwise };
Fp8Recipe parse_fp8_recipe(const std::string& word);  // "none" | "tensorwise" | "rowwise", else names training.fp8

class Linear : public Module {
 public:
  // weight (out_features, in_features); `tied` shares another module's weight (lm_head); with_bias adds
  // bias (out_features), initialised to zeros (Qwen2's q/k/v). Under ColwiseParallel the bias is sharded like the
  // weight's rows; RowwiseParallel refuses a bias (it would be added once per rank before the sum).
  Linear(const std::string& name, int64_t in_features, int64_t out_features, const ParamFactory& f,
         Parameter* tied = nullptr, bool with_bias = false);
  Parameter* weight;
  Parameter* bias = nullptr;
  int64_t in_features, out_features;

  // LoRA (models/lora.h): y = x W^T + scale * (x A^T) B^T; A (rank, in_features) Kaiming-uniform, B
  // (out_features, rank) zeros, PEFT's shapes and initialisation. Under ColwiseParallel B is split by rows and A
  // replicated; under RowwiseParallel A by columns and B replicated (parallel/style.cpp). Null without.
  Parameter* lora_A = nullptr;
  Parameter* lora_B = nullptr;
  double lora_scale = 0;
  double lora_dropout = 0;  // on the adapter's input, in training steps only (lora_dropout_keys)
  void add_lora(int64_t rank, double scale, double dropout, const ParamFactory& f);

  // training.fp8: forward y = fp8(x) fp8(W)^T, backward dx = fp8(dy) fp8(W), dW += fp8(dy)^T fp8(x) (bf16 outputs,
  // the f32 weight gradient accumulated by the GEMM); set by apply_fp8 on every Linear the model has not exempted.
  // A call whose local shapes are not all multiples of kFp8Align (ops.h) runs bf16: a weight that does not fit is
  // said once per Linear, a row count that does not (sampling's short steps) once per process.
  Fp8Recipe fp8 = Fp8Recipe::none;
  bool fp8_exempt = false;  // set by the model where FP8 must not go: lm_head, routers (they stay bf16)

  // call_backward(dy) added into dx_sum (returned): linears that share an input (q/k/v, gate/up) sum their
  // input gradients in the GEMM (beta = 1) instead of a separate add. With input layout hooks on the
  // linear (tensor parallel) the gradient goes through them first and is added apart.
  Tensor call_backward_into(const Tensor& dy, const Tensor& dx_sum);

 protected:
  Tensor forward(const Tensor& x) override;  // (B, T, in) -> (B, T, out)
  Tensor backward(const Tensor& dy) override;
  void drop_saved() override {
    saved_x_ = Tensor();
    saved_h_ = Tensor();
    saved_drop_ = Dropped();
  }

 private:
  // The weight gradient buffer backward's GEMM writes, or undefined when a zero-bubble schedule defers it
  // (weight_grad_queue(): the GEMM is queued on dy and the saved input) or the weight is frozen.
  Tensor weight_grad_now(const Tensor& dy);
  // The base GEMMs (no bias, no adapter): bf16 (or f32/f64) through matmul_*, or FP8 when fp8_fits.
  bool fp8_fits(int64_t rows, const Tensor& w) const;
  void base_forward(const Tensor& y_rows, const Tensor& x_rows, const Tensor& w);
  void base_backward(const Tensor& dx_rows, const Tensor& dw, const Tensor& dy_rows, const Tensor& x_rows,
                     const Tensor& w, bool accumulate_dx);
  mutable bool fp8_said_ = false;  // the bf16 fallback has been logged
  // The adapter's part: y += scale (x A^T) B^T; backward: dx += (scale dy B) A, dB += dy^T h, dA += (scale dy B)^T x.
  void lora_forward(const Tensor& y_rows, const Tensor& x_rows);
  void lora_backward(const Tensor& dx_rows, const Tensor& dy_rows);
  Saved<Tensor> saved_x_;  // (B, T, in_local), per micro-batch (module.h)
  Saved<Tensor> saved_h_;  // (B*T, rank) h = scale * x A^T (LoRA), B's gradient's input
  // With lora_dropout in a training step: the adapter's input after dropout and the mask's keys, for backward.
  struct Dropped {
    Tensor xd;       // (B*T, in_local)
    Tensor row_ids;  // (B*T) i64
    uint64_t seed = 0, stream = 0;
  };
  Saved<Dropped> saved_drop_;
};

class Embedding : public Module {
 public:
  Embedding(const std::string& name, int64_t num_embeddings, int64_t dim, const ParamFactory& f);
  Parameter* weight;
  int64_t num_embeddings, dim;
  double scale = 1;  // the output multiplied by it (Gemma: sqrt(hidden_size)); the gradient too

 protected:
  Tensor forward(const Tensor& tokens) override;  // (B, T) i32 -> (B, T, dim)
  Tensor backward(const Tensor& dy) override;     // returns an undefined tensor (tokens have no gradient)
  void drop_saved() override { saved_tokens_ = Tensor(); }

 private:
  Saved<Tensor> saved_tokens_;  // (B, T)
};

class RMSNorm : public Module {
 public:
  // unit_offset (Gemma): the scale is 1 + weight, the weight initialised to 0.
  RMSNorm(const std::string& name, int64_t dim, double eps, const ParamFactory& f, bool unit_offset = false);
  Parameter* weight;
  double eps;
  bool unit_offset;

  // The decoder's residual add fused into the norm, one pass fewer over the residual stream each way.
  // call_add: sum = x + residual written into x's storage, returns {sum, call(sum)}.
  // call_backward_add: returns call_backward(dy) + dresidual, the gradient reaching sum.
  // With input layout hooks on the norm (sequence parallel) the add is done apart, in the caller's layout.
  std::pair<Tensor, Tensor> call_add(const Tensor& x, const Tensor& residual);
  Tensor call_backward_add(const Tensor& dy, const Tensor& dresidual);

 protected:
  Tensor forward(const Tensor& x) override;  // (B, T, dim) -> (B, T, dim)
  Tensor backward(const Tensor& dy) override;
  void drop_saved() override {
    saved_x_ = Tensor();
    saved_rstd_ = Tensor();
  }

 private:
  Tensor weight_grad() const;  // the gradient buffer, or a scratch one for a frozen weight
  Tensor scale() const;        // (dim) the weight, or 1 + weight with unit_offset (its gradient is the weight's)
  mutable Tensor ones_;        // (dim) 1s in the weight's dtype and device (unit_offset)
  Saved<Tensor> saved_x_, saved_rstd_;  // (B, T, dim), (B*T)
};

// Sets `recipe` on every Linear of the model that is not fp8_exempt; returns how many.
int64_t apply_fp8(Module& model, Fp8Recipe recipe);

// Leading dims times the last: (B, T, C) -> (B*T, C) view.
Tensor as_rows(const Tensor& t);

}  // namespace mt
