// The implementations behind the attention boundary (attention.h): local,
// ring/all_gather over cp_ring, and Ulysses over cp_ulysses around either.
#include "attention/attention.h"

#include <algorithm>

#include "comm/comm_counters.h"
#include "parallel/parallel_dims.h"
#include "runtime/core/error.h"
#include "runtime/kernels/ops.h"

namespace mt {

namespace {

Tensor new_lse(const Tensor& q) {  // (B, H, T) in the accum dtype
  return empty({q.size(0), q.size(2), q.size(1)}, accum_dtype(q.dtype()), q.device());
}

// Whole sequences on this rank: one call of the local kernel.
class LocalAttention final : public Attention {
 public:
  std::string describe() const override { return "local (whole sequences on each rank)"; }
  bool splits_sequence() const override { return false; }
  Tensor forward(AttentionSaved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                 const AttentionCall& c) const override {
    Tensor out = empty(q.shape(), q.dtype(), q.device()), lse = new_lse(q);  // (B, T, H, hd), (B, H, T)
    attention_forward(out, lse, q, k, v, options(c, q));
    s = {q, k, v, out, lse};
    return out;
  }
  void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const AttentionSaved& s,
                const AttentionCall& c) const override {
    attention_backward(dq, dk, dv, dout, s.q, s.k, s.v, s.out, s.lse, options(c, s.q));
  }
  void resave_inputs(AttentionSaved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttentionCall&) const override {
    s.q = q, s.k = k, s.v = v;
  }
  Tensor lse(const AttentionSaved& s) const override { return s.lse; }

 private:
  static AttentionOptions options(const AttentionCall& c, const Tensor& q) {
    if (c.doc_start.defined())
      MT_CHECK(c.doc_start.shape() == (Shape{q.size(0), q.size(1)}), "attention",
               "local attention: doc_start {} does not match q {} (B, T, H, hd)", shape_str(c.doc_start.shape()),
               shape_str(q.shape()));
    return AttentionOptions{c.causal, c.scale,  0, 0, c.doc_start.defined() ? c.doc_start.to(q.device()) : Tensor(),
                            c.window, c.softcap};
  }
};

// This rank's part of each sequence over cp_ring (ring_attention.h).
class RingAttention final : public Attention {
 public:
  explicit RingAttention(const ContextParallel& cp) : cp_(cp) {}
  std::string describe() const override {
    return fmt::format("{} over {} ({} ranks, {})", cp_method_name(cp_.method), cp_.ring->name(), cp_.ring->size(),
                       cp_load_balance_name(cp_.load_balance));
  }
  Tensor forward(AttentionSaved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                 const AttentionCall& c) const override {
    Tensor out = empty(q.shape(), q.dtype(), q.device()), lse = new_lse(q);
    ring_attention_forward(out, lse, q, k, v, options(c));
    s = {q, k, v, out, lse};
    return out;
  }
  void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const AttentionSaved& s,
                const AttentionCall& c) const override {
    ring_attention_backward(dq, dk, dv, dout, s.q, s.k, s.v, s.out, s.lse, options(c));
  }
  void resave_inputs(AttentionSaved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttentionCall&) const override {
    s.q = q, s.k = k, s.v = v;
  }
  Tensor lse(const AttentionSaved& s) const override { return s.lse; }

 private:
  RingAttentionOptions options(const AttentionCall& c) const {
    RingAttentionOptions o;
    o.causal = c.causal, o.scale = c.scale, o.group = cp_.ring, o.method = cp_.method;
    o.window = c.window, o.softcap = c.softcap;
    o.load_balance = cp_.load_balance, o.seq_len = cp_.seq_len;
    if (c.doc_start.defined()) {
      // This rank's columns of the whole sequences' document starts, kept for the batch.
      if (!doc_.defined() || doc_batch_ != c.batch || doc_src_.data_ptr() != c.doc_start.data_ptr()) {
        MT_CHECK(c.doc_start.size(1) == cp_.seq_len, "attention",
                 "ring attention: doc_start {} is not (B, T) with T = {} (the whole sequence)",
                 shape_str(c.doc_start.shape()), cp_.seq_len);
        doc_ = shard_sequence(c.doc_start, sequence_shard(cp_.load_balance, cp_.seq_len, cp_.ring->size(),
                                                          cp_.ring->rank()));
        doc_batch_ = c.batch, doc_src_ = c.doc_start;
      }
      o.doc_start = doc_;
    }
    return o;
  }
  ContextParallel cp_;
  mutable Tensor doc_, doc_src_;
  mutable uint64_t doc_batch_ = 0;
};

