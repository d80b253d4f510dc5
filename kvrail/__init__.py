"""kvrail: a Kubernetes-native control plane for disaggregated LLM inference.

This package is the contract shared by every component: CRD models, wire messages, block hashing,
the model fingerprint, the etcd registry and NATS clients, settings, metric names and the CLI. It
imports no component (import-linter enforces it).
"""

import os

__version__ = "0.1.0"

# gRPC (the etcd client's transport) would otherwise run its fork handlers in every child that
# `subprocess` forks: one deadlocked in a test run's child, between fork and exec, holding the
# run for minutes (grpc/grpc#22624 describes the same). kvrail always runs a program right after
# forking and never uses gRPC in a forked child, the case those handlers exist for. Set here, in
# the package every kvrail process imports first, before gRPC reads it; a setting of the
# operator's own is kept.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
