// Embedding: out[n] = table[token[n]]. With a vocab-sharded table each rank
// looks up the rows it holds and gives zeros elsewhere (a partial sum).
#include "models/layers.h"
#include "runtime/kernels/ops.h"

namespace mt {

Embedding::Embedding(const std::string& name, int64_t n, int64_t d, const ParamFactory& f)
    : Module(name, "Embedding"), num_embeddings(n), dim(d) {
  weight = add_parameter(f.make(child_name(name, "weight"), {n, d}, "normal"));
}

Tensor Embedding::forward(const Tensor& tokens) {
  MT_CHECK(tokens.dtype() == DType::i32 && tokens.dim() == 2, "model", "{}: expected (B, T) i32 tokens, got {} {}",
           name(), dtype_name(tokens.dtype()), shape_str(tokens.shape()));
  const Tensor& table = weight->compute_local();  // (V_local, dim_local)
  saved_tokens_ = tokens;
  Tensor out = empty({tokens.size(0), tokens.size(1), table.size(1)}, table.dtype(), table.device());  // (B, T, C)
  embedding_forward(as_rows(out), tokens.reshape({-1}), table, weight->compute_offset()[0], num_embeddings);
  if (scale != 1) scale_(out, scale);  // a partial sum under a vocab split: scaling commutes with its reduction
  return out;
}

Tensor Embedding::backward(const Tensor& dy) {
  if (!weight->frozen) {
    Tensor g = dy;
    if (scale != 1) g = dy.clone(), scale_(g, scale);  // (B, T, C) dy * scale; dy is the caller's
    embedding_backward(weight->grad_local(), as_rows(g), saved_tokens_->reshape({-1}), weight->compute_offset()[0]);
  }
  saved_tokens_ = Tensor();
  return Tensor();
}

}  // namespace mt
