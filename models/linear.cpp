// Linear: y = x W^T (+ b) (+ the LoRA adapter's scale (x A^T) B^T). Backward: dx = dy W, dW += dy^T x, db += column
// sums of dy (both accumulate over micro-batches; skipped for a frozen weight or bias).
#include <spdlog/spdlog.h>

#include <atomic>

#include "models/layers.h"
#include "models/lora.h"
#include "runtime/core/philox.h"
#include "runtime/kernels/ops.h"

namespace mt {

Tensor as_rows(const Tensor& t) {
  int64_t rows = 1;  // explicit, so that an empty shard (last dim 0) keeps its row count
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return t.reshape({rows, t.size(-1)});
}

Linear::Linear(const std::string& name, int64_t in, int64_t out, const ParamFactory& f, Parameter* tied,
               bool with_bias)
    : Module(name, "Linear"), in_features(in), out_features(out) {
  if (tied) {
    MT_CHECK(tied->value.shape() == (Shape{out, in}), "model", "{}: tied weight {} has shape {}, expected {}", name,
             tied->name, shape_str(tied->value.shape()), shape_str({out, in}));
    weight = tied;
    borrow_parameter(tied);
  } else {
    weight = add_parameter(f.make(child_name(name, "weight"), {out, in}, "normal"));
  }
  if (with_bias) bias = add_parameter(f.make(child_name(name, "bias"), {out}, "zeros"));
}

Tensor Linear::forward(const Tensor& x) {
  const Tensor& w = weight->compute_local();  // (out_local, in_local)
  MT_CHECK(x.size(-1) == w.size(1), "model", "{}: input has {} features, the local weight {} expects {}", name(),
           x.size(-1), shape_str(w.shape()), w.size(1));
  saved_x_ = x;
  Shape out_shape = x.shape();
  out_shape.back() = w.size(0);
  Tensor y = empty(out_shape, x.dtype(), x.device());  // (B, T, out_local)
  base_forward(as_rows(y), as_rows(x), w);
  if (bias) bias_add_forward(as_rows(y), as_rows(y), bias->compute_local());  // (out_local)
  if (lora_A) lora_forward(as_rows(y), as_rows(x));
  return y;
}

void Linear::add_lora(int64_t rank, double scale, double dropout, const ParamFactory& f) {
  MT_CHECK(!lora_A, "model", "{}: already has a LoRA adapter", name());
  lora_dropout = dropout;
  lora_A = add_parameter(f.make(child_name(name(), "lora_A.weight"), {rank, in_features}, "kaiming_uniform"));
  lora_B = add_parameter(f.make(child_name(name(), "lora_B.weight"), {out_features, rank}, "zeros"));
  lora_scale = scale;
}

void Linear::lora_forward(const Tensor& y_rows, const Tensor& x_rows) {
  const Tensor& a = lora_A->compute_local();  // (rank, in_local)
  const Tensor& b = lora_B->compute_local();  // (out_local, rank)
  MT_CHECK(a.size(1) == x_rows.size(1) && b.size(0) == y_rows.size(1), "model",
           "{}: the adapter's local shapes A {} and B {} do not fit the input {} and output {}", name(),
           shape_str(a.shape()), shape_str(b.shape()), shape_str(x_rows.shape()), shape_str(y_rows.shape()));
  Tensor xa = x_rows;  // the adapter's input: x, or x after dropout in a training step
  saved_drop_ = Dropped();
  if (const LoraDropoutKeys* k = lora_dropout ? lora_dropout_keys() : nullptr) {
    MT_CHECK(k->row_ids.numel() == x_rows.size(0), "model", "{}: lora_dropout's keys name {} rows, the input has {}",
             name(), k->row_ids.numel(), x_rows.size(0));
    Dropped d{empty(x_rows.shape(), x_rows.dtype(), x_rows.device()), k->row_ids, k->seed,
              philox::stream_id(fmt::format("{}#{}", name(), k->step).c_str())};
    dropout_rows(d.xd, x_rows, d.row_ids, d.seed, d.stream, lora_A->compute_offset()[1], in_features, lora_dropout);
    xa = d.xd;
    saved_drop_ = d;
  }
  Tensor h = empty({x_rows.size(0), a.size(0)}, x_rows.dtype(), x_rows.device());  // (B*T, rank)
  matmul_forward(h, xa, a);
  scale_(h, lora_scale);
  matmul_forward(y_rows, h, b, /*accumulate=*/true);
  saved_h_ = h;
}

void Linear::lora_backward(const Tensor& dx_rows, const Tensor& dy_rows) {
  const Tensor& h = *saved_h_;  // (B*T, rank)
  Tensor dh = empty(h.shape(), dy_rows.dtype(), dy_rows.device());  // (B*T, rank) dy B, then scaled
  matmul_backward(dh, lora_B->grad_or_none(), dy_rows, h, lora_B->compute_local());
  scale_(dh, lora_scale);
  const Dropped& d = *saved_drop_;
  if (!d.xd.defined()) {
    matmul_backward(dx_rows, lora_A->grad_or_none(), dh, as_rows(saved_x_), lora_A->compute_local(),
                    /*accumulate_dinp=*/true);
  } else {  // dx += dropout(dh A) with the forward's mask; dA += dh^T xd
    Tensor g = empty(dx_rows.shape(), dh.dtype(), dh.device());  // (B*T, in_local)
    matmul_backward(g, lora_A->grad_or_none(), dh, d.xd, lora_A->compute_local());
    dropout_rows(g, g, d.row_ids, d.seed, d.stream, lora_A->compute_offset()[1], in_features, lora_dropout);
    add_(dx_rows, g);
  }
  saved_h_ = Tensor();
  saved_drop_ = Dropped();
}

Tensor Linear::call_backward_into(const Tensor& dy, const Tensor& dx_sum) {
  if (!input_hooks.empty()) {
    add_(dx_sum, call_backward(dy));
    return dx_sum;
  }
  MT_CHECK(dx_sum.shape() == saved_x_->shape(), "model", "{}: the gradient sum has shape {}, the input {}", name(),
           shape_str(dx_sum.shape()), shape_str(saved_x_->shape()));
  return call_backward_around(dy, [&](const Tensor& g) {
    if (bias && !bias->frozen) bias_add_backward(bias->grad_local(), as_rows(g));
    base_backward(as_rows(dx_sum), weight_grad_now(g), as_rows(g), as_rows(saved_x_), weight->compute_local(),
                  /*accumulate_dx=*/true);
    if (lora_A) lora_backward(as_rows(dx_sum), as_rows(g));
    saved_x_ = Tensor();
    return dx_sum;
  });
}

Tensor Linear::backward(const Tensor& dy) {
  Tensor dx = empty(saved_x_->shape(), dy.dtype(), dy.device());  // (B, T, in_local)
  if (bias && !bias->frozen) bias_add_backward(bias->grad_local(), as_rows(dy));
  base_backward(as_rows(dx), weight_grad_now(dy), as_rows(dy), as_rows(saved_x_), weight->compute_local(), false);
  if (lora_A) lora_backward(as_rows(dx), as_rows(dy));
  saved_x_ = Tensor();
  return dx;
}

Tensor Linear::weight_grad_now(const Tensor& dy) {
  if (weight->frozen) return Tensor();  // the input gradient only
  WeightGradQueue* q = weight_grad_queue();
  if (!q) return weight->grad_local();
  // Deferred (zero-bubble W): dW += dy^T x later, on the same input and gradient, into the same buffer.
  q->push_back([this, dy, x = *saved_x_] {
    base_backward(Tensor(), weight->grad_local(), as_rows(dy), as_rows(x), weight->compute_local(), false);
  });
  return Tensor();
}

Fp8Recipe parse_fp8_recipe(const std::string& word) {
  if (word == "none") return Fp8Recipe::none;
  if (word == "tensorwise") return Fp8Recipe::tensorwise;
  if (word == "rowwise") return Fp8Recipe::rowwise;
  fail("config", "training.fp8 = {}: expected none, tensorwise or rowwise", word);
}

int64_t apply_fp8(Module& model, Fp8Recipe recipe) {
  int64_t n = 0;
  for (Module* m : model.modules()) {
    if (m->type() != "Linear") continue;
    auto* l = static_cast<Linear*>(m);
    l->fp8 = l->fp8_exempt ? Fp8Recipe::none : recipe;
    n += l->fp8 != Fp8Recipe::none;
  }
  return n;
}

bool Linear::fp8_fits(int64_t rows, const Tensor& w) const {
  if (fp8 == Fp8Recipe::none || w.dtype() != DType::bf16) return false;
  // The weight's local shape is fixed: a misfit is said once per Linear. The row count varies by call (sampling's
  // one-token steps): a misfit there is said once per process, not once per Linear.
  if (w.size(0) % kFp8Align != 0 || w.size(1) % kFp8Align != 0) {
    if (!fp8_said_)
      spdlog::info("training.fp8: {} runs in bf16: its local weight {} has a dim that is not a multiple of {} "
                   "(cuBLASLt's FP8 GEMMs)",
                   name(), shape_str(w.shape()), kFp8Align);
    fp8_said_ = true;
    return false;
  }
  if (rows % kFp8Align != 0) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true))
      spdlog::info("training.fp8: {} rows (not a multiple of {}) at {}: such calls run in bf16 (said once for all "
                   "Linears; sampling's short steps are such calls)",
                   rows, kFp8Align, name());
    return false;
  }
  return true;
}

