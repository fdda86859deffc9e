// The ops of a Llama training step, forward and backward side by side, as free
// functions over Tensors. Each dispatches on the tensors' device: the CPU
// backend (runtime/kernels/cpu, Eigen and OpenMP) computes f32 and f64 (f64 for
// gradient checks) and runs bf16 by widening to f32 and rounding the outputs
// once (a reference, not fast); the CUDA backend (runtime/kernels/cuda) takes
// f32 and bf16.
// Conventions (llm.c's): outputs first, then inputs, then sizes/options.
// Every tensor is contiguous; float tensors of one call share one dtype, except
// the mixed-precision rule: with bf16 activations, statistics (rstd, lse,
// losses) and weight gradients (dweight, dtable) are f32.
// Shapes are given in comments; N is the number of rows (tokens), C channels.
// Each op is defined with its CPU kernels in runtime/kernels/cpu/<family>.cpp, its CUDA kernels and launchers
// in runtime/kernels/cuda/<family>.cu (docs/ARCHITECTURE.md, "How to add an op").
#pragma once
#include <vector>

#include "runtime/core/fp8.h"
#include "runtime/core/tensor.h"

namespace mt {

// ---- matmul (nn.Linear without bias; weight is [out, in] as in PyTorch) ----
// out (N, OC) = inp (N, C) @ weight (OC, C)^T; accumulate: out += instead of =.
void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, bool accumulate = false);
// dinp (N, C) = dout (N, OC) @ weight (OC, C)        (skipped if dinp undefined; overwritten, or with
//                                                    accumulate_dinp added to: the GEMM's beta = 1, so
//                                                    linears sharing an input sum their gradients with no
//                                                    separate add pass)
// dweight (OC, C) += dout^T @ inp                   (skipped if undefined; always accumulates,
//                                                    so micro-batches add up; zero it per step)
void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight, bool accumulate_dinp = false);

// ---- FP8 linears (training.fp8, docs/design/fp8.md; formats and scales in runtime/core/fp8.h) ----
// Every dim of an FP8 GEMM is a multiple of kFp8Align (cuBLASLt's FP8 kernels; the CPU refuses the same shapes).
constexpr int64_t kFp8Align = 16;
// Casts x (R, K) (bf16 or f32) to FP8 codes (u8) with scales from its current amax, all on x's device (no host read):
// scale = fp8::scale_from_amax(amax, fmt, pow2), code = fp8::quantize(x, scale, fmt), and the inverse 1 / scale (f32)
// is stored for the GEMM to undo it.
//   q (R, K) u8 and q_inv: x cast as it lies; qt (K, R) u8 and qt_inv: x^T cast (the transposed copy a GEMM whose
//   contraction runs along R needs). Either pair may be undefined (skipped).
//   rowwise false (tensorwise): one amax over all of x; q_inv and qt_inv (1), the same value.
//   rowwise true: q_inv (R) from each row's amax, qt_inv (K) from each column's amax (each copy scaled along its own
//   contraction dim, as torchao's axiswise casts of a transposed operand).
void fp8_cast(const Tensor& q, const Tensor& q_inv, const Tensor& qt, const Tensor& qt_inv, const Tensor& x,
              Fp8Format fmt, bool rowwise, bool pow2);
// out (M, N) (bf16, or f32 for weight gradients) = (a (M, K) . b (N, K)^T) * b_inv[j] * a_inv[i], or += with
// accumulate: a and b FP8 codes (u8) of formats a_fmt and b_fmt (not both e5m2), both with K contiguous (cuBLASLt's
// TN, the only FP8 layout Hopper takes); a_inv (1) or (M), b_inv (1) or (N) f32 (fp8_cast's inverses; both (1) or
// both vectors). The products are summed exactly enough (f64 on the CPU, f32 accumulation on a GPU), the sum rounded
// to f32, then scaled in that order and rounded to out's dtype (+ out when accumulating, in f32 first).
void fp8_matmul(const Tensor& out, const Tensor& a, const Tensor& a_inv, const Tensor& b, const Tensor& b_inv,
                Fp8Format a_fmt, Fp8Format b_fmt, bool accumulate = false);

