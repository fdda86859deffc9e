// Attention through cuDNN (cudnn_attention.h; docs/design/cudnn-attention.md). Index arithmetic in the mask runs in
// the pointwise ops' f32 math, so positions are kept below 2^24 (exact there); larger ones are declined. cuDNN's backend API
// (cudnn_graph.h) is dlopen'ed, so nothing links it. The installed header's SDPA_FWD/BWD operation descriptors
// (9.19) carry no causal mask, so the attention is the operation graph cuDNN's fused-attention engines match (the
// form its own frontend builds): S = Q K^T * scale, the causal mask from generated row/column indices (the row
// shifted by q_pos0 - k_pos0, a by-value scalar, so one plan serves every ring block of a shape), the softmax
// kept as its log-sum-exp (the stats), O = P V; the backward recomputes P from the stats. Grouped-query: K and V
// carry KV heads, broadcast to H in the products; their gradients are summed over each group by a reduction.
#include "runtime/kernels/cuda/cudnn_attention.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <glob.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "runtime/core/cuda_backend.h"
#include "runtime/core/cuda_table.h"
#include "runtime/core/dtype.h"

#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>

namespace mt::cuda {
namespace {

// ---------------------------------------------------------------- the library, loaded once
struct Api {
  decltype(&cudnnGetVersion) get_version = nullptr;
  decltype(&cudnnGetErrorString) error_string = nullptr;
  decltype(&cudnnGetLastErrorString) last_error = nullptr;  // may be absent
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnDestroy) destroy_handle = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) create_desc = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) destroy_desc = nullptr;
  decltype(&cudnnBackendSetAttribute) set = nullptr;
  decltype(&cudnnBackendGetAttribute) get = nullptr;
  decltype(&cudnnBackendFinalize) finalize = nullptr;
  decltype(&cudnnBackendExecute) execute = nullptr;
};

struct Loaded {
  Api api;
  bool ok = false;
  std::string what;  // "cuDNN 9.19.0 (path)" or why not
};

#ifndef MT_CUDA_LIB_DIRS
#define MT_CUDA_LIB_DIRS "/usr/local/cuda/lib64:/usr/local/cuda/lib"
#endif

std::vector<std::string> candidates() {
  std::vector<std::string> c;
  const char* lib = "libcudnn.so.9";
#if MT_CUDA_EMULATED
  // The emulated device's stand-in (tests/emu/cudnn_emu.cpp), built beside this library in the build folder.
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&candidates), &self) && self.dli_fname) {
    std::string dir = self.dli_fname;
    dir = dir.rfind('/') == std::string::npos ? "." : dir.substr(0, dir.rfind('/'));
    c.push_back(dir + "/tests/libcudnn.so.9");
  }
#endif
  if (const char* p = std::getenv("CUDNN_PATH"); p && *p)
    for (const char* sub : {"/lib/", "/lib64/", "/"}) c.push_back(std::string(p) + sub + lib);
  std::string dirs = MT_CUDA_LIB_DIRS;
  for (size_t b = 0; b <= dirs.size();) {
    size_t e = dirs.find(':', b);
    if (e == std::string::npos) e = dirs.size();
    if (e > b) c.push_back(dirs.substr(b, e - b) + "/" + lib);
    b = e + 1;
  }
  // An installed PyTorch's wheel brings cuDNN as nvidia-cudnn-cu12/13: <site-packages>/nvidia/cudnn/lib.
  std::vector<std::string> roots;
  for (const char* env : {"VIRTUAL_ENV", "CONDA_PREFIX"})
    if (const char* p = std::getenv(env); p && *p) roots.push_back(std::string(p) + "/lib/python3*/site-packages");
  if (const char* h = std::getenv("HOME"); h && *h) roots.push_back(std::string(h) + "/.local/lib/python3*/site-packages");
  roots.insert(roots.end(), {"/usr/local/lib/python3*/dist-packages", "/usr/local/lib/python3*/site-packages",
                             "/usr/lib/python3*/dist-packages", "/usr/lib/python3/dist-packages"});
  for (const std::string& r : roots) {
    glob_t g{};
    if (glob((r + "/nvidia/cudnn/lib/" + lib).c_str(), 0, nullptr, &g) == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) c.push_back(g.gl_pathv[i]);
    globfree(&g);
  }
  c.push_back(lib);  // the loader's default search path
  return c;
}

