// cuDNN stand-in for the emulated CUDA device (-Demulate_cuda=true, test-only), built as libcudnn.so.9 in
// build-emu/tests, which runtime/kernels/cuda/cudnn_attention.cpp loads there before any real cuDNN. It answers
// the part of cuDNN's backend API (cudnn_graph.h, with its signatures and status codes) that meshtrain calls, and
// executes an operation graph by interpreting it: each node (matmul, pointwise, reduction, reshape) evaluated in
// f64 on the host, so a graph is checked by what it computes (layouts, strides, the mask, GQA's broadcast and
// group sums), not by matching a pattern. Virtual tensors stay f64 whatever their declared type; outputs are
// rounded once to theirs (bf16 to nearest even). Real cuDNN runs fused engines that round P to bf16 inside.
//
// Strict as the real library is about misuse, answering with its status codes: a set on a finalized descriptor or
// an unknown attribute (BAD_PARAM), a wrong attribute type (BAD_PARAM_ATTRIBUTE_TYPE) or count (BAD_PARAM), a
// descriptor of the wrong kind (BAD_PARAM_DESCRIPTOR_TYPE), one not finalized (BAD_PARAM_NOT_FINALIZED), a required
// attribute unset at finalize (BAD_PARAM), dims and strides of different ranks or not positive (BAD_PARAM),
// shapes that do not compose (BAD_PARAM_SHAPE_MISMATCH), a tensor uid bound twice or a graph uid left unbound in the
// variant pack (BAD_PARAM), a pointer not aligned as its tensor promised (BAD_PARAM_MISALIGNED_POINTER), and a
// tensor whose strides reach past its allocation (reported by the device registry, EXECUTION_FAILED). Only what
// meshtrain uses is accepted; anything else is NOT_SUPPORTED (4-D tensors; the modes listed in eval_pointwise).
// Every access is recorded on the handle's stream (emu::note_read / note_write), so a missing stream order shows
// in the hazard tracker; the engine asks for a workspace, which is checked and recorded as written.
#include <cudnn_graph.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "runtime/core/dtype.h"
#include "tests/emu/device_registry.h"