// ---- RMSNorm: out = x * rsqrt(mean(x^2) + eps) * w ----
// out (N, C), rstd (N) saved for backward; inp (N, C), weight (C).
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, double eps);
// The residual add fused in front of the norm (one pass fewer over the residual stream):
// sum (N, C) = a + b, rounded to the activation type as add() would (sum may alias a or b); out = rmsnorm(sum).
void add_rmsnorm_forward(const Tensor& sum, const Tensor& out, const Tensor& rstd, const Tensor& a, const Tensor& b,
                         const Tensor& weight, double eps);
// dinp (N, C) overwritten; dweight (C) += sum over rows of dout * x * rstd.
// dresidual (N, C), if defined: added to dinp in the same pass (the residual branch's gradient; it may alias
// dinp), the sum rounded once.
void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd, const Tensor& dresidual = Tensor());

// ---- RoPE, Hugging Face convention ----
// cos, sin (P, hd) for positions (P) i64: inv_freq_i = theta^(-2i/hd), angle = pos * inv_freq,
// repeated twice along hd ([f0..f_{hd/2-1}, f0..f_{hd/2-1}]); computed in cos's dtype, as Hugging Face
// computes them in the model's float type.
void rope_tables(const Tensor& cos, const Tensor& sin, const Tensor& positions, double theta);
// x (B, T, H, hd): out = x * cos[t] + rotate_half(x) * sin[t], rotate_half(x) = [-x2, x1];
// cos, sin (T, hd) give the rows for the T positions of this sequence. out may alias inp.
void rope_forward(const Tensor& out, const Tensor& inp, const Tensor& cos, const Tensor& sin);
// The transpose: dinp = dout * cos + rotate_half^T(dout * sin), rotate_half^T(y) = [y2, -y1]. May alias.
void rope_backward(const Tensor& dinp, const Tensor& dout, const Tensor& cos, const Tensor& sin);

// ---- SwiGLU: out = silu(gate) * up ----
// out, gate, up (N, F).
void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up);
// dgate, dup (N, F) overwritten.
void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up);
// GeGLU (Gemma's MLP): out = gelu_tanh(gate) * up, gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
// (PyTorch's gelu(approximate="tanh")). Shapes and aliasing as swiglu's.
void geglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up);
void geglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up);
// Soft-capping (Gemma 2's final logits): out = cap * tanh(inp / cap), any shape, out may alias inp; cap > 0.
// Backward from the output: dinp = dout * (1 - (out / cap)^2) (dinp may alias dout).
void softcap_forward(const Tensor& out, const Tensor& inp, double cap);
void softcap_backward(const Tensor& dinp, const Tensor& dout, const Tensor& out, double cap);

// ---- Embedding (table rows [row_begin, row_begin + V_local) live here: vocab-sharded tables) ----
// out (N, C) = table[tokens[n] - row_begin], zero for tokens outside this shard; tokens (N) i32.
// A token outside [0, vocab_size) is an error naming the position ([kernels] ...).
void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int64_t row_begin = 0,
                       int64_t vocab_size = -1);
// dtable (V_local, C) += scatter of dout rows; deterministic (fixed order, no atomics). dtable is f32
// when dout is bf16.
void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t row_begin = 0);

// ---- Softmax cross-entropy, fused ----
// logits (N, V), targets (N) i32. losses (N, f64 for f64 logits, else f32) = logsumexp(row) - row[target].
// If dlogits (N, V) is defined it gets (softmax(row) - onehot(target)) * grad_scale in the same pass
// (dlogits may alias logits: the logits are then overwritten). Targets < 0 are ignored (loss 0,
// gradient 0); a target >= V is an error.
void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, double grad_scale);