template <class F> bool sym(void* h, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(h, name));
  return f != nullptr;
}

Loaded load() {
  Loaded l;
  std::string tried;
  for (const std::string& path : candidates()) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      tried += "\n  " + path + ": " + (e ? e : "not loadable");
      continue;
    }
    Api& a = l.api;
    bool all = sym(h, "cudnnGetVersion", a.get_version) && sym(h, "cudnnGetErrorString", a.error_string) &&
               sym(h, "cudnnCreate", a.create) && sym(h, "cudnnDestroy", a.destroy_handle) &&
               sym(h, "cudnnSetStream", a.set_stream) && sym(h, "cudnnBackendCreateDescriptor", a.create_desc) &&
               sym(h, "cudnnBackendDestroyDescriptor", a.destroy_desc) &&
               sym(h, "cudnnBackendSetAttribute", a.set) && sym(h, "cudnnBackendGetAttribute", a.get) &&
               sym(h, "cudnnBackendFinalize", a.finalize) && sym(h, "cudnnBackendExecute", a.execute);
    sym(h, "cudnnGetLastErrorString", a.last_error);
    if (!all) {
      tried += "\n  " + path + ": lacks the backend API (cudnnBackend*)";
      dlclose(h);
      continue;
    }
    const size_t v = a.get_version();
    if (v < 90000) {
      tried += "\n  " + path + ": version " + std::to_string(v) + " < 9.0";
      dlclose(h);
      continue;
    }
    char real[4096] = {};
    if (dlinfo(h, RTLD_DI_ORIGIN, real) != 0) real[0] = 0;
    l.ok = true;
    l.what = "cuDNN " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
             std::to_string(v % 100) + " (" + (real[0] ? std::string(real) + "/" : "") +
             path.substr(path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1) + ")";
    return l;
  }
  l.what = "libcudnn.so.9 not loadable; tried:" + tried;
  return l;
}

const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}
const Api& api() { return loaded().api; }

// ---------------------------------------------------------------- descriptors
struct Desc {
  cudnnBackendDescriptor_t d = nullptr;
  Desc() = default;
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  ~Desc() {
    if (d) api().destroy_desc(d);
  }
};
using DescP = std::shared_ptr<Desc>;

#define CK(x)                                          \
  do {                                                 \
    cudnnStatus_t st_ = (x);                           \
    if (st_ != CUDNN_STATUS_SUCCESS) return int(st_);  \
  } while (0)

using Dims = std::array<int64_t, 4>;

// The uids of the tensors a plan's variant pack binds.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kScale, kOffset, kNegInf, kDO, kDQ, kDK, kDV, kDocStart, kKPos0 };

// Builds one operation graph: its tensors and nodes stay alive with the plan.
struct Builder {
  std::vector<DescP> keep;
  std::vector<cudnnBackendDescriptor_t> ops;
  int64_t next_virtual = 1000;