namespace {

constexpr int64_t kWorkspace = 256;  // what the stand-in's engine asks for, checked and written at execute

std::mutex g_mu;
std::string g_last_error;

cudnnStatus_t fail(cudnnStatus_t st, const std::string& what) {
  g_last_error = what;
  return st;
}

struct Attr {
  cudnnBackendAttributeType_t type;
  std::vector<char> bytes;
  int64_t count = 0;
  template <class T> const T* as() const { return reinterpret_cast<const T*>(bytes.data()); }
};

struct Obj;
std::set<Obj*> g_live;

struct Obj {
  cudnnBackendDescriptorType_t type;
  bool finalized = false;
  std::map<cudnnBackendAttributeName_t, Attr> attrs;
  // Engine configs and engines filled by a Get: the graph they serve.
  Obj* graph = nullptr;
  const Attr* get(cudnnBackendAttributeName_t n) const {
    auto it = attrs.find(n);
    return it == attrs.end() ? nullptr : &it->second;
  }
  Obj* desc(cudnnBackendAttributeName_t n) const {
    const Attr* a = get(n);
    return a ? a->as<Obj*>()[0] : nullptr;
  }
  int64_t i64(cudnnBackendAttributeName_t n, int64_t dflt = 0) const {
    const Attr* a = get(n);
    return a ? a->as<int64_t>()[0] : dflt;
  }
  bool boolean(cudnnBackendAttributeName_t n) const {
    const Attr* a = get(n);
    return a && a->as<bool>()[0];
  }
  template <class T> T value(cudnnBackendAttributeName_t n) const { return get(n)->as<T>()[0]; }
};

struct Handle {
  cudaStream_t stream = nullptr;
  int device = 0;
};
std::set<Handle*> g_handles;

size_t type_size(cudnnBackendAttributeType_t t) {
  switch (t) {
    case CUDNN_TYPE_HANDLE: return sizeof(cudnnHandle_t);
    case CUDNN_TYPE_DATA_TYPE: return sizeof(cudnnDataType_t);
    case CUDNN_TYPE_BOOLEAN: return sizeof(bool);
    case CUDNN_TYPE_INT64: return sizeof(int64_t);
    case CUDNN_TYPE_FLOAT: return sizeof(float);
    case CUDNN_TYPE_DOUBLE: return sizeof(double);
    case CUDNN_TYPE_VOID_PTR: return sizeof(void*);
    case CUDNN_TYPE_HEUR_MODE: return sizeof(cudnnBackendHeurMode_t);
    case CUDNN_TYPE_POINTWISE_MODE: return sizeof(cudnnPointwiseMode_t);
    case CUDNN_TYPE_BACKEND_DESCRIPTOR: return sizeof(cudnnBackendDescriptor_t);
    case CUDNN_TYPE_REDUCTION_OPERATOR_TYPE: return sizeof(cudnnReduceTensorOp_t);
    case CUDNN_TYPE_NUMERICAL_NOTE: return sizeof(cudnnBackendNumericalNote_t);
    default: return 0;
  }
}

// What each descriptor takes: attribute, type, most elements, required at finalize.
struct Schema {
  cudnnBackendAttributeName_t name;
  cudnnBackendAttributeType_t type;
  int64_t max;
  bool required;
};
const std::vector<Schema>* schema(cudnnBackendDescriptorType_t t) {
  static const std::map<cudnnBackendDescriptorType_t, std::vector<Schema>> s = {
      {CUDNN_BACKEND_TENSOR_DESCRIPTOR,
       {{CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, true},
        {CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 8, true},
        {CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 8, true},
        {CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, true},
        {CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, true},
        {CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, false},
        {CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, false}}},
      {CUDNN_BACKEND_MATMUL_DESCRIPTOR, {{CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, true}}},
      {CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR,
       {{CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true},
        {CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true},
        {CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true},
        {CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true}}},
      {CUDNN_BACKEND_POINTWISE_DESCRIPTOR,
       {{CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, true},
        {CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, true},
        {CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, false}}},
      {CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR,
       {{CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true},
        {CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true},
        {CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, false},
        {CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, false},
        {CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true}}},
      {CUDNN_BACKEND_REDUCTION_DESCRIPTOR,
       {{CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, true},
        {CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, true}}},
      {CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR,
       {{CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true},
        {CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true},
        {CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true}}},
      {CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR,
       {{CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true},
        {CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true}}},
      {CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR,
       {{CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, false},
        {CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1 << 16, true}}},
      {CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR,
       {{CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true},
        {CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, true}}},
      {CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, {}},
      {CUDNN_BACKEND_ENGINE_DESCRIPTOR, {}},
      {CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR,
       {{CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, false},
        {CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, true}}},
      {CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR,
       {{CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 1 << 16, true},
        {CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 1 << 16, true},
        {CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, false}}},
  };
  auto it = s.find(t);
  return it == s.end() ? nullptr : &it->second;
}

bool live(Obj* o) { return o && g_live.count(o); }

// A descriptor attribute that must name a finalized descriptor of `type`.
cudnnStatus_t need(const Obj* owner, cudnnBackendAttributeName_t n, cudnnBackendDescriptorType_t type, Obj** out,
                   const char* what) {
  Obj* o = owner->desc(n);
  if (!o) {
    *out = nullptr;
    return CUDNN_STATUS_SUCCESS;
  }
  if (!live(o)) return fail(CUDNN_STATUS_BAD_PARAM, std::string(what) + ": not a live descriptor");
  if (o->type != type) return fail(CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE, std::string(what) + ": wrong descriptor type");
  if (!o->finalized) return fail(CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED, std::string(what) + ": not finalized");
  *out = o;
  return CUDNN_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- tensors
struct TensorInfo {
  int64_t uid;
  cudnnDataType_t dt;
  std::vector<int64_t> dims, strides;
  bool is_virtual, by_value;
  int64_t align;
  int64_t extent() const {  // elements spanned: 1 + the largest offset
    int64_t e = 1;
    for (size_t i = 0; i < dims.size(); ++i) e += (dims[i] - 1) * strides[i];
    return e;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
};
TensorInfo info(const Obj* t) {
  TensorInfo i;
  i.uid = t->i64(CUDNN_ATTR_TENSOR_UNIQUE_ID);
  i.dt = t->value<cudnnDataType_t>(CUDNN_ATTR_TENSOR_DATA_TYPE);
  const Attr* d = t->get(CUDNN_ATTR_TENSOR_DIMENSIONS);
  const Attr* s = t->get(CUDNN_ATTR_TENSOR_STRIDES);
  i.dims.assign(d->as<int64_t>(), d->as<int64_t>() + d->count);
  i.strides.assign(s->as<int64_t>(), s->as<int64_t>() + s->count);
  i.is_virtual = t->boolean(CUDNN_ATTR_TENSOR_IS_VIRTUAL);
  i.by_value = t->boolean(CUDNN_ATTR_TENSOR_IS_BY_VALUE);
  i.align = t->i64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT);
  return i;
}
size_t dt_size(cudnnDataType_t dt) {
  switch (dt) {
    case CUDNN_DATA_FLOAT: case CUDNN_DATA_INT32: return 4;
    case CUDNN_DATA_BFLOAT16: return 2;
    case CUDNN_DATA_BOOLEAN: return 1;
    case CUDNN_DATA_INT64: return 8;
    default: return 0;
  }
}

cudnnStatus_t finalize_tensor(Obj* t) {
  const Attr* d = t->get(CUDNN_ATTR_TENSOR_DIMENSIONS);
  const Attr* s = t->get(CUDNN_ATTR_TENSOR_STRIDES);
  if (d->count != s->count)
    return fail(CUDNN_STATUS_BAD_PARAM, emu::strf("tensor: %lld dims but %lld strides", (long long)d->count,
                                                  (long long)s->count));
  for (int64_t i = 0; i < d->count; ++i)
    if (d->as<int64_t>()[i] < 1 || s->as<int64_t>()[i] < 1)
      return fail(CUDNN_STATUS_BAD_PARAM, emu::strf("tensor: dim %lld has size %lld stride %lld (both must be >= 1)",
                                                    (long long)i, (long long)d->as<int64_t>()[i],
                                                    (long long)s->as<int64_t>()[i]));
  const TensorInfo i = info(t);
  if (dt_size(i.dt) == 0) return fail(CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE, "tensor: data type not supported here");
  if (i.dims.size() != 4) return fail(CUDNN_STATUS_NOT_SUPPORTED, "tensor: the stand-in takes 4-D tensors");
  if (i.align < 1 || (i.align & (i.align - 1)) != 0)
    return fail(CUDNN_STATUS_BAD_PARAM, "tensor: byte alignment must be a power of two");
  if (i.is_virtual && i.by_value) return fail(CUDNN_STATUS_BAD_PARAM, "tensor: virtual and by value");
  return CUDNN_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- operations
// An input's dim may equal the output's, be 1 (broadcast) or, for matmul batch dims and reductions, divide it
// (grouped-query: kv head j serves query heads j*G .. j*G+G-1).
bool composes(int64_t in, int64_t out, bool grouped) { return in == out || in == 1 || (grouped && out % in == 0); }

cudnnStatus_t tensor_of(const Obj* op, cudnnBackendAttributeName_t n, Obj** out, const char* what) {
  return need(op, n, CUDNN_BACKEND_TENSOR_DESCRIPTOR, out, what);
}

cudnnStatus_t finalize_op(Obj* o) {
  cudnnStatus_t st;
  if (o->type == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR) {
    Obj *a, *b, *c, *m;
    if ((st = tensor_of(o, CUDNN_ATTR_OPERATION_MATMUL_ADESC, &a, "matmul A")) ||
        (st = tensor_of(o, CUDNN_ATTR_OPERATION_MATMUL_BDESC, &b, "matmul B")) ||
        (st = tensor_of(o, CUDNN_ATTR_OPERATION_MATMUL_CDESC, &c, "matmul C")) ||
        (st = need(o, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_BACKEND_MATMUL_DESCRIPTOR, &m, "matmul desc")))
      return st;
    TensorInfo A = info(a), B = info(b), C = info(c);
    bool ok = A.dims[3] == B.dims[2] && C.dims[2] == A.dims[2] && C.dims[3] == B.dims[3];
    for (int d = 0; d < 2; ++d) ok &= composes(A.dims[d], C.dims[d], true) && composes(B.dims[d], C.dims[d], true);
    if (!ok) return fail(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "matmul: A, B and C dims do not compose");
    return CUDNN_STATUS_SUCCESS;
  }
  if (o->type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR) {
    Obj *pw, *x, *b, *t, *y;
    if ((st = need(o, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, &pw,
                   "pointwise desc")) ||
        (st = tensor_of(o, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &x, "pointwise X")) ||
        (st = tensor_of(o, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &b, "pointwise B")) ||
        (st = tensor_of(o, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &t, "pointwise T")) ||
        (st = tensor_of(o, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &y, "pointwise Y")))
      return st;
    const auto mode = pw->value<cudnnPointwiseMode_t>(CUDNN_ATTR_POINTWISE_MODE);
    const bool binary = mode == CUDNN_POINTWISE_ADD || mode == CUDNN_POINTWISE_SUB || mode == CUDNN_POINTWISE_MUL ||
                        mode == CUDNN_POINTWISE_DIV || mode == CUDNN_POINTWISE_CMP_GE ||
                        mode == CUDNN_POINTWISE_BINARY_SELECT || mode == CUDNN_POINTWISE_LOGICAL_AND;
    const bool unary = mode == CUDNN_POINTWISE_EXP || mode == CUDNN_POINTWISE_LOG || mode == CUDNN_POINTWISE_GEN_INDEX;
    if (!binary && !unary) return fail(CUDNN_STATUS_NOT_SUPPORTED, "pointwise: mode not supported by the stand-in");
    if (binary != (b != nullptr)) return fail(CUDNN_STATUS_BAD_PARAM, "pointwise: B given iff the mode is binary");
    if ((mode == CUDNN_POINTWISE_BINARY_SELECT) != (t != nullptr))
      return fail(CUDNN_STATUS_BAD_PARAM, "pointwise: T given iff the mode is BINARY_SELECT");
    if (mode == CUDNN_POINTWISE_GEN_INDEX) {
      const int64_t axis = pw->i64(CUDNN_ATTR_POINTWISE_AXIS, -1);
      if (axis < 0 || axis > 3) return fail(CUDNN_STATUS_BAD_PARAM, "pointwise GEN_INDEX: axis unset or out of range");
    }
    const TensorInfo Y = info(y);
    for (Obj* in : {x, b, t}) {
      if (!in) continue;
      const TensorInfo I = info(in);
      for (int d = 0; d < 4; ++d)
        if (!composes(I.dims[d], Y.dims[d], false))
          return fail(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "pointwise: an input does not broadcast to Y");
    }
    return CUDNN_STATUS_SUCCESS;
  }
  if (o->type == CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR) {
    Obj *x, *y, *r;
    if ((st = tensor_of(o, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &x, "reduction X")) ||
        (st = tensor_of(o, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &y, "reduction Y")) ||
        (st = need(o, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, &r, "reduction desc")))
      return st;
    const auto op = r->value<cudnnReduceTensorOp_t>(CUDNN_ATTR_REDUCTION_OPERATOR);
    if (op != CUDNN_REDUCE_TENSOR_ADD && op != CUDNN_REDUCE_TENSOR_MAX)
      return fail(CUDNN_STATUS_NOT_SUPPORTED, "reduction: only ADD and MAX in the stand-in");
    const TensorInfo X = info(x), Y = info(y);
    for (int d = 0; d < 4; ++d)
      if (!(Y.dims[d] == X.dims[d] || Y.dims[d] == 1 || X.dims[d] % Y.dims[d] == 0))
        return fail(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "reduction: Y dims neither X's, 1, nor divide X's");
    return CUDNN_STATUS_SUCCESS;
  }
  if (o->type == CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR) {
    Obj *x, *y;
    if ((st = tensor_of(o, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &x, "reshape X")) ||
        (st = tensor_of(o, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &y, "reshape Y")))
      return st;
    if (info(x).numel() != info(y).numel() || info(x).extent() != info(y).extent())
      return fail(CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH, "reshape: X and Y differ in elements");
    return CUDNN_STATUS_SUCCESS;
  }
  return CUDNN_STATUS_SUCCESS;
}

// An operation's tensors: inputs, then the one output.
void op_tensors(const Obj* o, std::vector<Obj*>& in, Obj*& out) {
  in.clear();
  auto add = [&](cudnnBackendAttributeName_t n) {
    if (Obj* t = o->desc(n)) in.push_back(t);
  };
  switch (o->type) {
    case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR:
      add(CUDNN_ATTR_OPERATION_MATMUL_ADESC), add(CUDNN_ATTR_OPERATION_MATMUL_BDESC);
      out = o->desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC);
      break;
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
      add(CUDNN_ATTR_OPERATION_POINTWISE_XDESC), add(CUDNN_ATTR_OPERATION_POINTWISE_BDESC),
          add(CUDNN_ATTR_OPERATION_POINTWISE_TDESC);
      out = o->desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC);
      break;
    case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR:
      add(CUDNN_ATTR_OPERATION_REDUCTION_XDESC);
      out = o->desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC);
      break;
    default:
      add(CUDNN_ATTR_OPERATION_RESHAPE_XDESC);
      out = o->desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC);
  }
}