// FP8 forward: y (N, OC) = fp8(x) (N, C) . fp8(W) (OC, C)^T, both E4M3, scaled along C (rowwise: per row of x and of
// W). The casts are recomputed in backward from the saved bf16 input (torchao saves the high-precision tensors too):
// the same amax, so the same codes.
void Linear::base_forward(const Tensor& y_rows, const Tensor& x_rows, const Tensor& w) {
  const int64_t N = x_rows.size(0), C = w.size(1), OC = w.size(0);
  if (!fp8_fits(N, w)) return matmul_forward(y_rows, x_rows, w);
  const bool rowwise = fp8 == Fp8Recipe::rowwise;
  const Device d = x_rows.device();
  Tensor xq = empty({N, C}, DType::u8, d), xi = empty({rowwise ? N : 1}, DType::f32, d);
  Tensor wq = empty({OC, C}, DType::u8, d), wi = empty({rowwise ? OC : 1}, DType::f32, d);
  fp8_cast(xq, xi, Tensor(), Tensor(), x_rows, Fp8Format::e4m3, rowwise, rowwise);
  fp8_cast(wq, wi, Tensor(), Tensor(), w, Fp8Format::e4m3, rowwise, rowwise);
  fp8_matmul(y_rows, xq, xi, wq, wi, Fp8Format::e4m3, Fp8Format::e4m3);
}