  int make(cudnnBackendDescriptorType_t type, DescP& out) {
    out = std::make_shared<Desc>();
    CK(api().create_desc(type, &out->d));
    keep.push_back(out);
    return 0;
  }
  // A tensor: non-virtual with a uid the variant pack binds, or virtual (uid < 0: a fresh one).
  int tensor(DescP& out, int64_t uid, cudnnDataType_t dt, Dims dims, Dims strides, bool is_virtual,
             bool by_value = false) {
    if (make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, out)) return int(CUDNN_STATUS_ALLOC_FAILED);
    const Api& a = api();
    if (uid < 0) uid = next_virtual++;
    // The kernels' 16-byte loads of bf16 rows; f32 stats and scalars; i64 document starts.
    int64_t align = dt == CUDNN_DATA_BFLOAT16 ? 16 : dt == CUDNN_DATA_INT64 ? 8 : 4;
    if (by_value) align = 4;
    CK(a.set(out->d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt));
    CK(a.set(out->d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data()));
    CK(a.set(out->d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data()));
    CK(a.set(out->d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid));
    CK(a.set(out->d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align));
    CK(a.set(out->d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual));
    if (by_value) CK(a.set(out->d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value));
    CK(a.finalize(out->d));
    return 0;
  }
  int vtensor(DescP& out, cudnnDataType_t dt, Dims dims) {  // a virtual tensor, packed row-major
    return tensor(out, -1, dt, dims, {dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1}, true);
  }
  int add_op(const DescP& op) {
    CK(api().finalize(op->d));
    ops.push_back(op->d);
    return 0;
  }
  int matmul(const DescP& a, const DescP& b, const DescP& c) {
    DescP mm, op;
    if (make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, mm) || make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, op))
      return int(CUDNN_STATUS_ALLOC_FAILED);
    cudnnDataType_t f = CUDNN_DATA_FLOAT;
    CK(api().set(mm->d, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f));
    CK(api().finalize(mm->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm->d));
    return add_op(op);
  }
  // y = mode(x, b, t); axis for GEN_INDEX.
  int pointwise(cudnnPointwiseMode_t mode, const DescP& x, const DescP& b, const DescP& y, const DescP& t = nullptr,
                int64_t axis = -1) {
    DescP pw, op;
    if (make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, pw) || make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, op))
      return int(CUDNN_STATUS_ALLOC_FAILED);
    cudnnDataType_t f = CUDNN_DATA_FLOAT;
    CK(api().set(pw->d, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode));
    CK(api().set(pw->d, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &f));
    if (axis >= 0) CK(api().set(pw->d, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis));
    CK(api().finalize(pw->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x->d));
    if (b) CK(api().set(op->d, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b->d));
    if (t) CK(api().set(op->d, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y->d));
    return add_op(op);
  }
  int reduction(cudnnReduceTensorOp_t red, const DescP& x, const DescP& y) {
    DescP rd, op;
    if (make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, rd) || make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, op))
      return int(CUDNN_STATUS_ALLOC_FAILED);
    cudnnDataType_t f = CUDNN_DATA_FLOAT;
    CK(api().set(rd->d, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red));
    CK(api().set(rd->d, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f));
    CK(api().finalize(rd->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd->d));
    return add_op(op);
  }
  int reshape(const DescP& x, const DescP& y) {  // y: x's memory seen through y's dims and strides (a transpose)
    DescP op;
    if (make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, op)) return int(CUDNN_STATUS_ALLOC_FAILED);
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x->d));
    CK(api().set(op->d, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y->d));
    return add_op(op);
  }
};