// The graph: every uid one tensor, every virtual tensor produced once and only read after, ops in an order that
// runs (the stand-in keeps the sorted order).
struct GraphInfo {
  std::vector<Obj*> order;
  std::map<int64_t, Obj*> external;  // non-virtual tensors by uid
  std::set<int64_t> outputs;         // non-virtual tensors written
};
std::map<Obj*, GraphInfo> g_graphs;

cudnnStatus_t finalize_graph(Obj* g) {
  const Attr* a = g->get(CUDNN_ATTR_OPERATIONGRAPH_OPS);
  std::vector<Obj*> ops(a->as<Obj*>(), a->as<Obj*>() + a->count);
  std::map<int64_t, Obj*> by_uid;
  std::map<int64_t, int> producers;
  GraphInfo gi;
  for (Obj* o : ops) {
    if (!live(o)) return fail(CUDNN_STATUS_BAD_PARAM, "graph: an op is not a live descriptor");
    if (o->type != CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR && o->type != CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR &&
        o->type != CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR && o->type != CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)
      return fail(CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE, "graph: an op of a kind the stand-in does not run");
    if (!o->finalized) return fail(CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED, "graph: an op is not finalized");
    std::vector<Obj*> in;
    Obj* out = nullptr;
    op_tensors(o, in, out);
    in.push_back(out);
    for (Obj* t : in) {
      const TensorInfo ti = info(t);
      auto [it, fresh] = by_uid.emplace(ti.uid, t);
      if (!fresh && it->second != t) {
        const TensorInfo other = info(it->second);
        if (other.dims != ti.dims || other.strides != ti.strides || other.dt != ti.dt ||
            other.is_virtual != ti.is_virtual)
          return fail(CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES,
                      emu::strf("graph: uid %lld names two different tensors", (long long)ti.uid));
      }
      if (!ti.is_virtual) gi.external[ti.uid] = t;
    }
    producers[info(out).uid]++;
    if (!info(out).is_virtual) gi.outputs.insert(info(out).uid);
    if (info(out).by_value) return fail(CUDNN_STATUS_BAD_PARAM, "graph: an op writes a by-value tensor");
  }
  for (auto [uid, n] : producers)
    if (n > 1) return fail(CUDNN_STATUS_BAD_PARAM, emu::strf("graph: tensor %lld written by %d ops", (long long)uid, n));
  // Topological order: an op runs when each virtual input is produced.
  std::set<int64_t> ready;
  std::vector<bool> done(ops.size());
  for (size_t pass = 0; pass < ops.size(); ++pass) {
    bool progress = false;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (done[i]) continue;
      std::vector<Obj*> in;
      Obj* out = nullptr;
      op_tensors(ops[i], in, out);
      bool ok = true;
      for (Obj* t : in) {
        const TensorInfo ti = info(t);
        if (ti.is_virtual && !ready.count(ti.uid)) {
          if (!producers.count(ti.uid))
            return fail(CUDNN_STATUS_BAD_PARAM, emu::strf("graph: virtual tensor %lld is read but never written",
                                                          (long long)ti.uid));
          ok = false;
        }
      }
      if (!ok) continue;
      done[i] = true, progress = true;
      ready.insert(info(out).uid);
      gi.order.push_back(ops[i]);
    }
    if (!progress) break;
  }
  if (gi.order.size() != ops.size()) return fail(CUDNN_STATUS_BAD_PARAM, "graph: a cycle");
  g_graphs[g] = std::move(gi);
  return CUDNN_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- execution