// Ulysses over cp_ulysses around an inner implementation (local, or ring over cp_ring).
class UlyssesAttention final : public Attention {
 public:
  UlyssesAttention(const ContextParallel& cp, std::shared_ptr<const Attention> inner)
      : cp_(cp), inner_(std::move(inner)) {}
  std::string describe() const override {
    return fmt::format("alltoall (Ulysses) over {} ({} ranks) around {}", cp_.ulysses->name(), cp_.ulysses->size(),
                       inner_->describe());
  }

  Tensor forward(AttentionSaved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                 const AttentionCall& c) const override {
    const Split x = split("ulysses attention forward", q, k);
    std::vector<Tensor> h = to_heads(x, {q, k, v});  // (B, U Tu, Hu, hd), (B, U Tu, KVu, hd) x2
    Tensor outh = inner_->forward(s, h[0], h[1], h[2], c);
    Tensor out = empty(q.shape(), q.dtype(), q.device());  // (B, Tu, H, hd)
    to_tokens(x, {outh}, {out});
    return out;
  }

  void backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const AttentionSaved& s,
                const AttentionCall& c) const override {
    const Split x = split("ulysses attention backward", dq, dk);
    Tensor douth = to_heads(x, {dout})[0];  // (B, U Tu, Hu, hd)
    Tensor dqh = empty(s.q.shape(), dq.dtype(), dq.device());
    Tensor dkh = empty(s.k.shape(), dk.dtype(), dk.device()), dvh = empty(s.v.shape(), dv.dtype(), dv.device());
    inner_->backward(dqh, dkh, dvh, douth, s, c);
    to_tokens(x, {dqh, dkh, dvh}, {dq, dk, dv});
  }

  void resave_inputs(AttentionSaved& s, const Tensor& q, const Tensor& k, const Tensor& v,
                     const AttentionCall& c) const override {
    std::vector<Tensor> h = to_heads(split("ulysses attention (recompute)", q, k), {q, k, v});
    inner_->resave_inputs(s, h[0], h[1], h[2], c);
  }

  Tensor lse(const AttentionSaved& s) const override {
    // (B, Hu, U Tu) -> (B, H, Tu): block i of the send buffer is rank i's tokens, block j received rank j's heads.
    Tensor lh = inner_->lse(s);
    const int u = cp_.ulysses->size();
    const int64_t B = lh.size(0), Hu = lh.size(1), Tu = lh.size(2) / u;
    Tensor send = empty({lh.numel()}, lh.dtype(), lh.device()), recv = empty({lh.numel()}, lh.dtype(), lh.device());
    const int64_t per = B * Hu * Tu;
    for (int i = 0; i < u; ++i) copy_slice(send.view(i * per, {B, Hu, Tu}), 0, lh, i * Tu, Tu, 2);
    {
      CommTag tag(kCpA2aTag);
      cp_.ulysses->all_to_all(recv, send);
    }
    Tensor out = empty({B, Hu * u, Tu}, lh.dtype(), lh.device());
    for (int j = 0; j < u; ++j) copy_slice(out, j * Hu, recv.view(j * per, {B, Hu, Tu}), 0, Hu, 1);
    return out;
  }

 private:
  // The sizes of one exchange. Rank j of U gets q heads [j Hu, (j+1) Hu) and kv heads [kv_lo(j), kv_lo(j) + KVu).
  struct Split {
    int u = 1;
    int64_t B = 0, Tu = 0, H = 0, KV = 0, hd = 0, Hu = 0, KVu = 0;
    int64_t lo(int j, bool kv) const { return kv ? int64_t(j) * KV / u : int64_t(j) * Hu; }
  };

  Split split(const char* op, const Tensor& q, const Tensor& k) const {
    Split x;
    x.u = cp_.ulysses->size();
    x.B = q.size(0), x.Tu = q.size(1), x.H = q.size(2), x.KV = k.size(2), x.hd = q.size(3);
    MT_CHECK(x.H % x.u == 0 && (x.KV % x.u == 0 || x.u % x.KV == 0), "attention",
             "{}: {} q heads and {} kv heads on this rank do not split over the {} ranks of {} (q heads must divide; "
             "kv heads must be a multiple or a divisor of the degree)",
             op, x.H, x.KV, x.u, cp_.ulysses->name());
    x.Hu = x.H / x.u, x.KVu = std::max<int64_t>(1, x.KV / x.u);
    return x;
  }

  // Sequence-sharded (B, Tu, X, hd) tensors (X = H for the first, KV for the others) -> head-sharded
  // (B, U Tu, Hu or KVu, hd), in one all-to-all.
  std::vector<Tensor> to_heads(const Split& x, const std::vector<Tensor>& parts) const {
    std::vector<int64_t> n;  // heads per destination of each part
    int64_t per = 0;         // elements per destination
    for (size_t i = 0; i < parts.size(); ++i) {
      n.push_back(i == 0 ? x.Hu : x.KVu);
      per += x.B * x.Tu * n.back() * x.hd;
    }
    const Tensor& t0 = parts[0];
    Tensor send = empty({x.u * per}, t0.dtype(), t0.device()), recv = empty({x.u * per}, t0.dtype(), t0.device());
    for (int j = 0; j < x.u; ++j) {
      int64_t off = j * per;
      for (size_t i = 0; i < parts.size(); ++i) {
        copy_slice(send.view(off, {x.B, x.Tu, n[i], x.hd}), 0, parts[i], x.lo(j, i > 0), n[i], 2);
        off += x.B * x.Tu * n[i] * x.hd;
      }
    }
    {
      CommTag tag(kCpA2aTag);
      cp_.ulysses->all_to_all(recv, send);
    }
    std::vector<Tensor> out;
    for (size_t i = 0; i < parts.size(); ++i) out.push_back(empty({x.B, x.u * x.Tu, n[i], x.hd}, t0.dtype(), t0.device()));
    for (int src = 0; src < x.u; ++src) {  // rank src's tokens, in rank order: the ring part's local order
      int64_t off = src * per;
      for (size_t i = 0; i < parts.size(); ++i) {
        copy_slice(out[i], src * x.Tu, recv.view(off, {x.B, x.Tu, n[i], x.hd}), 0, x.Tu, 1);
        off += x.B * x.Tu * n[i] * x.hd;
      }
    }
    return out;
  }

  // Head-sharded (B, U Tu, Hu or KVu, hd) -> sequence-sharded dst (B, Tu, H or KV, hd), in one all-to-all.
  // A kv head shared by several ranks (KV < U) gets the sum of their parts.
  void to_tokens(const Split& x, const std::vector<Tensor>& parts, const std::vector<Tensor>& dst) const {
    std::vector<int64_t> n;
    int64_t per = 0;
    for (auto& p : parts) {
      n.push_back(p.size(2));
      per += x.B * x.Tu * n.back() * x.hd;
    }
    const Tensor& t0 = parts[0];
    Tensor send = empty({x.u * per}, t0.dtype(), t0.device()), recv = empty({x.u * per}, t0.dtype(), t0.device());
    for (int j = 0; j < x.u; ++j) {  // rank j's tokens of my heads
      int64_t off = j * per;
      for (size_t i = 0; i < parts.size(); ++i) {
        copy_slice(send.view(off, {x.B, x.Tu, n[i], x.hd}), 0, parts[i], j * x.Tu, x.Tu, 1);
        off += x.B * x.Tu * n[i] * x.hd;
      }
    }
    {
      CommTag tag(kCpA2aTag);
      cp_.ulysses->all_to_all(recv, send);
    }
    auto block = [&](int src, size_t i) {  // what rank src sent of part i: (B, Tu, n_i, hd), its heads of my tokens
      int64_t off = src * per;
      for (size_t p = 0; p < i; ++p) off += x.B * x.Tu * n[p] * x.hd;
      return recv.view(off, {x.B, x.Tu, n[i], x.hd});
    };
    for (size_t i = 0; i < parts.size(); ++i) {
      const bool kv = i > 0;
      if (!kv || x.KV >= x.u) {
        for (int src = 0; src < x.u; ++src) copy_slice(dst[i], x.lo(src, kv), block(src, i), 0, n[i], 2);
        continue;
      }
      // KV < U: ranks [h U/KV, (h+1) U/KV) all hold kv head h; their gradients add up (in the accum dtype).
      const int share = x.u / int(x.KV);
      const DType acc = accum_dtype(t0.dtype());
      for (int64_t h = 0; h < x.KV; ++h) {
        Tensor sum = zeros({x.B, x.Tu, 1, x.hd}, acc, t0.device());
        for (int src = int(h) * share; src < int(h + 1) * share; ++src) {
          Tensor b = block(src, i);
          if (b.dtype() != acc) {
            Tensor w = empty(b.shape(), acc, b.device());
            convert(w, b);
            b = w;
          }
          add_(sum, b);
        }
        if (acc != dst[i].dtype()) {
          Tensor w = empty(sum.shape(), dst[i].dtype(), sum.device());
          convert(w, sum);
          sum = w;
        }
        copy_slice(dst[i], h, sum, 0, 1, 2);
      }
    }
  }

  ContextParallel cp_;
  std::shared_ptr<const Attention> inner_;
};

}  // namespace

