// Pipeline-parallel schedules: for each pp rank, the list of actions it runs in one step, built once
// from (schedule, p ranks, v model chunks per rank, m micro-batches) and checked before anything runs: every
// (stage, micro-batch) has its forward and its backward exactly once, every send has its receive, each action's
// inputs exist before it, and the ranks cannot deadlock. A simulator with per-action costs gives each rank's idle
// time (the bubble), the makespan and the activations held, which the tests compare with the formulas.
//
// Stages: S = p * v consecutive parts of the model; stage s runs on pp rank s % p as its chunk s / p (v = 1: stage
// s is rank s). Forward goes from stage 0 to S-1, backward from S-1 to 0.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "comm/comm_bytes.h"

namespace mt {

enum class PpOp {
  forward,          // F: the stage's forward of a micro-batch (keeps what backward needs)
  backward,         // B: input gradient and weight gradients together (gpipe, 1f1b, interleaved_1f1b)
  backward_input,   // B of zb1p: the input gradient only (on the critical path)
  backward_weight,  // W of zb1p: the weight gradients, deferred into the bubble
  send_act,         // the forward's output to the next stage
  recv_act,         // the previous stage's output
  send_grad,        // the backward's input gradient to the previous stage
  recv_grad,        // the next stage's input gradient
};
const char* pp_op_name(PpOp op);

struct PpAction {
  PpOp op;
  int stage = 0;  // the stage the action belongs to (for sends and receives: this rank's stage)
  int micro = 0;
  int peer = -1;  // sends and receives: the pp rank of the other stage
  bool operator==(const PpAction&) const = default;
};

struct PpSchedule {
  std::string kind;  // gpipe | 1f1b | interleaved_1f1b | zb1p
  int p = 1, v = 1, m = 1;
  std::vector<std::vector<PpAction>> ranks;  // [pp rank] -> its actions in order
  int stages() const { return p * v; }
  int rank_of(int stage) const { return stage % p; }
};

// The schedule names parallel.pp_schedule accepts.
const std::vector<std::string>& pp_schedule_kinds();
// Builds and checks (check_pp_schedule) the schedule. Errors name the keys: an unknown parallel.pp_schedule, v > 1
// outside interleaved_1f1b (parallel.pp_virtual), and too few micro-batches for the schedule
// (training.micro_batch_size: interleaved_1f1b needs m a multiple of p).
PpSchedule build_pp_schedule(const std::string& kind, int p, int v, int m);
// Every (stage, micro-batch) has its forward and its backward (or its backward_input and backward_weight) exactly
// once and on the stage's rank; each send has exactly one matching receive; each action's inputs come first on
// its rank; and running the lists with blocking receives cannot deadlock. An error names the rank and action.
void check_pp_schedule(const PpSchedule& s);

// Costs of one action of one stage, in any unit.
struct PpCosts {
  double forward = 1, backward = 2;                 // backward = input + weight gradient
  double backward_input = 1, backward_weight = 1;   // zb1p's halves
  double transfer = 0;                              // a send's latency to its receive
};
struct PpSimulation {
  double makespan = 0;                 // the step
  std::vector<double> busy, idle;      // per rank: compute time, and makespan - busy
  std::vector<int> peak_activations;   // per rank: micro-batches whose forward ran and whose backward has not
  double bubble() const;               // mean over the ranks of idle / busy (the textbook bubble ratio)
};
// Runs the lists: an action starts when its rank is free and its input has arrived (sends do not block).
PpSimulation simulate_pp_schedule(const PpSchedule& s, const PpCosts& c = {});
// Whether a step runs the action: every action in training; in evaluation (forward_only) the forwards and the
// activations' transfers alone. The executor and the simulations below share this rule.
bool pp_runs(const PpAction& a, bool forward_only);
// The lists under NCCL's rules, as the executor issues them (runtime/train/pipeline.cpp): consecutive transfers form
// one batch (one ncclGroupStart/End), which completes only once every peer has posted the other half of each of its
// messages, and nothing after it on the rank runs before (the stream's order); a peer pairs a rank's messages in
// issue order. forward_only: the forwards and activations alone (evaluation). Returns why the lists would hang
// ("rank 0 waits in the batch [send_grad(stage 2, micro 0, peer rank 1)]; ..." or a pair's messages in another
// order), or "" when they run to the end. MPI's non-blocking transfers need only simulate_pp_schedule's rule.
std::string pp_batches_deadlock(const PpSchedule& s, bool forward_only);
// The same step's lists re-placed for NCCL in lockstep (forward_only: the forwards and activations alone): the lists
// run with every action taking one unit of time, each message sent when its producer ends and received at that same
// time by its consumer (at most one unit later, posted ahead), a time's messages in one order on both sides. Every
// batch then meets its peers' halves at the same time, so the lists pass pp_batches_deadlock (each rank's computes
// keep their order). For schedules whose own lists would hang there (interleaved_1f1b).
PpSchedule pp_lockstep_lists(const PpSchedule& s, bool forward_only);
// The textbook bubble of a schedule, idle time over compute time per rank: (p-1)/m for gpipe and 1f1b, (p-1)/(v m)
// for interleaved_1f1b, and about (p-1)/(3m) for zb1p with equal F, B and W times.
double pp_bubble_formula(const std::string& kind, int p, int v, int m);

// The boundary tensors one pp rank sends in a step: an activation per micro-batch for each of its stages but the
// last, a gradient for each but the first (and receives as many).
int64_t pp_step_sends(const PpSchedule& s, int pp_rank);
// The same as the step's collectives (comm_bytes.h) on the pp group: sends of message_bytes each, and the receives
// counted with no bytes; tag: the executor's (runtime/train/pipeline.h's kPpTag).
std::vector<CommBytes> pp_step_bytes(const PpSchedule& s, int pp_rank, double message_bytes, const std::string& tag);

// Stage assignment: how many consecutive decoder layers each of `stages` stages owns. Stage 0 also runs the
// embedding and the last stage the final norm, lm_head and the loss; their costs are given in decoder layers
// (from FLOPs: lm_head's 6 V d per token against a layer's). With `explicit_split` (parallel.pp_layers) that split
// is checked and returned; otherwise the split minimises the most expensive stage (ties: earlier stages get fewer
// layers). Errors name parallel.pp, parallel.pp_virtual, parallel.pp_layers and model.n_layers: more stages
// than layers, an explicit split of another length, or one that does not sum to n_layers.
std::vector<int> pp_layer_split(int64_t n_layers, int stages, double first_extra, double last_extra,
                                const std::vector<int>& explicit_split = {});

// The part of the model one stage runs.
struct ModelChunk {
  int stage = 0;
  int64_t layer_begin = 0, layer_end = 0;  // decoder layers [begin, end), named by their global index
  bool first = false;  // runs the embedding: its input is the tokens
  bool last = false;   // runs the final norm and the output projection: its output is the logits
};
// The chunks pp rank `rank` runs (stages rank, rank + p, ...), in stage order, from a layer split over p * v stages.
std::vector<ModelChunk> pp_rank_chunks(const std::vector<int>& split, int p, int v, int rank);

// One line per rank, e.g. "rank 0: F0 F1 F2 B0 F3 B1 ..." (the plan printer's timeline).
std::string pp_schedule_str(const PpSchedule& s);

}  // namespace mt