struct Value {
  TensorInfo t;
  std::vector<double> mem;  // laid out by t's strides, extent() elements
  double at(const int64_t* idx) const {
    int64_t off = 0;
    for (int d = 0; d < 4; ++d) off += (t.dims[d] == 1 ? 0 : idx[d]) * t.strides[d];
    return mem[size_t(off)];
  }
};

// The index of an input dim for an output index: equal, broadcast (1) or grouped (the input divides the output).
int64_t in_index(int64_t out_idx, int64_t in_dim, int64_t out_dim) {
  if (in_dim == out_dim) return out_idx;
  if (in_dim == 1) return 0;
  return out_idx / (out_dim / in_dim);
}

template <class F> void for_each(const std::vector<int64_t>& dims, F f) {
  int64_t i[4];
  for (i[0] = 0; i[0] < dims[0]; ++i[0])
    for (i[1] = 0; i[1] < dims[1]; ++i[1])
      for (i[2] = 0; i[2] < dims[2]; ++i[2])
        for (i[3] = 0; i[3] < dims[3]; ++i[3]) f(i);
}
int64_t offset(const TensorInfo& t, const int64_t* i) {
  int64_t off = 0;
  for (int d = 0; d < 4; ++d) off += i[d] * t.strides[d];
  return off;
}