std::string slow_attention_warning(const Device& device, DType dtype, int64_t head_dim) {
  if (!device.is_cuda() || dtype != DType::bf16 || head_dim == 64 || head_dim == 128) return "";
  return fmt::format(
      "training.dtype = bf16 with head dim {}: the tensor-core attention kernel takes 64 or 128, so attention runs "
      "the slow fp32 reference kernel",
      head_dim);
}

std::shared_ptr<const Attention> make_attention(const ContextParallel& cp) {
  std::shared_ptr<const Attention> inner;
  if (cp.ring_size() > 1) {
    MT_CHECK(cp.seq_len > 0, "attention", "ring attention needs the global sequence length (ContextParallel::seq_len)");
    inner = std::make_shared<RingAttention>(cp);
  } else {
    inner = std::make_shared<LocalAttention>();
  }
  if (cp.ulysses_size() > 1) return std::make_shared<UlyssesAttention>(cp, inner);
  return inner;
}

CpLayerBytes ulysses_layer_bytes(int u, int64_t B, int64_t T_u, int64_t H, int64_t KV, int64_t hd, double elem) {
  CpLayerBytes b;
  if (u <= 1) return b;
  const double kvu = double(std::max<int64_t>(1, KV / u));
  const double per_dest = double(B * T_u * hd) * (2.0 * double(H / u) + 2.0 * kvu) * elem;
  b.forward = b.backward = double(u - 1) * per_dest;
  return b;
}