// FP8 backward: the gradient cast to E5M2 (tensorwise) or E4M3 (rowwise, torchao's recipe), each operand with K
// contiguous (the TN layout): dx (N, C) = dy (N, OC) . (W^T) (C, OC)^T, dW (OC, C) += (dy^T) (OC, N) . (x^T) (C, N)^T,
// the transposed copies written by the casts (rowwise: scaled along their own contraction dim).
void Linear::base_backward(const Tensor& dx_rows, const Tensor& dw, const Tensor& dy_rows, const Tensor& x_rows,
                           const Tensor& w, bool accumulate_dx) {
  const int64_t N = dy_rows.size(0), C = w.size(1), OC = w.size(0);
  if (!fp8_fits(N, w)) return matmul_backward(dx_rows, dw, dy_rows, x_rows, w, accumulate_dx);
  const bool rowwise = fp8 == Fp8Recipe::rowwise;
  const Fp8Format gf = rowwise ? Fp8Format::e4m3 : Fp8Format::e5m2;
  const Device d = dy_rows.device();
  const bool want_dx = dx_rows.defined(), want_dw = dw.defined();
  Tensor dyq, dyi, dyt, dyti;  // (N, OC), (N | 1); (OC, N), (OC | 1)
  if (want_dx) dyq = empty({N, OC}, DType::u8, d), dyi = empty({rowwise ? N : 1}, DType::f32, d);
  if (want_dw) dyt = empty({OC, N}, DType::u8, d), dyti = empty({rowwise ? OC : 1}, DType::f32, d);
  if (want_dx || want_dw) fp8_cast(dyq, dyi, dyt, dyti, dy_rows, gf, rowwise, rowwise);
  if (want_dx) {
    Tensor wt = empty({C, OC}, DType::u8, d), wti = empty({rowwise ? C : 1}, DType::f32, d);
    fp8_cast(Tensor(), Tensor(), wt, wti, w, Fp8Format::e4m3, rowwise, rowwise);
    fp8_matmul(dx_rows, dyq, dyi, wt, wti, gf, Fp8Format::e4m3, accumulate_dx);
  }
  if (want_dw) {
    Tensor xt = empty({C, N}, DType::u8, d), xti = empty({rowwise ? C : 1}, DType::f32, d);
    fp8_cast(Tensor(), Tensor(), xt, xti, x_rows, Fp8Format::e4m3, rowwise, rowwise);
    fp8_matmul(dw, dyt, dyti, xt, xti, gf, Fp8Format::e4m3, /*accumulate=*/true);
  }
}

}  // namespace mt
