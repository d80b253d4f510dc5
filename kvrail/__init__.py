"""kvrail: a Kubernetes-native control plane for disaggregated LLM inference.

This package is the contract shared by every component: CRD models, wire messages, block hashing,
the model fingerprint, the etcd registry and NATS clients, settings, metric names and the CLI. It
imports no component (import-linter enforces it).
"""

__version__ = "0.1.0"
