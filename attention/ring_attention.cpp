// Ring attention (see ring_attention.h for the rules). Buffers are kept
// chunk-major, (m, B, c, X, hd) with m = 1 or 2 chunks per rank of c tokens,
// so that every (query chunk, key chunk) pair is a pair of contiguous tensors
// the local attention kernel takes as they are; K and V travel together in one
// (2, m, B, c, KV, hd) buffer, one message per ring step.
#include "attention/ring_attention.h"

#include "comm/comm_counters.h"

#include <limits>
#include <tuple>
#include <mutex>
#include <map>
#include <utility>

#include "parallel/dtensor.h"
#include "runtime/core/error.h"
#include "runtime/kernels/ops.h"

namespace mt {

namespace {

struct Ring {
  int n = 1, rank = 0;
  int64_t B = 0, Tl = 0, H = 0, KV = 0, hd = 0;
  int64_t m = 1, c = 0;  // chunks per rank and their length
  DType dt = DType::f32, acc = DType::f32;
  Device dev;
  SequenceShard mine;
  int64_t q_numel() const { return B * c * H * hd; }       // one query chunk
  int64_t kv_numel() const { return B * c * KV * hd; }     // one key (or value) chunk
  int64_t kv_block() const { return 2 * m * kv_numel(); }  // a rank's K and V
};

Ring setup(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const RingAttentionOptions& opt) {
  Ring r;
  MT_CHECK(q.dim() == 4 && k.dim() == 4 && k.shape() == v.shape() && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
               k.size(3) == q.size(3),
           "attention", "{}: q (B, T, H, hd) {} and k, v (B, T, KV, hd) {} {} do not match", op, shape_str(q.shape()),
           shape_str(k.shape()), shape_str(v.shape()));
  r.n = opt.group ? opt.group->size() : 1;
  r.rank = opt.group ? opt.group->rank() : 0;
  r.B = q.size(0), r.Tl = q.size(1), r.H = q.size(2), r.KV = k.size(2), r.hd = q.size(3);
  r.mine = sequence_shard(opt.load_balance, opt.seq_len, r.n, r.rank);
  MT_CHECK(r.mine.size() == r.Tl, "attention",
           "{}: q holds {} tokens, but a sequence of {} over {} cp ranks ({}) "
           "gives each rank {}",
           op, r.Tl, opt.seq_len, r.n, cp_load_balance_name(opt.load_balance), r.mine.size());
  r.m = int64_t(r.mine.chunk_pos.size()), r.c = r.mine.chunk_len;
  r.dt = q.dtype(), r.acc = accum_dtype(q.dtype()), r.dev = q.device();
  if (opt.doc_start.defined())
    MT_CHECK(opt.doc_start.shape() == (Shape{r.B, r.Tl}) && opt.doc_start.dtype() == DType::i64 &&
                 !opt.doc_start.device().is_cuda(),
             "attention", "{}: doc_start must be (B, T_local) = {} i64 on the host, got {} {}", op,
             shape_str({r.B, r.Tl}), shape_str(opt.doc_start.shape()), dtype_name(opt.doc_start.dtype()));
  return r;
}

// x (B, Tl, X, hd) -> chunk i as (B, c, X, hd), written into dst (contiguous).
void take_chunk(const Tensor& dst, const Tensor& x, const Ring& r, int64_t i) {
  copy_slice(dst, 0, x, i * r.c, r.c, 1);
}
// The chunk-major copy of x: (m, B, c, X, hd) flattened; with one chunk it is x itself.
Tensor chunk_major(const Tensor& x, const Ring& r) {
  if (r.m == 1) return x.reshape({-1});
  Tensor out = empty({x.numel()}, x.dtype(), x.device());
  const int64_t per = x.numel() / r.m;
  for (int64_t i = 0; i < r.m; ++i) take_chunk(out.view(i * per, {r.B, r.c, x.size(2), x.size(3)}), x, r, i);
  return out;
}
// Chunk i of a chunk-major buffer of (B, c, X, hd) chunks.
Tensor chunk(const Tensor& flat, int64_t i, int64_t X, const Ring& r) {
  const int64_t per = r.B * r.c * X * r.hd;
  return flat.view(i * per, {r.B, r.c, X, r.hd});
}
// The inverse of chunk_major into x (B, Tl, X, hd), converting dtype if needed.
void from_chunk_major(const Tensor& x, const Tensor& flat, int64_t X, const Ring& r) {
  for (int64_t i = 0; i < r.m; ++i) {
    Tensor part = chunk(flat, i, X, r);
    if (part.dtype() != x.dtype()) {
      Tensor t = empty(part.shape(), x.dtype(), x.device());
      convert(t, part);
      part = t;
    }
    copy_slice(x, i * r.c, part, 0, r.c, 1);
  }
}

// This rank's K and V as one chunk-major block, (2, m, B, c, KV, hd) flattened: one message per ring step.
Tensor pack_kv(const Tensor& k, const Tensor& v, const Ring& r) {
  const int64_t half = r.m * r.kv_numel();
  Tensor kv = empty({r.kv_block()}, r.dt, r.dev);
  copy_slice(kv.view(0, {half}), 0, chunk_major(k, r), 0, half, 0);
  copy_slice(kv.view(half, {half}), 0, chunk_major(v, r), 0, half, 0);
  return kv;
}

// n values of -inf in dtype on dev, made on first use and kept (per size, dtype and device): a device copy starts
// each call's running log-sum-exp, so no call uploads from the host (a CUDA graph's capture cannot hold one).
const Tensor& minus_infinity(int64_t n, DType dt, Device dev) {
  static std::mutex mu;
  static std::map<std::tuple<int64_t, int, std::string>, Tensor> made;
  std::lock_guard lock(mu);
  Tensor& t = made[{n, int(dt), dev.str()}];
  if (!t.defined())
    t = from_values(std::vector<double>(size_t(n), -std::numeric_limits<double>::infinity()), {n}, dt).to(dev);
  return t;
}

// The document starts of each query chunk, (B, c) i64 on the device of the kernels.
std::vector<Tensor> doc_chunks(const RingAttentionOptions& opt, const Ring& r, std::vector<Tensor>* host) {
  std::vector<Tensor> out;
  if (!opt.doc_start.defined()) return out;
  for (int64_t i = 0; i < r.m; ++i) {
    Tensor h = empty({r.B, r.c}, DType::i64);
    copy_slice(h, 0, opt.doc_start, i * r.c, r.c, 1);
    if (host) host->push_back(h);
    out.push_back(r.dev.is_cuda() ? h.to(r.dev) : h);
  }
  return out;
}

// Whether any query of the chunk at q0 sees any key of the chunk at k0 (both c long).
bool pair_visible(int64_t q0, int64_t k0, int64_t c, bool causal, int64_t window,
                  const Tensor& docs /* (B, c) host or undefined */) {
  if (causal && k0 > q0 + c - 1) return false;                  // every key after every query
  if (window > 0 && q0 - (k0 + c - 1) >= window) return false;  // every key before every query's window
  if (!docs.defined()) return true;
  // Document starts grow along the sequence, so the first query that may see the chunk has the smallest start.
  const int64_t t = causal ? std::max<int64_t>(0, k0 - q0) : 0, B = docs.size(0);
  for (int64_t b = 0; b < B; ++b)
    if (docs.at<int64_t>(b * c + t) <= k0 + c - 1) return true;
  return false;
}

AttentionOptions pair_options(const RingAttentionOptions& opt, int64_t q0, int64_t k0, const std::vector<Tensor>& docs,
                              int64_t i) {
  AttentionOptions a;
  a.causal = opt.causal, a.scale = opt.scale, a.q_pos0 = q0, a.k_pos0 = k0;
  a.window = opt.window, a.softcap = opt.softcap;
  if (!docs.empty()) a.doc_start = docs[size_t(i)];
  return a;
}

// Calls f(i, j, kj, vj, options) for each pair of this rank's query chunk i and chunk j of the K/V block from rank
// src that has a query seeing a key: the pairs the forward and the backward visit alike.
template <class F>
void for_visible_pairs(const Ring& r, const RingAttentionOptions& opt, int src, const Tensor& block,
                       const std::vector<Tensor>& docs, const std::vector<Tensor>& docs_host, F&& f) {
  const SequenceShard theirs = sequence_shard(opt.load_balance, opt.seq_len, r.n, src);
  for (int64_t i = 0; i < r.m; ++i)
    for (int64_t j = 0; j < r.m; ++j) {
      const int64_t q0 = r.mine.chunk_pos[size_t(i)], k0 = theirs.chunk_pos[size_t(j)];
      if (!pair_visible(q0, k0, r.c, opt.causal, opt.window, docs_host.empty() ? Tensor() : docs_host[size_t(i)]))
        continue;
      Tensor kj = chunk(block, j, r.KV, r), vj = chunk(block, r.m + j, r.KV, r);
      f(i, j, kj, vj, pair_options(opt, q0, k0, docs, i));
    }
}

// dst (accum dtype) += part (activation dtype).
void accumulate(const Tensor& dst, const Tensor& part) {
  if (dst.dtype() == part.dtype()) return add_(dst, part);
  Tensor t = empty(part.shape(), dst.dtype(), part.device());
  convert(t, part);
  add_(dst, t);
}

bool local_only(const RingAttentionOptions& opt) { return !opt.group || opt.group->size() == 1; }

// The local kernel's options when this rank holds whole sequences.
AttentionOptions whole_sequence_options(const RingAttentionOptions& opt, const Ring& r) {
  return AttentionOptions{opt.causal, opt.scale,  0, 0, opt.doc_start.defined() ? opt.doc_start.to(r.dev) : Tensor(),
                          opt.window, opt.softcap};
}

// ---- the backward's steps

// The forward's tensors the backward reads, chunk-major: one (B, c, X, hd) chunk per query chunk, and each
// query chunk's document starts and log-sum-exp.
struct BackwardInputs {
  std::vector<Tensor> docs_host, docs;
  Tensor qc, oc, doc_;        // (m, B, c, H, hd)
  std::vector<Tensor> lse_c;  // (B, H, c) per query chunk
};

BackwardInputs backward_inputs(const RingAttentionOptions& opt, const Ring& r, const Tensor& dout, const Tensor& q,
                               const Tensor& out, const Tensor& lse) {
  BackwardInputs in;
  in.docs = doc_chunks(opt, r, &in.docs_host);
  in.qc = chunk_major(q, r), in.oc = chunk_major(out, r), in.doc_ = chunk_major(dout, r);
  for (int64_t i = 0; i < r.m; ++i) {
    Tensor l = empty({r.B, r.H, r.c}, lse.dtype(), r.dev);
    copy_slice(l, 0, lse, i * r.c, r.c, 2);
    in.lse_c.push_back(l);
  }
  return in;
}

// The K/V blocks the steps visit, the gradient accumulators and the local kernel's outputs for one pair, all
// allocated before the first step.
struct BackwardBuffers {
  Tensor cur, next;         // ring: the K/V block visited now, and the one arriving
  Tensor gathered, dkv_all;  // all_gather: every rank's K/V block, and the contributions to every rank's dK/dV
  Tensor dq_acc, dq_part, dk_part, dv_part;
  // ring: the dK/dV accumulator of the block being visited travels with it; contrib is this rank's part.
  Tensor contrib, travelling, arriving;
  Work dkv_shift;
};

BackwardBuffers backward_buffers(const RingAttentionOptions& opt, const Ring& r, const Tensor& kv) {
  BackwardBuffers b;
  if (opt.method == CpMethod::all_gather) {
    b.gathered = empty({r.n * r.kv_block()}, r.dt, r.dev);
    opt.group->all_gather(b.gathered, kv);
    b.dkv_all = zeros({r.n * r.kv_block()}, r.acc, r.dev);  // in rank order
  } else {
    b.next = empty({r.kv_block()}, r.dt, r.dev);
  }
  b.dq_acc = zeros({r.m * r.q_numel()}, r.acc, r.dev);
  b.dq_part = empty({r.B, r.c, r.H, r.hd}, r.dt, r.dev);
  b.dk_part = empty({r.B, r.c, r.KV, r.hd}, r.dt, r.dev), b.dv_part = empty(b.dk_part.shape(), r.dt, r.dev);
  if (opt.method == CpMethod::ring) {
    b.contrib = empty({r.kv_block()}, r.acc, r.dev);
    b.arriving = empty({r.kv_block()}, r.acc, r.dev);
  }
  b.cur = kv;
  return b;
}

// ring: adds what arrived for the block just visited (its earlier visitors' parts) and passes it on; after n
// shifts the accumulator of every block is back with its owner.
void pass_dkv_on(const RingAttentionOptions& opt, const Ring& r, BackwardBuffers& b, int s) {
  if (s > 0) {
    b.dkv_shift.wait();
    add_(b.contrib, b.arriving);
  }
  std::swap(b.travelling, b.contrib);  // travelling: what we send now; contrib: a free buffer for the next step
  if (!b.contrib.defined()) b.contrib = empty({r.kv_block()}, r.acc, r.dev);
  CommTag dkv_tag(kCpDkvTag);
  b.dkv_shift = opt.group->ring_shift(b.arriving, b.travelling, 1, /*async=*/true);
}

// Step s: the K/V block of rank src against every query chunk here; dQ accumulates here, dK and dV in the block's
// accumulator (ring: passed on; all_gather: src's slot, reduce-scattered at the end).
void backward_step(const RingAttentionOptions& opt, const Ring& r, const BackwardInputs& in, BackwardBuffers& b,
                   int s) {
  const int src = ((r.rank - s) % r.n + r.n) % r.n;
  const bool ring = opt.method == CpMethod::ring;
  Tensor block = ring ? b.cur : b.gathered.view(int64_t(src) * r.kv_block(), {r.kv_block()});
  Tensor dblock = ring ? b.contrib : b.dkv_all.view(int64_t(src) * r.kv_block(), {r.kv_block()});
  Work shift;
  if (ring) {
    if (s + 1 < r.n) shift = opt.group->ring_shift(b.next, b.cur, 1, /*async=*/true);
    fill_zero_(b.contrib);
  }
  for_visible_pairs(r, opt, src, block, in.docs, in.docs_host,
                    [&](int64_t i, int64_t j, const Tensor& kj, const Tensor& vj, const AttentionOptions& o) {
                      attention_backward(b.dq_part, b.dk_part, b.dv_part, chunk(in.doc_, i, r.H, r),
                                         chunk(in.qc, i, r.H, r), kj, vj, chunk(in.oc, i, r.H, r),
                                         in.lse_c[size_t(i)], o);
                      accumulate(chunk(b.dq_acc, i, r.H, r), b.dq_part);
                      accumulate(chunk(dblock, j, r.KV, r), b.dk_part);
                      accumulate(chunk(dblock, r.m + j, r.KV, r), b.dv_part);
                    });
  if (!ring) return;
  pass_dkv_on(opt, r, b, s);
  if (s + 1 < r.n) {
    shift.wait();
    std::swap(b.cur, b.next);
  }
}

// dQ, and this rank's dK and dV once every rank's part is in: the last arrival (ring) or a reduce-scatter.
void finish_backward(const RingAttentionOptions& opt, const Ring& r, BackwardBuffers& b, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv) {
  Tensor mine_dkv;
  if (opt.method == CpMethod::ring) {
    b.dkv_shift.wait();
    mine_dkv = b.arriving;
  } else {
    mine_dkv = empty({r.kv_block()}, r.acc, r.dev);
    CommTag dkv_tag(kCpDkvTag);
    opt.group->reduce_scatter(mine_dkv, b.dkv_all, ReduceOp::sum);
  }
  from_chunk_major(dq, b.dq_acc, r.H, r);
  from_chunk_major(dk, mine_dkv.view(0, {r.m * r.kv_numel()}), r.KV, r);
  from_chunk_major(dv, mine_dkv.view(r.m * r.kv_numel(), {r.m * r.kv_numel()}), r.KV, r);
}

// A window's backward (window_direct): this rank's block, then each needed distance s: the block of rank - s
// arrives straight (ring_shift by s), its dK/dV part goes straight back (by n - s) while the part this rank's block
// got from rank + s arrives and is added.
void window_backward(const RingAttentionOptions& opt, const Ring& r, const BackwardInputs& in, const Tensor& kv,
                     const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  std::vector<int> steps = {0};
  for (int s : ring_window_distances(opt.load_balance, opt.seq_len, r.n, opt.window)) steps.push_back(s);
  Tensor bufs[2] = {empty({r.kv_block()}, r.dt, r.dev), empty({r.kv_block()}, r.dt, r.dev)};
  Tensor mine = zeros({r.kv_block()}, r.acc, r.dev);  // (2, m, B, c, KV, hd) this block's dK/dV, summed
  Tensor contrib = empty({r.kv_block()}, r.acc, r.dev), arriving = empty({r.kv_block()}, r.acc, r.dev);
  Tensor dq_acc = zeros({r.m * r.q_numel()}, r.acc, r.dev);
  Tensor dq_part = empty({r.B, r.c, r.H, r.hd}, r.dt, r.dev);
  Tensor dk_part = empty({r.B, r.c, r.KV, r.hd}, r.dt, r.dev), dv_part = empty(dk_part.shape(), r.dt, r.dev);
  for (size_t a = 0; a < steps.size(); ++a) {
    const int s = steps[a], src = ((r.rank - s) % r.n + r.n) % r.n;
    Work shift;
    if (a + 1 < steps.size()) shift = opt.group->ring_shift(bufs[(a + 1) % 2], kv, steps[a + 1], /*async=*/true);
    const Tensor& dblock = a == 0 ? mine : contrib;
    if (a > 0) fill_zero_(contrib);
    for_visible_pairs(r, opt, src, a == 0 ? kv : bufs[a % 2], in.docs, in.docs_host,
                      [&](int64_t i, int64_t j, const Tensor& kj, const Tensor& vj, const AttentionOptions& o) {
                        attention_backward(dq_part, dk_part, dv_part, chunk(in.doc_, i, r.H, r),
                                           chunk(in.qc, i, r.H, r), kj, vj, chunk(in.oc, i, r.H, r),
                                           in.lse_c[size_t(i)], o);
                        accumulate(chunk(dq_acc, i, r.H, r), dq_part);
                        accumulate(chunk(dblock, j, r.KV, r), dk_part);
                        accumulate(chunk(dblock, r.m + j, r.KV, r), dv_part);
                      });
    if (a + 1 < steps.size()) shift.wait();  // before the dK/dV part leaves: one message at a time per peer
    if (a > 0) {
      CommTag dkv_tag(kCpDkvTag);
      opt.group->ring_shift(arriving, contrib, r.n - s);
      add_(mine, arriving);
    }
  }
  from_chunk_major(dq, dq_acc, r.H, r);
  from_chunk_major(dk, mine.view(0, {r.m * r.kv_numel()}), r.KV, r);
  from_chunk_major(dv, mine.view(r.m * r.kv_numel(), {r.m * r.kv_numel()}), r.KV, r);
}

}  // namespace

void ring_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                            const RingAttentionOptions& opt) {
  const Ring r = setup("ring_attention_forward", q, k, v, opt);
  if (local_only(opt) && r.m == 1)  // the whole sequence here: one call of the local kernel
    return attention_forward(out, lse, q, k, v, whole_sequence_options(opt, r));
  std::vector<Tensor> docs_host, docs = doc_chunks(opt, r, &docs_host);
  Tensor qc = chunk_major(q, r);  // (m, B, c, H, hd)
  Tensor kv = pack_kv(k, v, r);   // (2, m, B, c, KV, hd)
  CommTag tag(kCpKvTag);

  Tensor gathered, next;
  if (opt.method == CpMethod::all_gather) {
    gathered = empty({r.n * r.kv_block()}, r.dt, r.dev);  // every rank's block, in rank order
    opt.group->all_gather(gathered, kv);
  } else {
    next = empty({r.kv_block()}, r.dt, r.dev);
  }
  // Running results per query chunk in the accum dtype: nothing seen yet (lse -inf).
  Tensor out_acc = zeros({r.m * r.q_numel()}, r.acc, r.dev);
  Tensor lse_acc = empty({r.m * r.B * r.H * r.c}, r.acc, r.dev);
  copy_(lse_acc, minus_infinity(lse_acc.numel(), r.acc, r.dev));
  Tensor part_out = empty({r.B, r.c, r.H, r.hd}, r.dt, r.dev), part_lse = empty({r.B, r.H, r.c}, r.acc, r.dev);

  if (window_direct(opt.method, opt.load_balance, opt.seq_len, r.n, opt.window)) {
    // A window: this rank's block, then the blocks of the ranks at the needed distances, each sent straight here
    // (the next one in flight while this one computes; two receive buffers take turns).
    std::vector<int> steps = {0};
    for (int s : ring_window_distances(opt.load_balance, opt.seq_len, r.n, opt.window)) steps.push_back(s);
    Tensor bufs[2] = {next, empty({r.kv_block()}, r.dt, r.dev)};
    for (size_t a = 0; a < steps.size(); ++a) {
      const int src = ((r.rank - steps[a]) % r.n + r.n) % r.n;
      Work shift;
      if (a + 1 < steps.size()) shift = opt.group->ring_shift(bufs[(a + 1) % 2], kv, steps[a + 1], /*async=*/true);
      for_visible_pairs(r, opt, src, a == 0 ? kv : bufs[a % 2], docs, docs_host,
                        [&](int64_t i, int64_t, const Tensor& kj, const Tensor& vj, const AttentionOptions& o) {
                          attention_forward(part_out, part_lse, chunk(qc, i, r.H, r), kj, vj, o);
                          attention_merge(chunk(out_acc, i, r.H, r), lse_acc.view(i * r.B * r.H * r.c, {r.B, r.H, r.c}),
                                          part_out, part_lse);
                        });
      if (a + 1 < steps.size()) shift.wait();
    }
  }
  Tensor cur = kv;
  for (int s = 0; s < r.n && !window_direct(opt.method, opt.load_balance, opt.seq_len, r.n, opt.window); ++s) {
    const int src = ((r.rank - s) % r.n + r.n) % r.n;  // whose K/V this step sees
    Tensor block =
        opt.method == CpMethod::all_gather ? gathered.view(int64_t(src) * r.kv_block(), {r.kv_block()}) : cur;
    Work shift;
    if (opt.method == CpMethod::ring && s + 1 < r.n) {  // the next step's K/V, in flight while this one computes
      shift = opt.group->ring_shift(next, cur, 1, /*async=*/true);
    }
    for_visible_pairs(r, opt, src, block, docs, docs_host,
                      [&](int64_t i, int64_t, const Tensor& kj, const Tensor& vj, const AttentionOptions& o) {
                        attention_forward(part_out, part_lse, chunk(qc, i, r.H, r), kj, vj, o);
                        attention_merge(chunk(out_acc, i, r.H, r),
                                        lse_acc.view(i * r.B * r.H * r.c, {r.B, r.H, r.c}), part_out, part_lse);
                      });
    if (opt.method == CpMethod::ring && s + 1 < r.n) {
      shift.wait();
      std::swap(cur, next);  // the block just used (ours at first: a copy) takes the next arrival
    }
  }
  from_chunk_major(out, out_acc, r.H, r);
  for (int64_t i = 0; i < r.m; ++i)
    copy_slice(lse, i * r.c, lse_acc.view(i * r.B * r.H * r.c, {r.B, r.H, r.c}), 0, r.c, 2);
}

