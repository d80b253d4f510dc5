"""Local processes: etcd and NATS servers, child processes with logs and readiness checks.

Used by `kvrail up` (the local stack) and by the test harness; never by a component.
"""