Value run_op(const Obj* o, const std::map<int64_t, Value>& vals) {
  std::vector<Obj*> in;
  Obj* out = nullptr;
  op_tensors(o, in, out);
  Value y{info(out), {}};
  y.mem.assign(size_t(y.t.extent()), 0.0);
  auto val = [&](Obj* t) -> const Value& { return vals.at(info(t).uid); };
  if (o->type == CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR) {
    const Value &A = val(in[0]), &B = val(in[1]);
    const int64_t K = A.t.dims[3];
    for_each(y.t.dims, [&](const int64_t* i) {
      int64_t ia[4] = {in_index(i[0], A.t.dims[0], y.t.dims[0]), in_index(i[1], A.t.dims[1], y.t.dims[1]), i[2], 0};
      int64_t ib[4] = {in_index(i[0], B.t.dims[0], y.t.dims[0]), in_index(i[1], B.t.dims[1], y.t.dims[1]), 0, i[3]};
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        ia[3] = k, ib[2] = k;
        acc += A.at(ia) * B.at(ib);
      }
      y.mem[size_t(offset(y.t, i))] = acc;
    });
  } else if (o->type == CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR) {
    const Obj* pw = o->desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR);
    const auto mode = pw->value<cudnnPointwiseMode_t>(CUDNN_ATTR_POINTWISE_MODE);
    const int64_t axis = pw->i64(CUDNN_ATTR_POINTWISE_AXIS, -1);
    std::vector<const Value*> ins;
    for (Obj* t : in) ins.push_back(&val(t));
    for_each(y.t.dims, [&](const int64_t* i) {
      double a[3] = {0, 0, 0};
      for (size_t k = 0; k < ins.size(); ++k) {
        int64_t j[4];
        for (int d = 0; d < 4; ++d) j[d] = in_index(i[d], ins[k]->t.dims[d], y.t.dims[d]);
        a[k] = ins[k]->at(j);
      }
      double r = 0;
      switch (mode) {
        case CUDNN_POINTWISE_ADD: r = a[0] + a[1]; break;
        case CUDNN_POINTWISE_SUB: r = a[0] - a[1]; break;
        case CUDNN_POINTWISE_MUL: r = a[0] * a[1]; break;
        case CUDNN_POINTWISE_DIV: r = a[0] / a[1]; break;
        case CUDNN_POINTWISE_EXP: r = std::exp(a[0]); break;
        case CUDNN_POINTWISE_LOG: r = std::log(a[0]); break;
        case CUDNN_POINTWISE_CMP_GE: r = a[0] >= a[1] ? 1 : 0; break;
        case CUDNN_POINTWISE_LOGICAL_AND: r = a[0] != 0 && a[1] != 0 ? 1 : 0; break;
        case CUDNN_POINTWISE_BINARY_SELECT: r = a[2] != 0 ? a[0] : a[1]; break;
        case CUDNN_POINTWISE_GEN_INDEX: r = double(i[axis]); break;
        default: break;
      }
      y.mem[size_t(offset(y.t, i))] = r;
    });
  } else if (o->type == CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR) {
    const Obj* r = o->desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC);
    const bool max = r->value<cudnnReduceTensorOp_t>(CUDNN_ATTR_REDUCTION_OPERATOR) == CUDNN_REDUCE_TENSOR_MAX;
    const Value& X = val(in[0]);
    std::vector<bool> seen(y.mem.size());
    for_each(X.t.dims, [&](const int64_t* i) {
      int64_t j[4];
      for (int d = 0; d < 4; ++d) j[d] = y.t.dims[d] == X.t.dims[d] ? i[d] : y.t.dims[d] == 1 ? 0 : i[d] / (X.t.dims[d] / y.t.dims[d]);
      const size_t off = size_t(offset(y.t, j));
      const double x = X.at(i);
      y.mem[off] = !seen[off] ? x : max ? std::max(y.mem[off], x) : y.mem[off] + x;
      seen[off] = true;
    });
  } else {  // reshape: the same memory image seen through Y's dims and strides
    y.mem = val(in[0]).mem;
  }
  return y;
}

