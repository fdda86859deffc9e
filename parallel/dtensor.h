// DTensor: a local Tensor plus the spec saying which part of the global
// tensor it is, on a live DeviceMesh. Free functions make, move and gather them.
#pragma once
#include <map>
#include <optional>
#include <string>

#include "comm/comm_counters.h"
#include "comm/mesh.h"
#include "parallel/planner.h"

namespace mt {

struct DTensor {
  Tensor local;
  DTensorSpec spec;
  DeviceMesh mesh;
  const Placements& placements() const { return spec.placements; }
  const Shape& shape() const { return spec.global_shape; }
};

struct RedistributeOptions {
  Planner planner = Planner::min_cost;
  std::vector<double> link_gbps;  // comm.link_gbps; empty: defaults
};

// With src_rank, rank src_rank's `full` is broadcast first (the others' may be
// undefined); without, every rank holds the same full tensor and keeps its
// part with no communication. Partial placements take the value as
// Replicate -> Partial does.
DTensor distribute_tensor(const Tensor& full, const DeviceMesh& mesh, const Placements& placements,
                          std::optional<int> src_rank = std::nullopt, const ShardOrder& order = {});
// Wraps this rank's local tensor. Without global_shape it is inferred as
// DTensor does (even shards: local size x shard count); check = true gathers
// every rank's local shape and verifies it (collective).
DTensor from_local(const Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                   std::optional<Shape> global_shape = std::nullopt, bool check = false, const ShardOrder& order = {});
// The whole tensor on every rank (redistributes to all-Replicate).
Tensor full_tensor(const DTensor& t, const RedistributeOptions& opts = {});

DTensor redistribute(const DTensor& t, const Placements& placements, const RedistributeOptions& opts = {},
                     const ShardOrder& order = {});
DTensor redistribute(const DTensor& t, const DTensorSpec& target, const RedistributeOptions& opts = {});

// The gradient rule of redistribute, one for every caller (redistribute_backward
// and the parallel styles' layout hooks): the gradient of y = redistribute(x, ...)
// goes back to x's placement on each mesh dim, with Partial replaced by
// Replicate. A partial x's gradient is the same on every rank (each term of the
// sum moves the sum alike); a replicated x is one value whose gradient is the
// sum of every rank's part, so a Partial gradient is all-reduced to Replicate.
// A module input that stays a distributed tensor with no redistribute keeps its
// Partial gradient (there is no redistribute to differentiate).
Placement redistribute_grad_placement(const Placement& source);
Placements redistribute_backward_placements(const Placements& source);
DTensor redistribute_backward(const DTensor& grad_out, const DTensorSpec& source, const RedistributeOptions& opts = {});

}  // namespace mt
