// AdamW on fp32 master weights (ops.h adamw_step; declared in runtime/kernels/cpu/adamw.cpp), PyTorch's order
// of operations; the bf16 compute copy written in the same pass.
#include <cmath>

#include "runtime/kernels/cuda/common.cuh"

namespace mt::cuda {

namespace {

// p, g, m, v (n) f32; p_lowp (n) bf16 or null. hyper (4) f32 or null: the step's scalars read on the device
// instead of the arguments (decay, step_size, bc2_sqrt, then the clip scale the gradient is multiplied by, as
// clip_grads' scale_ would: a CUDA graph's replays, whose arguments are the capture's).
__global__ void adamw_k(float* p, __nv_bfloat16* p_lowp, const float* g, float* m, float* v, int64_t n, float decay,
                        float b1, float b2, float step_size, float bc2_sqrt, float eps, const float* hyper) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float gi = g[i];
  if (hyper) decay = hyper[0], step_size = hyper[1], bc2_sqrt = hyper[2], gi *= hyper[3];
  float pi = p[i] * decay;
  float mi = m[i] + (1.0f - b1) * (gi - m[i]);
  float vi = v[i] * b2 + (1.0f - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  pi -= step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
  p[i] = pi;
  if (p_lowp) p_lowp[i] = __float2bfloat16_rn(pi);  // the compute copy, written in the same pass
}

}  // namespace

int adamw(float* param, bf16* param_lowp, const float* grad, float* m, float* v, int64_t n, double lr, double beta1,
          double beta2, double eps, double weight_decay, int64_t step, void* stream, const float* hyper) {
  Range r("adamw");
  if (n == 0) return 0;
  float step_size = float(lr / (1.0 - std::pow(beta1, double(step))));
  float bc2_sqrt = float(std::sqrt(1.0 - std::pow(beta2, double(step))));
  MT_LAUNCH(adamw_k, blocks_for(n), kThreads, 0, st(stream), param, dp(param_lowp), grad, m, v, n,
            float(1.0 - lr * weight_decay), float(beta1), float(beta2), step_size, bc2_sqrt, float(eps), hyper);
  return last_error();
}

}  // namespace mt::cuda