double load(const void* p, cudnnDataType_t dt) {
  switch (dt) {
    case CUDNN_DATA_FLOAT: return *static_cast<const float*>(p);
    case CUDNN_DATA_INT32: return *static_cast<const int32_t*>(p);
    case CUDNN_DATA_INT64: return double(*static_cast<const int64_t*>(p));
    case CUDNN_DATA_BOOLEAN: return *static_cast<const bool*>(p);
    default: return float(*static_cast<const mt::bf16*>(p));
  }
}
void store(void* p, cudnnDataType_t dt, double v) {
  switch (dt) {
    case CUDNN_DATA_FLOAT: *static_cast<float*>(p) = float(v); break;
    case CUDNN_DATA_INT32: *static_cast<int32_t*>(p) = int32_t(v); break;
    case CUDNN_DATA_INT64: *static_cast<int64_t*>(p) = int64_t(v); break;
    case CUDNN_DATA_BOOLEAN: *static_cast<bool*>(p) = v != 0; break;
    default: *static_cast<mt::bf16*>(p) = mt::bf16(float(v));  // f64 -> f32 exact enough, then nearest even
  }
}

cudnnStatus_t execute(Handle* h, Obj* plan, Obj* vp) {
  const char* call = "cudnnBackendExecute";
  Obj* cfg = plan->desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG);
  auto git = g_graphs.find(cfg->graph);
  if (!cfg->graph || git == g_graphs.end()) return fail(CUDNN_STATUS_BAD_PARAM, "execute: the plan's graph is gone");
  const GraphInfo& g = git->second;
  const Attr* uids = vp->get(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS);
  const Attr* ptrs = vp->get(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS);
  std::map<int64_t, void*> bound;
  for (int64_t i = 0; i < uids->count; ++i) bound[uids->as<int64_t>()[i]] = ptrs->as<void*>()[i];
  for (auto& [uid, t] : g.external)
    if (!bound.count(uid))
      return fail(CUDNN_STATUS_BAD_PARAM, emu::strf("execute: tensor uid %lld is not in the variant pack", (long long)uid));
  void* ws = nullptr;
  if (const Attr* w = vp->get(CUDNN_ATTR_VARIANT_PACK_WORKSPACE)) ws = w->as<void*>()[0];
  if (!ws || !emu::check_device_range(ws, kWorkspace, call, "workspace (smaller than the plan's workspace size)"))
    return fail(CUDNN_STATUS_BAD_PARAM, "execute: no workspace of the plan's size");
  // Inputs read (and checked) first, outputs checked; then the graph runs and the outputs are written.
  std::map<int64_t, Value> vals;
  for (auto& [uid, t] : g.external) {
    const TensorInfo ti = info(t);
    void* p = bound[uid];
    if (!p) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, emu::strf("execute: uid %lld is null", (long long)uid));
    if (ti.by_value) {
      vals[uid] = Value{ti, {load(p, ti.dt)}};
      continue;
    }
    if (reinterpret_cast<uintptr_t>(p) % uintptr_t(ti.align) != 0)
      return fail(CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER,
                  emu::strf("execute: uid %lld is not aligned to %lld bytes", (long long)uid, (long long)ti.align));
    const size_t bytes = size_t(ti.extent()) * dt_size(ti.dt);
    const std::string what = emu::strf("tensor uid %lld (its dims and strides span %zu bytes)", (long long)uid, bytes);
    if (!emu::check_device_range(p, bytes, call, what.c_str()))
      return fail(CUDNN_STATUS_EXECUTION_FAILED, "execute: " + what + " runs past its allocation");
    const bool out = g.outputs.count(uid) > 0;
    if (!(out ? emu::note_write(p, bytes, h->stream, call) : emu::note_read(p, bytes, h->stream, call)))
      return fail(CUDNN_STATUS_EXECUTION_FAILED, "execute: stream order");
    if (out) continue;
    Value v{ti, std::vector<double>(size_t(ti.extent()), 0.0)};
    for_each(ti.dims, [&](const int64_t* i) {
      const int64_t off = offset(ti, i);
      v.mem[size_t(off)] = load(static_cast<const char*>(p) + off * int64_t(dt_size(ti.dt)), ti.dt);
    });
    vals[uid] = std::move(v);
  }
  if (!emu::note_write(ws, kWorkspace, h->stream, call)) return fail(CUDNN_STATUS_EXECUTION_FAILED, "workspace order");
  for (Obj* o : g.order) {
    Value y = run_op(o, vals);
    const int64_t uid = y.t.uid;
    if (!y.t.is_virtual) {
      char* p = static_cast<char*>(bound[uid]);
      for_each(y.t.dims, [&](const int64_t* i) {
        const int64_t off = offset(y.t, i);
        store(p + off * int64_t(dt_size(y.t.dt)), y.t.dt, y.mem[size_t(off)]);
      });
    }
    vals[uid] = std::move(y);
  }
  return CUDNN_STATUS_SUCCESS;
}

}  // namespace

extern "C" {

size_t cudnnGetVersion(void) { return CUDNN_VERSION; }

const char* cudnnGetErrorString(cudnnStatus_t status) {
  switch (status) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_BAD_PARAM_NULL_POINTER: return "CUDNN_STATUS_BAD_PARAM_NULL_POINTER";
    case CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER: return "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER";
    case CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED: return "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED";
    case CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH: return "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH";
    case CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES: return "CUDNN_STATUS_BAD_PARAM_DUPLICATED_ENTRIES";
    case CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE: return "CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE";
    case CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE: return "CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE";
    case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
    case CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE: return "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE";
    case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
    case CUDNN_STATUS_ALLOC_FAILED: return "CUDNN_STATUS_ALLOC_FAILED";
    default: return "CUDNN_STATUS_UNKNOWN (stand-in)";
  }
}