// ---- Vocab-parallel cross-entropy: the pieces between the tp all-reduces ----
// logits (N, V_local) hold columns [vocab_begin, vocab_begin + V_local) of the full vocabulary.
// Statistics are (N) f64 on the logits' device. row_max = max of each local row (-inf for V_local = 0).
void vocab_shard_max(const Tensor& row_max, const Tensor& logits);
// Given the global row_max (N) f64: sumexp (N) f64 = sum exp(x - row_max) over local columns;
// target_logit (N) f64 = the target's logit where this shard holds it, else 0.
void vocab_shard_sumexp(const Tensor& sumexp, const Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                        const Tensor& row_max, int64_t vocab_begin);
// With the global row_max, sumexp and target logit: losses (N) = log(sumexp) + row_max - target_logit,
// and, if dlogits is defined, dlogits = (softmax - onehot) * grad_scale on the local columns (may alias
// logits). Targets < 0 are ignored (loss 0, gradient 0).
void vocab_shard_loss(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                      const Tensor& row_max, const Tensor& sumexp, const Tensor& target_logit, int64_t vocab_begin,
                      double grad_scale);

// ---- Element-wise and reductions ----
void add_(const Tensor& dst, const Tensor& src);                // dst += src
void add(const Tensor& out, const Tensor& a, const Tensor& b);  // out = a + b (out may alias a or b)
void scale_(const Tensor& t, double s);                         // t *= s
// Dropout whose mask depends on each element's global index alone (LoRA's lora_dropout: the same on every mesh):
// out (N, C) = inp (N, C) * keep / (1 - p), keep = philox::uniform(seed, stream, row_ids[n] * cols_global +
// col_offset + c) >= p (runtime/core/philox.h). row_ids (N) i64 on inp's device: each row's global index; col_offset:
// column 0's index among cols_global columns. out may alias inp. The same arguments give the same mask, so the
// backward is this op on the gradient.
void dropout_rows(const Tensor& out, const Tensor& inp, const Tensor& row_ids, uint64_t seed, uint64_t stream,
                  int64_t col_offset, int64_t cols_global, double p);
// dst <- src element-wise between float dtypes (f32, bf16, f64 on the CPU), same element count, same
// device; rounding to bf16 is to nearest even (as CUDA's __float2bfloat16_rn).
void convert(const Tensor& dst, const Tensor& src);
// Bias of a linear layer (Qwen2's q/k/v projections): out (N, C) = inp (N, C) + bias (C) on every row; out may
// alias inp.
void bias_add_forward(const Tensor& out, const Tensor& inp, const Tensor& bias);
// dbias (C) += the column sums of dout (N, C); dbias is f32 when dout is bf16. Deterministic: a fixed order of
// summation (f64 on the CPU), the same bits whatever the thread count.
void bias_add_backward(const Tensor& dbias, const Tensor& dout);
double sum_squares(const Tensor& t);  // sum of t^2, accumulated in f64
double sum(const Tensor& t);          // accumulated in f64
// sum_squares of each tensor, the same bits as one call per tensor; on a device one host sync in all
// (the global gradient norm reads ~10 tensors per layer).
std::vector<double> sum_squares_each(const std::vector<Tensor>& ts);
// The same sums left on the device (no host read, so no host sync): out (k) f64 on the tensors' device, not
// zeroed; out[slot] += sum(t), and out[slots[i]] += sum_squares(ts[i]) in the order given. Each addition has the
// bits of `x += sum(t)` on the host with the functions above.
void sum_into(const Tensor& out, int64_t slot, const Tensor& t);
void sum_squares_into(const Tensor& out, const std::vector<int64_t>& slots, const std::vector<Tensor>& ts);

// ---- Local attention: the kernels behind attention/local_attention.h (which checks and documents the options) ----
// q (B, T, H, hd), k and v (B, S, KV, hd), H a multiple of KV (grouped-query: kv head j serves q heads
// j*H/KV .. (j+1)*H/KV - 1). out (B, T, H, hd); lse (B, H, T) in accum dtype (f32 for bf16 q), natural log.
// scale multiplies q . k. causal: query t sees key s iff k_pos0 + s <= q_pos0 + t (global positions);
// doc_start (B, T) i64 on q's device, or undefined: query t of row b also sees only keys at positions
// >= doc_start[b, t]. window > 0: query t sees only keys at positions > q_pos0 + t - window (a sliding window;
// 0: none). softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2's
// attention-logit soft-capping; 0: none). A query that sees no key gets out = 0, lse = -inf. Kernels: the CPU's blockwise one (f32,
// f64; bf16 on widened copies); on CUDA the tensor-core kernel for bf16 with hd 64 or 128 (unless
// MT_REFERENCE_ATTENTION=1), else the fp32 reference kernel (bf16 on widened copies).
//
// bf16 on CUDA picks its kernel by set_attention_kernel (config attention.kernel, docs/design/cudnn-attention.md):
// cuDNN's fused attention (loaded at run time) or the own flash kernel. auto: cuDNN where it loads and takes the
// call, else flash, the reason said once; cudnn: a call cuDNN cannot take is an error naming attention.kernel
// (a query block before its key block, documents off the diagonal; check_attention_kernel finds what it can at
// start-up).
void local_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                             double scale, bool causal, int64_t q_pos0, int64_t k_pos0, const Tensor& doc_start,
                             int64_t window = 0, double softcap = 0);
