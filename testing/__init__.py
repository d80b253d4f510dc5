"""Test harness shipped with kvrail (the `kopf.testing` precedent): real servers for tests.

`kvrail.testing.kube.KubeControlPlane` starts a real kube-apiserver (with its own etcd, generated
PKI, token authentication and RBAC), and on demand kube-controller-manager, kube-scheduler and
KWOK for fake nodes. etcd and NATS servers live in `kvrail.local.servers` (also used by
`kvrail up`).
"""
