// Where a run starts: a checkpoint to resume (checkpoint.resume: auto tries the newest complete one first and falls
// back past a damaged one, naming the file), else model.init_from's Hugging Face weights, else the random init;
// and the checks before the first step that a long run must not meet hours later (checkpoint.dir writable).
#pragma once
#include <string>

#include "comm/env.h"
#include "runtime/train/run.h"

namespace mt {

// Collective. Sets run.start_step and run.resumed_from; draws the random init make_train_run left (init_later) when
// no checkpoint is loaded; returns the seconds spent verifying and loading (or drawing).
double resume_or_init(const Config& cfg, const MpiEnv& env, TrainRun& run);

// checkpoint.dir takes files (rank 0 tries; every rank gets its answer and stops with the same message), and a
// partial save an earlier run left there is removed. Collective; nothing without a checkpoint.dir.
void check_checkpoint_dir_writable(const std::string& dir, const MpiEnv& env);

}  // namespace mt