// The probabilities recomputed from q, k and lse (and the same kernel choice as the forward: cuDNN's backward
// takes the stats cuDNN's forward wrote, and both write the natural-log log-sum-exp). dq (B, T, H, hd) overwritten;
// dk, dv (B, S, KV, hd) overwritten,
// or with accumulate added to. dout, out (B, T, H, hd) and lse (B, H, T) from the forward.
void local_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, double scale,
                              bool causal, int64_t q_pos0, int64_t k_pos0, const Tensor& doc_start, bool accumulate,
                              int64_t window = 0, double softcap = 0);

// The kernel of bf16 attention on CUDA: attention.kernel and attention.deterministic (set once at a training run's
// start-up, before any step; until then, and in commands that do not train, the flash kernel).
enum class AttentionKernel { automatic, cudnn, flash };
struct AttentionKernelChoice {
  AttentionKernel kernel = AttentionKernel::automatic;  // the config's default
  bool deterministic = false;  // cuDNN's backward only from engines without its NONDETERMINISTIC note
};
void set_attention_kernel(AttentionKernelChoice choice);
AttentionKernelChoice attention_kernel();
// "auto" | "cudnn" | "flash" (the config's words), or throws naming attention.kernel.
AttentionKernel parse_attention_kernel(const std::string& word);
// At start-up, for a run on `device` (before any collective): loads cuDNN when the choice may use it and logs once
// which kernel bf16 attention runs (cuDNN's version and path, or why the flash kernel; auto without a loadable
// cuDNN becomes flash, so attention_kernel() says afterwards whether cuDNN may run). Throws "[config]
// attention.kernel = cudnn: ..." when cudnn is asked for and cannot be: not a CUDA device, cuDNN not loadable, or
// cp_documents (packed documents with parallel.cp > 1: blocks off the diagonal, whose queries may see no key).
void check_attention_kernel(const Device& device, int64_t head_dim, bool cp_documents);

// ---- Copies along one dim and the attention merge (context parallel) ----
// dst[..., dst_begin + i, ...] = src[..., src_begin + i, ...] for i < n along tensor dim `dim`; the other dims
// of dst and src are equal. Any dtype; one strided 2-D copy (rows: the dims before `dim`), stream-ordered on
// a device. dst and src must not overlap.
void copy_slice(const Tensor& dst, int64_t dst_begin, const Tensor& src, int64_t src_begin, int64_t n, int dim);
// Log-sum-exp merge of two attention results over disjoint sets of keys. out (B, T, H, hd) and lse (B, H, T)
// hold one (both in accum_dtype of the activations: f32 for bf16, else the activations' dtype); part_out
// (B, T, H, hd) in the activation dtype and part_lse (B, H, T) in accum dtype hold the other. Afterwards
// out and lse hold the result over the union: lse' = log(exp(lse) + exp(part_lse)),
// out' = exp(lse - lse') out + exp(part_lse - lse') part_out. Rows with -inf on one side take the other
// side's values; rows with -inf on both stay (out 0, lse -inf).
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out, const Tensor& part_lse);
// Shards packed for a collective (redistribution on the tensor's device). lens split tensor dim `dim` into
// consecutive pieces (sum of lens = the dim's size); block j is the tensor's piece j, shape with lens[j] at dim,
// and the blocks lie one after the other in `packed` (numel of the tensor), each contiguous.
// pack_blocks: packed <- blocks of src; unpack_blocks: dst <- blocks of packed. Any dtype; stream-ordered on a
// device (one launch per 64 blocks); packed and the tensor must not overlap.
void pack_blocks(const Tensor& packed, const Tensor& src, int dim, const std::vector<int64_t>& lens);
void unpack_blocks(const Tensor& dst, const Tensor& packed, int dim, const std::vector<int64_t>& lens);