CpBytes cp_bytes(CpMethod method, int ring, int ulysses, const AttentionShape& s) {
  CpBytes b;
  b.ulysses = ulysses_layer_bytes(ulysses, s.B, s.T, s.H, s.KV, s.hd, s.elem);
  if (ring > 1) {
    // The ring moves the K/V of the ring part (B, T x U, KV_u, hd): Ulysses gathered its sequence first.
    b.kv_heads = std::max<int64_t>(1, s.KV / ulysses);
    const double kv_elems = 2.0 * double(s.B * s.T * ulysses * b.kv_heads * s.hd);
    b.kv = kv_elems * s.elem, b.dkv = kv_elems * s.accum;
    b.ring = cp_layer_bytes(method, ring, b.kv, b.dkv);
  }
  return b;
}

std::vector<CommBytes> cp_step_bytes(CpMethod method, int ring, int ulysses, const AttentionShape& s,
                                     int64_t layer_calls) {
  const CpBytes b = cp_bytes(method, ring, ulysses, s);
  const double n = double(layer_calls);
  std::vector<CommBytes> out;
  // Per layer and direction two all-to-alls (q, k, v to heads; the output back).
  if (ulysses > 1)
    out.push_back({kCpA2aTag, dim::cp_ulysses, "all_to_all", n * (b.ulysses.forward + b.ulysses.backward),
                   4 * layer_calls, false});
  if (ring <= 1) return out;
  // K/V go around (or are gathered) in forward and again in backward; dK/dV come back.
  if (method == CpMethod::ring) {
    out.push_back({kCpKvTag, dim::cp_ring, "ring_shift", n * 2 * b.ring.forward, 2 * layer_calls * (ring - 1), true});
    out.push_back({kCpDkvTag, dim::cp_ring, "ring_shift", n * (b.ring.backward - b.ring.forward),
                   layer_calls * b.ring.dkv_moves, true});
  } else {
    out.push_back({kCpKvTag, dim::cp_ring, "all_gather", n * 2 * b.ring.forward, 2 * layer_calls, false});
    out.push_back(
        {kCpDkvTag, dim::cp_ring, "reduce_scatter", n * (b.ring.backward - b.ring.forward), layer_calls, false});
  }
  return out;
}

}  // namespace mt