// ---------------------------------------------------------------- plans
struct Key {
  int device;
  bool backward;
  int64_t B, T, S, H, KV, hd;
  bool causal, deterministic, docs;
  auto tie() const { return std::tie(device, backward, B, T, S, H, KV, hd, causal, deterministic, docs); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Plan {
  Builder graph;
  DescP opgraph, plan;
  std::vector<DescP> configs;
  int64_t workspace = 0;
  int status = 0;  // a plan that could not be built is remembered as its status: asked once per shape
  std::string why;
};

struct State {
  std::mutex mu;
  std::map<Key, std::unique_ptr<Plan>> plans;
  std::map<int, cudnnHandle_t> handles;
  std::string declined;  // why the last plan was declined
};
State& state() {
  static State* s = new State;  // never destroyed: handles outlive static destruction order questions
  return *s;
}

cudnnHandle_t handle_for(int device) {  // under state().mu
  auto& h = state().handles[device];
  if (!h && api().create(&h) != CUDNN_STATUS_SUCCESS) h = nullptr;
  return h;
}

// The scores S = (Q K^T) * scale, causally masked: (B, H, T, S) f32, virtual.
int scores(Builder& g, const Key& k, const DescP& q, const DescP& kt, const DescP& scale, const DescP& offset,
           const DescP& neg_inf, const DescP& doc_start, const DescP& k_pos0, DescP& out) {
  const Dims sd{k.B, k.H, k.T, k.S};
  DescP s1, s2;
  if (int e = g.vtensor(s1, CUDNN_DATA_FLOAT, sd)) return e;
  if (int e = g.matmul(q, kt, s1)) return e;
  if (int e = g.vtensor(s2, CUDNN_DATA_FLOAT, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_MUL, s1, scale, s2)) return e;
  if (!k.causal) {
    out = s2;
    return 0;
  }
  // Causal: key s visible to query t iff s <= t + (q_pos0 - k_pos0); masked scores become -inf.
  DescP row, row2, col, mask, s3;
  if (int e = g.vtensor(row, CUDNN_DATA_INT32, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s2, nullptr, row, nullptr, 2)) return e;
  if (int e = g.vtensor(row2, CUDNN_DATA_INT32, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_ADD, row, offset, row2)) return e;
  if (int e = g.vtensor(col, CUDNN_DATA_INT32, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s2, nullptr, col, nullptr, 3)) return e;
  if (int e = g.vtensor(mask, CUDNN_DATA_BOOLEAN, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_CMP_GE, row2, col, mask)) return e;
  if (k.docs) {  // packed documents: also k_pos0 + col >= doc_start[b, t] (broadcast over heads and keys)
    DescP colg, in_doc, both;
    if (int e = g.vtensor(colg, CUDNN_DATA_INT32, sd)) return e;
    if (int e = g.pointwise(CUDNN_POINTWISE_ADD, col, k_pos0, colg)) return e;
    if (int e = g.vtensor(in_doc, CUDNN_DATA_BOOLEAN, sd)) return e;
    if (int e = g.pointwise(CUDNN_POINTWISE_CMP_GE, colg, doc_start, in_doc)) return e;
    if (int e = g.vtensor(both, CUDNN_DATA_BOOLEAN, sd)) return e;
    if (int e = g.pointwise(CUDNN_POINTWISE_LOGICAL_AND, mask, in_doc, both)) return e;
    mask = both;
  }
  if (int e = g.vtensor(s3, CUDNN_DATA_FLOAT, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s2, neg_inf, s3, mask)) return e;
  out = s3;
  return 0;
}

// The graph of one direction. Layouts: q, out, dq, dout (B, T, H, hd) seen as (B, H, T, hd); k, v, dk, dv
// (B, S, KV, hd) as (B, KV, S, hd) (K and V transposed by their strides where a product needs it); stats
// (B, H, T) as (B, H, T, 1).
int build_graph(Builder& g, const Key& k) {
  const int64_t B = k.B, T = k.T, S = k.S, H = k.H, KV = k.KV, hd = k.hd;
  const Dims qd{B, H, T, hd}, qs{T * H * hd, hd, H * hd, 1};
  const Dims kvd{B, KV, S, hd}, kvs{S * KV * hd, hd, KV * hd, 1};
  const Dims ktd{B, KV, hd, S}, kts{S * KV * hd, hd, 1, KV * hd};  // K^T, V^T: the same memory
  const Dims rd{B, H, T, 1}, rs{H * T, T, 1, 1};
  const Dims one{1, 1, 1, 1};
  DescP q, kt, scale, offset, neg_inf, stats;
  if (int e = g.tensor(q, kQ, CUDNN_DATA_BFLOAT16, qd, qs, false)) return e;
  if (int e = g.tensor(kt, kK, CUDNN_DATA_BFLOAT16, ktd, kts, false)) return e;
  if (int e = g.tensor(scale, kScale, CUDNN_DATA_FLOAT, one, one, false, true)) return e;
  if (k.causal) {  // the mask's by-value scalars: only a causal graph has them
    if (int e = g.tensor(offset, kOffset, CUDNN_DATA_INT32, one, one, false, true)) return e;
    if (int e = g.tensor(neg_inf, kNegInf, CUDNN_DATA_FLOAT, one, one, false, true)) return e;
  }
  DescP doc_start, k_pos0;
  if (k.docs) {  // (B, T) i64 seen as (B, 1, T, 1); k_pos0 a by-value scalar like the offset
    if (int e = g.tensor(doc_start, kDocStart, CUDNN_DATA_INT64, {B, 1, T, 1}, {T, T, 1, 1}, false)) return e;
    if (int e = g.tensor(k_pos0, kKPos0, CUDNN_DATA_INT32, one, one, false, true)) return e;
  }
  if (int e = g.tensor(stats, kStats, CUDNN_DATA_FLOAT, rd, rs, false)) return e;
  DescP s;
  if (int e = scores(g, k, q, kt, scale, offset, neg_inf, doc_start, k_pos0, s)) return e;
  const Dims sd{B, H, T, S};
  if (!k.backward) {
    // Softmax kept as its log-sum-exp: stats = max + log(sum(exp(s - max))); O = (exp(s - max) / sum) V.
    DescP mx, sub, ex, sum, lsum, p, v, o;
    if (int e = g.vtensor(mx, CUDNN_DATA_FLOAT, rd)) return e;
    if (int e = g.reduction(CUDNN_REDUCE_TENSOR_MAX, s, mx)) return e;
    if (int e = g.vtensor(sub, CUDNN_DATA_FLOAT, sd)) return e;
    if (int e = g.pointwise(CUDNN_POINTWISE_SUB, s, mx, sub)) return e;
    if (int e = g.vtensor(ex, CUDNN_DATA_FLOAT, sd)) return e;
    if (int e = g.pointwise(CUDNN_POINTWISE_EXP, sub, nullptr, ex)) return e;
    if (int e = g.vtensor(sum, CUDNN_DATA_FLOAT, rd)) return e;
    if (int e = g.reduction(CUDNN_REDUCE_TENSOR_ADD, ex, sum)) return e;
    if (int e = g.vtensor(lsum, CUDNN_DATA_FLOAT, rd)) return e;
    if (int e = g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, lsum)) return e;
    if (int e = g.pointwise(CUDNN_POINTWISE_ADD, mx, lsum, stats)) return e;
    if (int e = g.vtensor(p, CUDNN_DATA_BFLOAT16, sd)) return e;  // P rounded to bf16 for the tensor cores
    if (int e = g.pointwise(CUDNN_POINTWISE_DIV, ex, sum, p)) return e;
    if (int e = g.tensor(v, kV, CUDNN_DATA_BFLOAT16, kvd, kvs, false)) return e;
    if (int e = g.tensor(o, kO, CUDNN_DATA_BFLOAT16, qd, qs, false)) return e;
    return g.matmul(p, v, o);
  }
  // Backward: P = exp(s - stats); dV = P^T dO; dP = dO V^T; dS = P (dP - rowsum(dO O)) scale;
  // dQ^T = K^T dS^T (so K is needed only transposed); dK = dS^T Q. With KV < H the products give one gradient per
  // query head, summed over each group of H/KV heads by a reduction.
  const Dims std_{B, H, S, T}, sts{H * T * S, T * S, 1, S};  // a (B, H, T, S) packed tensor seen transposed
  DescP sub, p, pt, dout, vt, dp, o, dodot, dsum, dpm, ds0, ds, dst, dqt;
  if (int e = g.vtensor(sub, CUDNN_DATA_FLOAT, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_SUB, s, stats, sub)) return e;
  if (int e = g.vtensor(p, CUDNN_DATA_FLOAT, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_EXP, sub, nullptr, p)) return e;
  if (int e = g.tensor(pt, -1, CUDNN_DATA_BFLOAT16, std_, sts, true)) return e;
  if (int e = g.reshape(p, pt)) return e;
  if (int e = g.tensor(dout, kDO, CUDNN_DATA_BFLOAT16, qd, qs, false)) return e;
  // The gradients of K and V: directly when KV == H, else per query head, then summed over each group.
  auto kv_grad = [&](const DescP& a, const DescP& b, int64_t uid) {
    DescP out;
    if (KV == H) {
      if (int e = g.tensor(out, uid, CUDNN_DATA_BFLOAT16, kvd, kvs, false)) return e;
      return g.matmul(a, b, out);
    }
    DescP full;
    if (int e = g.vtensor(full, CUDNN_DATA_FLOAT, {B, H, S, hd})) return e;
    if (int e = g.matmul(a, b, full)) return e;
    if (int e = g.tensor(out, uid, CUDNN_DATA_BFLOAT16, kvd, kvs, false)) return e;
    return g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
  };
  if (int e = kv_grad(pt, dout, kDV)) return e;
  if (int e = g.tensor(vt, kV, CUDNN_DATA_BFLOAT16, ktd, kts, false)) return e;
  if (int e = g.vtensor(dp, CUDNN_DATA_FLOAT, sd)) return e;
  if (int e = g.matmul(dout, vt, dp)) return e;
  if (int e = g.tensor(o, kO, CUDNN_DATA_BFLOAT16, qd, qs, false)) return e;
  if (int e = g.vtensor(dodot, CUDNN_DATA_FLOAT, qd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_MUL, dout, o, dodot)) return e;
  if (int e = g.vtensor(dsum, CUDNN_DATA_FLOAT, rd)) return e;
  if (int e = g.reduction(CUDNN_REDUCE_TENSOR_ADD, dodot, dsum)) return e;
  if (int e = g.vtensor(dpm, CUDNN_DATA_FLOAT, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_SUB, dp, dsum, dpm)) return e;
  if (int e = g.vtensor(ds0, CUDNN_DATA_FLOAT, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_MUL, p, dpm, ds0)) return e;
  if (int e = g.vtensor(ds, CUDNN_DATA_FLOAT, sd)) return e;
  if (int e = g.pointwise(CUDNN_POINTWISE_MUL, ds0, scale, ds)) return e;
  if (int e = g.tensor(dst, -1, CUDNN_DATA_BFLOAT16, std_, sts, true)) return e;
  if (int e = g.reshape(ds, dst)) return e;
  if (int e = g.tensor(dqt, kDQ, CUDNN_DATA_BFLOAT16, {B, H, hd, T}, {T * H * hd, hd, 1, H * hd}, false)) return e;
  if (int e = g.matmul(kt, dst, dqt)) return e;
  return kv_grad(dst, q, kDK);
}

// The graph, heuristics, and the first engine configuration that finalizes into a plan (deterministic: the
// first without the NONDETERMINISTIC note). Under state().mu.
int build_plan(Plan& p, const Key& k, cudnnHandle_t h) {
  const Api& a = api();
  if (int e = build_graph(p.graph, k)) return e;
  if (p.graph.make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, p.opgraph)) return int(CUDNN_STATUS_ALLOC_FAILED);
  CK(a.set(p.opgraph->d, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h));
  CK(a.set(p.opgraph->d, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
           int64_t(p.graph.ops.size()), p.graph.ops.data()));
  CK(a.finalize(p.opgraph->d));
  DescP heur;
  if (p.graph.make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, heur)) return int(CUDNN_STATUS_ALLOC_FAILED);
  CK(a.set(heur->d, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &p.opgraph->d));
  cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  CK(a.set(heur->d, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode));
  CK(a.finalize(heur->d));
  int64_t count = 0;
  CK(a.get(heur->d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
  if (count <= 0) return kCudnnDeclined;
  count = std::min<int64_t>(count, 16);
  std::vector<cudnnBackendDescriptor_t> cfgs;
  for (int64_t i = 0; i < count; ++i) {
    DescP c;
    if (p.graph.make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, c)) return int(CUDNN_STATUS_ALLOC_FAILED);
    p.configs.push_back(c);
    cfgs.push_back(c->d);
  }
  int64_t got = 0;
  CK(a.get(heur->d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, cfgs.data()));
  for (int64_t i = 0; i < got; ++i) {
    if (k.deterministic) {
      DescP eng;
      if (p.graph.make(CUDNN_BACKEND_ENGINE_DESCRIPTOR, eng)) return int(CUDNN_STATUS_ALLOC_FAILED);
      int64_t n_eng = 0;
      if (a.get(cfgs[size_t(i)], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n_eng, &eng->d) !=
          CUDNN_STATUS_SUCCESS)
        continue;
      std::array<cudnnBackendNumericalNote_t, 16> notes{};
      int64_t n_notes = 0;
      if (a.get(eng->d, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE, int64_t(notes.size()), &n_notes,
                notes.data()) != CUDNN_STATUS_SUCCESS)
        continue;
      bool nondet = false;
      for (int64_t j = 0; j < n_notes; ++j) nondet |= notes[size_t(j)] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
      if (nondet) continue;
    }
    DescP plan;
    if (p.graph.make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, plan)) return int(CUDNN_STATUS_ALLOC_FAILED);
    if (a.set(plan->d, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h) != CUDNN_STATUS_SUCCESS ||
        a.set(plan->d, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[size_t(i)]) !=
            CUDNN_STATUS_SUCCESS ||
        a.finalize(plan->d) != CUDNN_STATUS_SUCCESS)
      continue;  // this engine does not take the graph: the next one may
    int64_t n = 0;
    CK(a.get(plan->d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &p.workspace));
    p.plan = plan;
    return 0;
  }
  return kCudnnDeclined;
}