void cudnnGetLastErrorString(char* message, size_t max_size) {
  std::lock_guard lock(g_mu);
  if (max_size == 0) return;
  std::snprintf(message, max_size, "%s", g_last_error.c_str());
  g_last_error.clear();
}

cudnnStatus_t cudnnCreate(cudnnHandle_t* handle) {
  if (!handle) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  std::lock_guard lock(g_mu);
  auto* h = new Handle{nullptr, emu::current_device()};
  g_handles.insert(h);
  *handle = reinterpret_cast<cudnnHandle_t>(h);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
  std::lock_guard lock(g_mu);
  auto* h = reinterpret_cast<Handle*>(handle);
  if (!g_handles.erase(h)) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnDestroy: not a live handle");
  delete h;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t stream) {
  std::lock_guard lock(g_mu);
  auto* h = reinterpret_cast<Handle*>(handle);
  if (!g_handles.count(h)) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnSetStream: not a live handle");
  if (!emu::check_stream(stream, "cudnnSetStream")) return fail(CUDNN_STATUS_BAD_PARAM, "cudnnSetStream: bad stream");
  h->stream = stream;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t* d) {
  if (!d) return CUDNN_STATUS_BAD_PARAM_NULL_POINTER;
  if (!schema(type)) return fail(CUDNN_STATUS_NOT_SUPPORTED, "create: a descriptor type the stand-in does not take");
  std::lock_guard lock(g_mu);
  auto* o = new Obj;
  o->type = type;
  g_live.insert(o);
  *d = reinterpret_cast<cudnnBackendDescriptor_t>(o);
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t d) {
  std::lock_guard lock(g_mu);
  auto* o = reinterpret_cast<Obj*>(d);
  if (!g_live.erase(o)) return fail(CUDNN_STATUS_BAD_PARAM, "destroy: not a live descriptor");
  g_graphs.erase(o);
  delete o;
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                                       cudnnBackendAttributeType_t type, int64_t count, const void* values) {
  std::lock_guard lock(g_mu);
  auto* o = reinterpret_cast<Obj*>(d);
  if (!live(o)) return fail(CUDNN_STATUS_BAD_PARAM, "set: not a live descriptor");
  if (o->finalized) return fail(CUDNN_STATUS_BAD_PARAM, "set: the descriptor is finalized");
  if (!values) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "set: null values");
  for (const Schema& s : *schema(o->type)) {
    if (s.name != name) continue;
    if (s.type != type)
      return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE, emu::strf("set: attribute %d takes type %d, not %d",
                                                                   int(name), int(s.type), int(type)));
    if (count < 1 || count > s.max)
      return fail(CUDNN_STATUS_BAD_PARAM, emu::strf("set: attribute %d takes 1..%lld elements, not %lld", int(name),
                                                    (long long)s.max, (long long)count));
    Attr a{type, {}, count};
    const char* v = static_cast<const char*>(values);
    a.bytes.assign(v, v + size_t(count) * type_size(type));
    o->attrs[name] = std::move(a);
    return CUDNN_STATUS_SUCCESS;
  }
  return fail(CUDNN_STATUS_BAD_PARAM, emu::strf("set: attribute %d does not belong to descriptor type %d", int(name),
                                                int(o->type)));
}

cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t d) {
  std::lock_guard lock(g_mu);
  auto* o = reinterpret_cast<Obj*>(d);
  if (!live(o)) return fail(CUDNN_STATUS_BAD_PARAM, "finalize: not a live descriptor");
  if (o->finalized) return fail(CUDNN_STATUS_BAD_PARAM, "finalize: already finalized");
  for (const Schema& s : *schema(o->type))
    if (s.required && !o->get(s.name))
      return fail(CUDNN_STATUS_BAD_PARAM, emu::strf("finalize: required attribute %d is unset", int(s.name)));
  cudnnStatus_t st = CUDNN_STATUS_SUCCESS;
  switch (o->type) {
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR: st = finalize_tensor(o); break;
    case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: st = finalize_op(o); break;
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR: st = finalize_graph(o); break;
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR: {
      Obj* g;
      st = need(o, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &g, "heur graph");
      o->graph = g;
      break;
    }
    case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINE_DESCRIPTOR:
      if (!o->graph) st = fail(CUDNN_STATUS_NOT_SUPPORTED, "finalize: engine configs come from the heuristics here");
      break;
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: {
      Obj* c;
      st = need(o, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &c, "plan engine config");
      break;
    }
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR: {
      const Attr* u = o->get(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS);
      const Attr* p = o->get(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS);
      if (u->count != p->count) st = fail(CUDNN_STATUS_BAD_PARAM, "variant pack: uids and pointers differ in number");
      std::set<int64_t> seen;
      for (int64_t i = 0; st == CUDNN_STATUS_SUCCESS && i < u->count; ++i)
        if (!seen.insert(u->as<int64_t>()[i]).second)
          st = fail(CUDNN_STATUS_BAD_PARAM, "variant pack: a uid bound twice");
      break;
    }
    default: break;
  }
  if (st == CUDNN_STATUS_SUCCESS) o->finalized = true;
  return st;
}

cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const d, cudnnBackendAttributeName_t name,
                                       cudnnBackendAttributeType_t type, int64_t requested, int64_t* count,
                                       void* values) {
  std::lock_guard lock(g_mu);
  auto* o = reinterpret_cast<Obj*>(d);
  if (!live(o)) return fail(CUDNN_STATUS_BAD_PARAM, "get: not a live descriptor");
  if (!o->finalized) return fail(CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED, "get: the descriptor is not finalized");
  if (!count) return fail(CUDNN_STATUS_BAD_PARAM_NULL_POINTER, "get: null count");
  // The heuristics' one result: the stand-in's reference engine; its config and engine serve the graph.
  if (o->type == CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR && name == CUDNN_ATTR_ENGINEHEUR_RESULTS) {
    if (type != CUDNN_TYPE_BACKEND_DESCRIPTOR) return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE, "get: results type");
    *count = requested > 0 ? 1 : 1;
    if (requested > 0) {
      auto* cfg = static_cast<Obj**>(values)[0];
      if (!live(cfg) || cfg->type != CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)
        return fail(CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE, "get: results need created ENGINECFG descriptors");
      cfg->graph = o->graph, cfg->finalized = true;
    }
    return CUDNN_STATUS_SUCCESS;
  }
  if (o->type == CUDNN_BACKEND_ENGINECFG_DESCRIPTOR && name == CUDNN_ATTR_ENGINECFG_ENGINE) {
    if (type != CUDNN_TYPE_BACKEND_DESCRIPTOR || requested < 1)
      return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE, "get: engine type");
    auto* eng = static_cast<Obj**>(values)[0];
    if (!live(eng) || eng->type != CUDNN_BACKEND_ENGINE_DESCRIPTOR)
      return fail(CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE, "get: the engine needs a created ENGINE descriptor");
    eng->graph = o->graph, eng->finalized = true;
    *count = 1;
    return CUDNN_STATUS_SUCCESS;
  }
  if (o->type == CUDNN_BACKEND_ENGINE_DESCRIPTOR && name == CUDNN_ATTR_ENGINE_NUMERICAL_NOTE) {
    if (type != CUDNN_TYPE_NUMERICAL_NOTE) return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE, "get: note type");
    // The reference engine is deterministic; MT_CUDNN_EMU_NONDETERMINISTIC=1 makes it say otherwise (to test
    // attention.deterministic's engine filter).
    const char* e = std::getenv("MT_CUDNN_EMU_NONDETERMINISTIC");
    *count = e && *e == '1' ? 1 : 0;
    if (*count && requested > 0)
      static_cast<cudnnBackendNumericalNote_t*>(values)[0] = CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
    return CUDNN_STATUS_SUCCESS;
  }
  if (o->type == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR && name == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE) {
    if (type != CUDNN_TYPE_INT64 || requested < 1) return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE, "get: workspace");
    *static_cast<int64_t*>(values) = kWorkspace;
    *count = 1;
    return CUDNN_STATUS_SUCCESS;
  }
  const Attr* a = o->get(name);
  if (!a) return fail(CUDNN_STATUS_BAD_PARAM, emu::strf("get: attribute %d is not set", int(name)));
  if (a->type != type) return fail(CUDNN_STATUS_BAD_PARAM_ATTRIBUTE_TYPE, "get: wrong type");
  *count = a->count;
  if (values) std::memcpy(values, a->bytes.data(), size_t(std::min(requested, a->count)) * type_size(type));
  return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t plan_d,
                                  cudnnBackendDescriptor_t vp_d) {
  std::lock_guard lock(g_mu);
  auto* h = reinterpret_cast<Handle*>(handle);
  auto* plan = reinterpret_cast<Obj*>(plan_d);
  auto* vp = reinterpret_cast<Obj*>(vp_d);
  if (!g_handles.count(h)) return fail(CUDNN_STATUS_BAD_PARAM, "execute: not a live handle");
  if (!live(plan) || plan->type != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)
    return fail(CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE, "execute: not an execution plan");
  if (!live(vp) || vp->type != CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)
    return fail(CUDNN_STATUS_BAD_PARAM_DESCRIPTOR_TYPE, "execute: not a variant pack");
  if (!plan->finalized || !vp->finalized)
    return fail(CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED, "execute: the plan or the variant pack is not finalized");
  if (Obj* cfg = plan->desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG); cfg && g_graphs.count(cfg->graph)) {
    // In a stream capture: this execution at each replay, on the handle's stream now, with a copy of the variant
    // pack whose by-value scalars (host memory, read when called) are the copy's own bytes, as they are now.
    auto pack = std::make_shared<Obj>(*vp);
    auto scalars = std::make_shared<std::vector<double>>();
    const Attr* uids = vp->get(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS);
    Attr& ptrs = pack->attrs[CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS];
    const GraphInfo& g = g_graphs.at(cfg->graph);
    scalars->reserve(size_t(uids->count));
    for (int64_t i = 0; i < uids->count; ++i) {
      auto t = g.external.find(uids->as<int64_t>()[i]);
      if (t == g.external.end() || !info(t->second).by_value) continue;
      void*& p = reinterpret_cast<void**>(ptrs.bytes.data())[i];
      scalars->push_back(0.0);
      std::memcpy(&scalars->back(), p, dt_size(info(t->second).dt));
      p = &scalars->back();
    }
    Handle hc = *h;
    if (emu::record_if_capturing(h->stream, [hc, plan, pack, scalars]() mutable {
          std::lock_guard lock(g_mu);
          execute(&hc, plan, pack.get());
        }))
      return CUDNN_STATUS_SUCCESS;
  }
  return execute(h, plan, vp);
}

}  // extern "C"
