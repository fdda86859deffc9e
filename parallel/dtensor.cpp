#include "parallel/dtensor.h"

#include <algorithm>
#include <functional>
#include <optional>

#include "comm/comm_counters.h"
#include "parallel/copy_block.h"
#include "runtime/kernels/ops.h"

namespace mt {


namespace {

Shape with(Shape s, int d, int64_t v) {
  s[size_t(d)] = v;
  return s;
}

// Elements before dim d in row-major order: 1 means the blocks of a split
// along d are contiguous and in order, so no packing is needed.
int64_t outer(const Shape& s, int d) {
  int64_t p = 1;
  for (int i = 0; i < d; ++i) p *= s[size_t(i)];
  return p;
}

std::vector<int> with_coord(std::vector<int> c, int m, int v) {
  c[size_t(m)] = v;
  return c;
}

bool all_equal(const std::vector<int64_t>& v) {
  return std::adjacent_find(v.begin(), v.end(), std::not_equal_to<>()) == v.end();
}

// The device a redistribution runs on: the tensor's own (host tensors on an MPI mesh, device tensors on
// NCCL or on MPI, which stages device buffers through the host itself), except a host tensor on a mesh whose
// collectives take device buffers only (NCCL): it visits the mesh's device.
Device work_device(const Tensor& t, const DeviceMesh& mesh) {
  return mesh.backend() == "nccl" && t.device().is_cpu() ? mesh.device() : t.device();
}

// The lengths of the n torch.chunk pieces of a dim of `size` elements.
std::vector<int64_t> chunk_lens(int64_t size, int n) {
  std::vector<int64_t> lens(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) lens[size_t(j)] = chunk_of(size, n, j).len;
  return lens;
}

bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

// What every kind of step needs: the plan step and the layout before it, its mesh dim's group and size, this
// rank's coordinate (and its index along that dim), and the local shape the step ends with.
struct StepCtx {
  const PlanStep& st;
  const DTensorSpec& before;
  Group& g;
  int m, n, me;
  const std::vector<int>& coord;
  Shape out_shape;
};

// Shard(a) -> Replicate: every member's shard gathered, then unpacked along a unless the blocks are in order.
Tensor gather_step(const Tensor& cur, const StepCtx& x) {
  const int a = x.st.from.dim, n = x.n;
  std::vector<int64_t> counts(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) counts[size_t(j)] = shape_numel(x.before.local_shape(with_coord(x.coord, x.m, j)));
  int64_t total = 0;
  for (auto c : counts) total += c;
  Tensor gathered = empty({total}, cur.dtype(), cur.device());  // every member's shard, in member order
  // Equal shards use the plain collective: MPI's *v variants are much slower.
  if (all_equal(counts)) x.g.all_gather(gathered, cur.reshape({-1}));
  else x.g.all_gather_v(gathered, cur.reshape({-1}), counts);
  if (outer(x.out_shape, a) == 1) return gathered.reshape(x.out_shape);
  Tensor out = empty(x.out_shape, cur.dtype(), cur.device());
  unpack_blocks(out, gathered, a, chunk_lens(x.out_shape[size_t(a)], n));
  return out;
}

// Partial -> Replicate: one all-reduce.
Tensor all_reduce_step(const Tensor& cur, const StepCtx& x) {
  Tensor out = empty(cur.shape(), cur.dtype(), cur.device());
  x.g.all_reduce(out, cur, x.st.from.op);
  return out;
}

// Partial -> Shard(a): member j's block j packed after one another, then reduce-scattered.
Tensor reduce_scatter_step(const Tensor& cur, const StepCtx& x) {
  const int a = x.st.to.dim, n = x.n;
  std::vector<int64_t> lens = chunk_lens(cur.shape()[size_t(a)], n), counts(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) counts[size_t(j)] = shape_numel(with(cur.shape(), a, lens[size_t(j)]));
  Tensor packed = cur.reshape({-1});  // member j's block j, one after the other
  if (outer(cur.shape(), a) != 1) {
    packed = empty({cur.numel()}, cur.dtype(), cur.device());
    pack_blocks(packed, cur, a, lens);
  }
  Tensor out = empty({counts[size_t(x.me)]}, cur.dtype(), cur.device());
  if (all_equal(counts)) x.g.reduce_scatter(out, packed, x.st.from.op);
  else x.g.reduce_scatter_v(out, packed, counts, x.st.from.op);
  return out.reshape(x.out_shape);
}

// Shard(a) -> Shard(b): my chunk j of b sent to member j, every member's shard of a received and unpacked.
Tensor all_to_all_step(const Tensor& cur, const StepCtx& x) {
  const int a = x.st.from.dim, b = x.st.to.dim, n = x.n;
  std::vector<int64_t> send(static_cast<size_t>(n)), recv(static_cast<size_t>(n));
  std::vector<int64_t> b_lens = chunk_lens(cur.shape()[size_t(b)], n), a_sizes;
  for (int j = 0; j < n; ++j) {
    send[size_t(j)] = shape_numel(with(cur.shape(), b, b_lens[size_t(j)]));
    // Member j sends its own shard of a, restricted to my chunk of b.
    Shape theirs = x.before.local_shape(with_coord(x.coord, x.m, j));
    a_sizes.push_back(theirs[size_t(a)]);
    recv[size_t(j)] = shape_numel(with(theirs, b, x.out_shape[size_t(b)]));
  }
  Tensor packed = cur.reshape({-1});  // my chunk j of b for member j, one after the other
  if (outer(cur.shape(), b) != 1) {
    packed = empty({cur.numel()}, cur.dtype(), cur.device());
    pack_blocks(packed, cur, b, b_lens);
  }
  int64_t total = 0;
  for (auto c : recv) total += c;
  Tensor got = empty({total}, cur.dtype(), cur.device());
  // The choice must be the same on every rank: decide from the members' shard sizes along a and the
  // chunk sizes along b, which all ranks share.
  if (all_equal(a_sizes) && all_equal(b_lens)) x.g.all_to_all(got, packed);
  else x.g.all_to_all_v(got, packed, send, recv);
  if (outer(x.out_shape, a) == 1) return got.reshape(x.out_shape);
  Tensor out = empty(x.out_shape, cur.dtype(), cur.device());
  unpack_blocks(out, got, a, chunk_lens(x.out_shape[size_t(a)], n));
  return out;
}

// Replicate -> Shard(a): this rank's chunk, copied out locally.
Tensor local_chunk_step(const Tensor& cur, const StepCtx& x) {
  const int a = x.st.to.dim;
  Chunk c = chunk_of(cur.shape()[size_t(a)], x.n, x.me);
  Tensor out = empty(with(cur.shape(), a, c.len), cur.dtype(), cur.device());
  copy_slice(out, 0, cur, c.begin, c.len, a);
  return out;
}

// Replicate -> Partial: a copy, divided by n for Partial(sum) so that the members' sum is the value.
Tensor local_partial_step(const Tensor& cur, const StepCtx& x) {
  const int n = x.n;
  const Device dev = cur.device();
  const DType dt = cur.dtype();
  Tensor t = cur.clone();
  if (x.st.to.op != ReduceOp::sum || n == 1) return t;  // dividing by 1 is the identity: no trip to the host
  // Partial(sum) divides by n: on the host exactly (divide_); on a device by a scale, which is the same
  // bits when n is a power of two; other sizes (and integers) take the division on the host.
  bool exact_scale = (dt == DType::f32 || dt == DType::bf16) && power_of_two(n);
  if (dev.is_cpu()) {
    divide_(t, n);
  } else if (exact_scale) {
    scale_(t, 1.0 / double(n));
  } else {
    Tensor h = t.to(Device::cpu());
    divide_(h, n);
    t = h.to(dev);
  }
  return t;
}

// One plan step where the tensor lives: shards are packed and unpacked by device ops (pack_blocks,
// unpack_blocks, copy_slice) and the collectives take the tensor's buffers, so a device tensor never visits
// the host and nothing waits for the device (the MPI backend stages device buffers itself: ranks sharing a GPU).
Tensor run_step(const Tensor& cur, const DTensorSpec& before, const PlanStep& st, const DeviceMesh& mesh) {
  const int m = st.mesh_dim;
  Group& g = mesh.group(m);
  const auto& coord = mesh.coordinate();
  const StepCtx x{st, before, g, m, g.size(), coord[size_t(m)], coord, st.after.local_shape(coord)};
  switch (st.kind) {
    case StepKind::all_gather: return gather_step(cur, x);
    case StepKind::all_reduce: return all_reduce_step(cur, x);
    case StepKind::reduce_scatter: return reduce_scatter_step(cur, x);
    case StepKind::all_to_all: return all_to_all_step(cur, x);
    case StepKind::local_chunk: return local_chunk_step(cur, x);
    case StepKind::local_partial: return local_partial_step(cur, x);
  }
  return cur;
}

DTensor execute(const DTensor& t, const Plan& plan) {
  Tensor cur = t.local.to(work_device(t.local, t.mesh));  // the same tensor unless a host tensor meets NCCL
  DTensorSpec spec = t.spec;
  for (auto& st : plan.steps) {
    cur = run_step(cur, spec, st, t.mesh);
    spec = st.after;
  }
  return DTensor{cur.to(t.local.device()), plan.dst, t.mesh};
}

}  // namespace

DTensor redistribute(const DTensor& t, const DTensorSpec& target, const RedistributeOptions& opts) {
  const Plan& plan = plan_redistribute(t.spec, target, dtype_size(t.local.dtype()), opts.link_gbps, opts.planner);
  // The steps' collectives are counted by the mesh dims' groups, under the caller's tag or "redistribute".
  std::optional<CommTag> tag;
  if (current_comm_tag().empty()) tag.emplace("redistribute");
  return execute(t, plan);
}

DTensor redistribute(const DTensor& t, const Placements& placements, const RedistributeOptions& opts,
                     const ShardOrder& order) {
  return redistribute(t, DTensorSpec::make(t.spec.mesh, placements, t.spec.global_shape, order), opts);
}

Tensor full_tensor(const DTensor& t, const RedistributeOptions& opts) {
  return redistribute(t, Placements(t.spec.placements.size(), Placement::Replicate()), opts).local;
}

DTensor distribute_tensor(const Tensor& full_in, const DeviceMesh& mesh, const Placements& placements,
                          std::optional<int> src_rank, const ShardOrder& order) {
  Tensor full = full_in;
  if (src_rank) {
    // Shape and dtype first, so that only the source needs the tensor.
    Group& world = mesh.group("world");
    MT_CHECK(*src_rank >= 0 && *src_rank < world.size(), "distribute",
             "source rank {} is not a rank of the mesh ({} ranks)", *src_rank, world.size());
    bool src = world.rank() == *src_rank;
    MT_CHECK(!src || full.defined(), "distribute", "the source rank {} has no tensor to distribute", *src_rank);
    Tensor meta = zeros({10}, DType::i64);
    if (src) {
      MT_CHECK(full.dim() <= 8, "distribute", "tensors of more than 8 dims are not supported");
      meta.at<int64_t>(0) = int64_t(full.dtype());
      meta.at<int64_t>(1) = full.dim();
      for (int64_t d = 0; d < full.dim(); ++d) meta.at<int64_t>(2 + d) = full.shape()[size_t(d)];
    }
    {
      Tensor m = meta.to(work_device(meta, mesh));
      world.broadcast(m, *src_rank);
      meta = m.to(Device::cpu());
    }
    Shape s(static_cast<size_t>(meta.at<int64_t>(1)));
    for (size_t d = 0; d < s.size(); ++d) s[d] = meta.at<int64_t>(2 + int64_t(d));
    Tensor host = src ? full.to(Device::cpu()).clone() : empty(s, DType(meta.at<int64_t>(0)));
    Tensor buf = host.to(work_device(host, mesh));
    world.broadcast(buf, *src_rank);
    full = buf.to(Device::cpu());
  }
  MT_CHECK(full.defined(), "distribute", "no tensor given");
  DTensorSpec spec = DTensorSpec::make(mesh.dims(), placements, full.shape(), order);
  Tensor host = full.to(Device::cpu());
  Shape ls = spec.local_shape(mesh.coordinate()), off = spec.local_offset(mesh.coordinate());
  Tensor local = empty(ls, full.dtype());
  copy_block(local, Shape(ls.size(), 0), host, off, ls);
  for (int m = 0; m < spec.mesh_ndim(); ++m) {
    const Placement& p = spec.placements[size_t(m)];
    if (p.is_partial() && p.op == ReduceOp::sum) divide_(local, spec.mesh[size_t(m)].size);
  }
  return DTensor{local.to(full.device()), spec, mesh};
}

DTensor from_local(const Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                   std::optional<Shape> global_shape, bool check, const ShardOrder& order) {
  Shape gs;
  if (global_shape) {
    gs = *global_shape;
  } else {
    gs = local.shape();
    for (auto& p : placements)
      if (p.is_shard()) {
        int d = p.dim < 0 ? p.dim + int(gs.size()) : p.dim;
        MT_CHECK(d >= 0 && d < int(gs.size()), "from_local", "{} on a local tensor of shape {}", p.str(),
                 shape_str(local.shape()));
      }
    for (size_t m = 0; m < placements.size(); ++m)
      if (placements[m].is_shard()) {
        int d = placements[m].dim < 0 ? placements[m].dim + int(gs.size()) : placements[m].dim;
        gs[size_t(d)] *= mesh.dims()[m].size;
      }
  }
  DTensorSpec spec = DTensorSpec::make(mesh.dims(), placements, gs, order);
  if (check) {
    Group& world = mesh.group("world");
    int nd = spec.tensor_ndim();
    Tensor mine = zeros({nd + 1}, DType::i64);
    mine.at<int64_t>(0) = local.dim();
    for (int d = 0; d < std::min<int>(nd, int(local.dim())); ++d) mine.at<int64_t>(1 + d) = local.shape()[size_t(d)];
    Tensor all = zeros({(nd + 1) * world.size()}, DType::i64, work_device(mine, mesh));
    world.all_gather(all, mine.to(all.device()));
    all = all.to(Device::cpu());
    for (int r = 0; r < world.size(); ++r) {
      Shape want = spec.local_shape(mesh.coordinate_of(r));
      Shape got;
      for (int64_t d = 0; d < all.at<int64_t>(r * (nd + 1)); ++d) got.push_back(all.at<int64_t>(r * (nd + 1) + 1 + d));
      MT_CHECK(got == want, "from_local",
               "rank {} holds a local tensor of shape {}, but {} of global shape {} gives it {}", r, shape_str(got),
               spec.str(), shape_str(gs), shape_str(want));
    }
  } else {
    MT_CHECK(local.shape() == spec.local_shape(mesh.coordinate()), "from_local",
             "local shape {} does not match {} of global shape {} (expected {})", shape_str(local.shape()), spec.str(),
             shape_str(gs), shape_str(spec.local_shape(mesh.coordinate())));
  }
  return DTensor{local, spec, mesh};
}

Placement redistribute_grad_placement(const Placement& source) {
  return source.is_partial() ? Placement::Replicate() : source;
}

Placements redistribute_backward_placements(const Placements& source) {
  Placements p;
  for (const Placement& x : source) p.push_back(redistribute_grad_placement(x));
  return p;
}

DTensor redistribute_backward(const DTensor& grad_out, const DTensorSpec& source, const RedistributeOptions& opts) {
  Placements p = redistribute_backward_placements(source.placements);
  // Shard order of the source is kept for the dims that stay sharded.
  return redistribute(grad_out, DTensorSpec::make(source.mesh, p, source.global_shape, source.shard_order), opts);
}

}  // namespace mt