// The cached plan of a key (built on first use), or a non-zero status.
int plan_for(const Key& k, Plan** out, cudnnHandle_t* h) {
  if (!loaded().ok) return kCudnnDeclined;
  std::lock_guard lock(state().mu);
  *h = handle_for(k.device);
  if (!*h) return kCudnnDeclined;
  auto& slot = state().plans[k];
  if (!slot) {
    slot = std::make_unique<Plan>();
    slot->status = build_plan(*slot, k, *h);
    if (slot->status != 0 && slot->status != kCudnnDeclined)
      slot->why = cudnn_error_string(slot->status);  // the graph or plan cuDNN refused: said by the caller
  }
  *out = slot.get();
  if (slot->status == 0) return 0;
  state().declined = (k.backward ? "no backward plan for B " : "no forward plan for B ") + std::to_string(k.B) +
                     " T " + std::to_string(k.T) + " S " + std::to_string(k.S) + " H " + std::to_string(k.H) +
                     " KV " + std::to_string(k.KV) + " hd " + std::to_string(k.hd) +
                     (k.deterministic ? " (deterministic engines only)" : "") +
                     (slot->why.empty() ? std::string() : ": " + slot->why);
  return kCudnnDeclined;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int execute(Plan& p, cudnnHandle_t h, int device, void* stream, std::vector<int64_t> uids, std::vector<void*> ptrs) {
  const Api& a = api();
  void* ws = p.workspace > 0 ? detail::cuda_caching_alloc(device, size_t(p.workspace)) : nullptr;
  int rc = 0;
  {
    Desc vp;
    rc = int(a.create_desc(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp.d));
    if (rc == 0) rc = int(a.set(vp.d, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()),
                                uids.data()));
    if (rc == 0) rc = int(a.set(vp.d, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                                int64_t(ptrs.size()), ptrs.data()));
    if (rc == 0) rc = int(a.set(vp.d, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws));
    if (rc == 0) rc = int(a.finalize(vp.d));
    if (rc == 0) {
      std::lock_guard lock(state().mu);  // the handle's stream is shared state
      rc = int(a.set_stream(h, static_cast<cudaStream_t>(stream)));
      if (rc == 0) rc = int(a.execute(h, p.plan->d, vp.d));
    }
  }
  if (ws) detail::cuda_caching_free(device, ws, size_t(p.workspace));  // stream-ordered like every tensor's
  return rc;
}