void ring_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                             const RingAttentionOptions& opt) {
  const Ring r = setup("ring_attention_backward", q, k, v, opt);
  if (local_only(opt) && r.m == 1)
    return attention_backward(dq, dk, dv, dout, q, k, v, out, lse, whole_sequence_options(opt, r));
  const BackwardInputs in = backward_inputs(opt, r, dout, q, out, lse);
  Tensor kv = pack_kv(k, v, r);  // (2, m, B, c, KV, hd)
  CommTag tag(kCpKvTag);
  if (window_direct(opt.method, opt.load_balance, opt.seq_len, r.n, opt.window))
    return window_backward(opt, r, in, kv, dq, dk, dv);
  BackwardBuffers b = backward_buffers(opt, r, kv);
  for (int s = 0; s < r.n; ++s) backward_step(opt, r, in, b, s);
  finish_backward(opt, r, b, dq, dk, dv);
}

std::vector<int> ring_window_distances(CpLoadBalance load_balance, int64_t seq_len, int n, int64_t window) {
  std::vector<int> out;
  for (int s = 1; s < n; ++s) {
    bool needed = window <= 0;
    for (int dst = 0; dst < n && !needed; ++dst) {
      const SequenceShard q = sequence_shard(load_balance, seq_len, n, dst);
      const SequenceShard k = sequence_shard(load_balance, seq_len, n, ((dst - s) % n + n) % n);
      for (int64_t q0 : q.chunk_pos)
        for (int64_t k0 : k.chunk_pos) needed = needed || pair_visible(q0, k0, q.chunk_len, true, window, Tensor());
    }
    if (needed) out.push_back(s);
  }
  return out;
}

bool window_direct(CpMethod method, CpLoadBalance, int64_t, int n, int64_t window) {
  // Even with every distance needed the direct sends move less: dK/dV's n-th hop home is not made.
  return method == CpMethod::ring && window > 0 && n > 1;
}

CpLayerBytes cp_window_layer_bytes(int distances, double kv_bytes, double dkv_bytes) {
  CpLayerBytes b;
  b.dkv_moves = distances;
  b.forward = double(distances) * kv_bytes;
  b.backward = double(distances) * (kv_bytes + dkv_bytes);
  return b;
}

CpLayerBytes cp_layer_bytes(CpMethod method, int n, double kv_bytes, double dkv_bytes) {
  CpLayerBytes b;
  b.dkv_moves = method == CpMethod::ring ? n : n - 1;
  b.forward = double(n - 1) * kv_bytes;
  b.backward = double(n - 1) * kv_bytes + double(b.dkv_moves) * dkv_bytes;
  return b;
}

}  // namespace mt