// ---- Mixture of experts (models/moe.h): router top-k, dispatch / combine, grouped GEMM ----
// N tokens, E experts, K experts per token, M = N*K routed rows (dropless; fewer with a capacity), C channels.
// Router scores: probs (N, E) in accum dtype (f32 for bf16 or f32 logits, f64 for f64) = softmax over each row
// of logits (N, E) (sigmoid: element-wise sigmoid, DeepSeek-V3). The K experts with the largest probs + bias
// (bias (E) accum dtype, or undefined: none; the aux-loss-free balancing bias only selects, it never weighs),
// largest first, ties to the lower index: experts (N, K) i32. weights (N, K) accum dtype = their probs,
// divided by the sum of the K when renormalize, then times scale (DeepSeek's routed_scaling_factor; 1).
// n_group > 1 (DeepSeek's group-limited routing): the E experts in n_group groups of consecutive experts, each
// scored by its largest probs + bias (sigmoid: the sum of its two largest); the topk_group best groups (ties to
// the lower group) keep probs + bias as the selection score, the other experts' score is 0 (transformers'
// masked_fill 0). Groups divide E, at most 64 of them and 1024 experts; k within the kept groups' experts.
void router_topk_forward(const Tensor& weights, const Tensor& experts, const Tensor& probs, const Tensor& logits,
                         const Tensor& bias, bool sigmoid, bool renormalize, double scale = 1.0, int64_t n_group = 1,
                         int64_t topk_group = 1);
// dlogits (N, E) (logits' dtype) overwritten: the chain rule through the weights' normalisation and the
// softmax (or sigmoid), from dweights (N, K) accum dtype and dprob_row (E) accum dtype or undefined: a gradient
// on probs that is the same for every row (the balance loss's, E * coef * counts / R^2).
void router_topk_backward(const Tensor& dlogits, const Tensor& dweights, const Tensor& dprob_row, const Tensor& probs,
                          const Tensor& weights, const Tensor& experts, bool sigmoid, bool renormalize,
                          double scale = 1.0);
// slot (N, K) i32: the routed row of token t's k-th expert (-1: dropped by a capacity), rows grouped by expert.
// dispatch: out (M, C) row slot[t,k] = inp (N, C) row t (rows no slot names are left as they are).
void moe_dispatch_forward(const Tensor& out, const Tensor& inp, const Tensor& slot);
// dinp (N, C) overwritten: row t = the sum over k of dout (M, C) row slot[t,k] (dropped slots add nothing).
void moe_dispatch_backward(const Tensor& dinp, const Tensor& dout, const Tensor& slot);
// combine: out (N, C) overwritten, row t = sum over k of weights[t,k] * inp (M, C) row slot[t,k], summed in accum
// dtype in k order and rounded once (weights (N, K) accum dtype).
void moe_combine_forward(const Tensor& out, const Tensor& inp, const Tensor& weights, const Tensor& slot);
// dinp (M, C) overwritten: row slot[t,k] = weights[t,k] * dout row t (rows no slot names: 0); dweights (N, K)
// accum dtype overwritten: the dot product of dout row t and inp row slot[t,k] (0 for a dropped slot).
void moe_combine_backward(const Tensor& dinp, const Tensor& dweights, const Tensor& dout, const Tensor& inp,
                          const Tensor& weights, const Tensor& slot);
// Grouped GEMM, every group in one call: rows are consecutive groups of counts[g] rows (host; sum = M), and
// group g's rows go through weight (G, OC, C) slice g: out (M, OC) rows of g = inp (M, C) rows of g @ weight[g]^T.
// A group of 0 rows is skipped.
void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight,
                            const std::vector<int64_t>& counts);