int current_device() {
  int d = 0;
  return cudaGetDevice(&d) == cudaSuccess ? d : 0;
}

}  // namespace

std::string cudnn_load(bool* ok) {
  *ok = loaded().ok;
  return loaded().what;
}

int cudnn_attention_forward(void* out, float* lse, const void* q, const void* k, const void* v, int64_t B, int64_t T,
                            int64_t S, int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                            int64_t k_pos0, const int64_t* doc_start, void* stream) {
  if (B <= 0 || T <= 0 || S <= 0 || KV <= 0 || H % KV != 0 || (causal && q_pos0 < k_pos0) ||
      (doc_start && (!causal || q_pos0 != k_pos0 || reinterpret_cast<uintptr_t>(doc_start) % 8 != 0)) ||
      q_pos0 - k_pos0 + T + S > (int64_t(1) << 24) || (doc_start && q_pos0 + T > (int64_t(1) << 24)) || !aligned16(out) || !aligned16(q) ||
      !aligned16(k) || !aligned16(v))
    return kCudnnDeclined;
  const int device = current_device();
  const Key key{device, false, B, T, S, H, KV, hd, causal, false, doc_start != nullptr};
  Plan* p = nullptr;
  cudnnHandle_t h = nullptr;
  if (int e = plan_for(key, &p, &h)) return e;
  float sc = float(scale), ninf = -std::numeric_limits<float>::infinity();
  int32_t off = int32_t(q_pos0 - k_pos0), kp0 = int32_t(k_pos0);
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), out, lse, &sc};
  if (causal) uids.insert(uids.end(), {kOffset, kNegInf}), ptrs.insert(ptrs.end(), {&off, &ninf});
  if (doc_start) uids.insert(uids.end(), {kDocStart, kKPos0}), ptrs.insert(ptrs.end(), {const_cast<int64_t*>(doc_start), &kp0});
  return execute(*p, h, device, stream, uids, ptrs);
}

