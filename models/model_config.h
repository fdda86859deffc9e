// The model section of a run's config (model: in the YAML): which family (models/model.h) and its sizes.
// It lives with the models, not with the YAML reader: the reader only parses the keys visit() lists; what they
// must satisfy is check_model_config, here. With model.init_from naming a Hugging Face directory the family's
// config.json reader fills it (models/model.h: model_config_from_hf) and the YAML's keys must agree with it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mt {

// RoPE frequency scaling (Hugging Face's rope_scaling / rope_parameters). none: plain RoPE; linear: every
// frequency divided by factor (positions / factor); llama3: Llama 3.1's rule, frequencies whose wavelength is
// below original_max_position_embeddings / high_freq_factor unchanged, above .../low_freq_factor divided by
// factor, and interpolated between.
struct RopeScalingConfig {
  std::string type = "none";
  double factor = 1;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  int64_t original_max_position_embeddings = 8192;
  template <class V> void visit(V& v) {
    v("type", type, "none | linear | llama3 (Hugging Face's rope_type; default: none)");
    v("factor", factor, "linear and llama3: the context extension factor");
    v("low_freq_factor", low_freq_factor, "llama3: wavelengths above original / low_freq_factor are scaled");
    v("high_freq_factor", high_freq_factor, "llama3: wavelengths below original / high_freq_factor are kept");
    v("original_max_position_embeddings", original_max_position_embeddings,
      "llama3: the context the model was pre-trained with");
  }
  bool operator==(const RopeScalingConfig&) const = default;
};

struct ModelConfig {
  std::string type = "llama";  // the family (models/model.h), also Hugging Face's model_type
  int64_t dim = 256;
  int64_t n_layers = 4;
  int64_t n_heads = 8;
  int64_t n_kv_heads = 4;
  int64_t head_dim = 0;  // 0: dim / n_heads
  int64_t ffn_dim = 768;
  int64_t vocab_size = 256;
  double norm_eps = 1e-5;
  double rope_theta = 10000;
  RopeScalingConfig rope_scaling;
  int64_t max_seq_len = 256;
  bool tie_embeddings = false;
  int64_t sliding_window = 0;  // mistral: 0 = none; otherwise it must cover training.seq_len
  double init_std = 0.02;
  std::string init_from;
  template <class V> void visit(V& v) {
    v("type", type, "the model family: llama | mistral | qwen2 (Hugging Face's model_type)");
    v("dim", dim, "model width d");
    v("n_layers", n_layers, "decoder layers");
    v("n_heads", n_heads, "query heads");
    v("n_kv_heads", n_kv_heads, "key/value heads (n_heads divisible by it)");
    v("head_dim", head_dim, "width of one head (0: dim / n_heads)");
    v("ffn_dim", ffn_dim, "MLP hidden width");
    v("vocab_size", vocab_size, "vocabulary size (256: bytes)");
    v("norm_eps", norm_eps, "RMSNorm epsilon");
    v("rope_theta", rope_theta, "RoPE base");
    v("rope_scaling", rope_scaling, "RoPE frequency scaling (Llama 3.1+: llama3)");
    v("max_seq_len", max_seq_len, "longest sequence (positions) the model is used with");
    v("tie_embeddings", tie_embeddings, "lm_head shares model.embed_tokens.weight");
    v("sliding_window", sliding_window,
      "mistral: the attention window (0: none); meshtrain attends to the whole sequence, so it must be at "
      "least training.seq_len");
    v("init_std", init_std, "std of the normal init of matrices (norm weights start at 1, biases at 0)");
    v("init_from", init_from,
      "a Hugging Face model directory (config.json + safetensors) or safetensors file to start from: its "
      "config.json gives the model keys ('' = random init)");
  }
  int64_t head_size() const { return head_dim > 0 ? head_dim : dim / n_heads; }
};

// The checks every family shares (sizes, products that must fit in 64 bits, the RoPE scaling keys) and the
// family's own (models/model.h), as config errors naming the key. seq_len: training.seq_len.
void check_model_config(const ModelConfig& m, int64_t seq_len);

}  // namespace mt