// dinp (M, C) overwritten (skipped if undefined); dweight (G, OC, C) += dout^T @ inp per group (accumulates like
// matmul_backward's; f32 with bf16 activations when dweight is f32).
void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const std::vector<int64_t>& counts);
// The same with the groups on the device: offsets (G + 1) i32 on inp's device, group g's rows [offsets[g],
// offsets[g+1]), offsets[0] = 0, non-decreasing, offsets[G] <= M (M, the buffer's rows, an upper bound: the
// host never reads the counts). One launch per call on CUDA. Rows past offsets[G]: out (forward) and dinp
// (backward) rows 0, never read as input; dweight += per group as above.
void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets);
void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& offsets);

// Routing on the device (no host read): from experts (N, K) i32 (router_topk_forward's, each in [0, E)), the
// routed rows grouped by expert in (t, k) order within an expert; an expert keeps its first `capacity` rows
// (capacity <= 0: all of them), the others are dropped (slot -1). Outputs, all i32 on experts' device:
// slot (N, K): each (t, k)'s row, offsets[e] + its place within e (padded: e * capacity + its place, the fixed
// blocks of expert parallel with a capacity); counts (E) kept rows; selected (E) rows before the capacity;
// offsets (E + 1) the groups' first rows (offsets[E] = the rows kept); dropped (1). Deterministic (no atomics).
void moe_route(const Tensor& slot, const Tensor& counts, const Tensor& selected, const Tensor& offsets,
               const Tensor& dropped, const Tensor& experts, int64_t capacity, bool padded = false);
// Expert parallel with a capacity: rows arrive in P blocks (one per source), each El blocks (local experts) of
// `capacity` rows of which counts (P, El) i32 [p, j] are real. order (P El capacity, 1) i32: each arrived row's
// row grouped by local expert (expert j's rows by source, then place), -1 for padding; offsets (El + 1) i32:
// the local experts' first rows. Deterministic.
void moe_unpad_order(const Tensor& order, const Tensor& offsets, const Tensor& counts, int64_t capacity);
// The router statistics of a micro-batch, stats (L E + E + 2) f64 on the device: counts (L, E), prob sums (E),
// rows, dropped (models/llama/moe.h). One sparse layer's record: counts row `layer` = selected (E) i32; prob sums
// = prob_sums (E) accum dtype widened (the micro-batch's running sum); rows += rows; dropped += dropped (1) i32.
void moe_stats_record(const Tensor& stats, const Tensor& selected, const Tensor& prob_sums, const Tensor& dropped,
                      int64_t layer, int64_t rows);
// Two micro-batch statistics buffers (as above) added, stats += in, both (n) f64 (under pipeline parallel a stage
// adds its chunk's to what arrived with the activation: runtime/train/pipeline.cpp).
void moe_stats_add(const Tensor& stats, const Tensor& in);
// The balance loss's gradient row on probs from summed statistics (stats as above, L layers): with R = rows and
// C_e = sum_l counts[l, e], row (E) accum dtype = w * coef * E * C_e / R^2 in f64, w = R / L * loss_scale
// (the micro-batch's weight); 0 when R is 0.
void moe_aux_grad_row(const Tensor& row, const Tensor& stats, int64_t L, double coef, double loss_scale);

// ---- AdamW, PyTorch semantics (torch.optim.AdamW, amsgrad off) ----
// param -= lr * weight_decay * param (decoupled, first); m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// param -= lr * (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps). step is 1-based.
// param, grad, m, v share shape; m and v are f32 (or f64 with f64 params). param is the master copy
// (f32 or f64); if param_lowp (bf16, the compute copy) is defined it gets the updated values rounded,
// in the same pass on CUDA. hyper (CUDA only, a CUDA graph's step: runtime/train/cuda_graph.h): 4 f32 values on the
// device, read when the kernel runs instead of lr, weight_decay and step: {1 - lr weight_decay, lr / (1-b1^step),
// sqrt(1-b2^step), c}, the gradient multiplied by c first (clip_grads' scale, 1 for none): the same bits as
// clip_grads then adamw_step with those scalars.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, double lr, double beta1,
                double beta2, double eps, double weight_decay, int64_t step, const Tensor& param_lowp = Tensor(),
                const Tensor& hyper = Tensor());

// Threads used by the CPU kernels (OpenMP and Eigen); 0 = all cores.
void set_cpu_threads(int n);
int cpu_threads();

}  // namespace mt