int cudnn_attention_backward(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
                             const void* v, const void* out, const float* lse, int64_t B, int64_t T, int64_t S,
                             int64_t H, int64_t KV, int64_t hd, double scale, bool causal, int64_t q_pos0,
                             int64_t k_pos0, const int64_t* doc_start, bool accumulate, bool deterministic,
                             void* stream) {
  if (B <= 0 || T <= 0 || S <= 0 || KV <= 0 || H % KV != 0 || (causal && q_pos0 < k_pos0) ||
      (doc_start && (!causal || q_pos0 != k_pos0 || reinterpret_cast<uintptr_t>(doc_start) % 8 != 0)) ||
      q_pos0 - k_pos0 + T + S > (int64_t(1) << 24) || (doc_start && q_pos0 + T > (int64_t(1) << 24)) || !aligned16(dq) || !aligned16(dk) ||
      !aligned16(dv) || !aligned16(dout) || !aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(out))
    return kCudnnDeclined;
  const int device = current_device();
  const Key key{device, true, B, T, S, H, KV, hd, causal, deterministic, doc_start != nullptr};
  Plan* p = nullptr;
  cudnnHandle_t h = nullptr;
  if (int e = plan_for(key, &p, &h)) return e;
  float sc = float(scale), ninf = -std::numeric_limits<float>::infinity();
  int32_t off = int32_t(q_pos0 - k_pos0), kp0 = int32_t(k_pos0);
  // Accumulating (ring attention's several query chunks): the graph writes temporaries, added after.
  const int64_t n_kv = B * S * KV * hd;
  const size_t kv_bytes = size_t(n_kv) * sizeof(bf16);
  void* dk_w = accumulate ? detail::cuda_caching_alloc(device, kv_bytes) : dk;  // (B, S, KV, hd)
  void* dv_w = accumulate ? detail::cuda_caching_alloc(device, kv_bytes) : dv;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale, kDO, kDQ, kDK, kDV};
  std::vector<void*> ptrs{const_cast<void*>(q),   const_cast<void*>(k), const_cast<void*>(v),
                          const_cast<void*>(out), const_cast<float*>(lse), &sc,
                          const_cast<void*>(dout), dq, dk_w, dv_w};
  if (causal) uids.insert(uids.end(), {kOffset, kNegInf}), ptrs.insert(ptrs.end(), {&off, &ninf});
  if (doc_start) uids.insert(uids.end(), {kDocStart, kKPos0}), ptrs.insert(ptrs.end(), {const_cast<int64_t*>(doc_start), &kp0});
  int rc = execute(*p, h, device, stream, uids, ptrs);
  if (accumulate) {
    if (rc == 0) rc = cuda::add<bf16>(static_cast<bf16*>(dk), static_cast<bf16*>(dk), static_cast<bf16*>(dk_w), n_kv,
                                      stream);
    if (rc == 0) rc = cuda::add<bf16>(static_cast<bf16*>(dv), static_cast<bf16*>(dv), static_cast<bf16*>(dv_w), n_kv,
                                      stream);
    detail::cuda_caching_free(device, dk_w, kv_bytes);
    detail::cuda_caching_free(device, dv_w, kv_bytes);
  }
  return rc;
}

std::string cudnn_error_string(int status) {
  if (status == kCudnnDeclined) {
    if (!loaded().ok) return "not loaded: " + loaded().what;
    std::lock_guard lock(state().mu);
    return state().declined.empty() ? "declined" : state().declined;
  }
  if (!loaded().ok) return "cuDNN status " + std::to_string(status) + " (cuDNN not loaded)";
  std::string s = api().error_string(static_cast<cudnnStatus_t>(status));
  if (api().last_error) {
    char msg[1024] = {};
    api().last_error(msg, sizeof msg);
    if (msg[0]) s += std::string(": ") + msg;
  }
  return s;
}

int64_t cudnn_cached_plans() {
  std::lock_guard lock(state().mu);
  return int64_t(state().plans.size());
}

}  // namespace mt::cuda

#else  // a toolkit without cuDNN's headers: the flash kernel only

namespace mt::cuda {
std::string cudnn_load(bool* ok) {
  *ok = false;
  return "built without cuDNN's headers (cudnn_graph.h)";
}
int cudnn_attention_forward(void*, float*, const void*, const void*, const void*, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, double, bool, int64_t, int64_t, const int64_t*, void*) {
  return kCudnnDeclined;
}
int cudnn_attention_backward(void*, void*, void*, const void*, const void*, const void*, const void*, const void*,
                             const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, int64_t,
                             int64_t, const int64_t*, bool, bool, void*) {
  return kCudnnDeclined;
}
std::string cudnn_error_string(int status) { return "cuDNN status " + std::to_string(status); }
int64_t cudnn_cached_plans() { return 0; }
}  // namespace mt::cuda
#endif
