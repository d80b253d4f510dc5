"""The `InferencePool` API (`inferencepools.kvrail.dev/v1alpha1`), the source of `crds/`.

`pool` holds the resource and its spec-wide CEL rules, `spec` the spec's parts, `status` the
status, `base` the model conventions (camelCase aliases, CEL rule declarations) and `gen` turns
the models into the CRD (`python -P -m kvrail.crd.gen`).
"""
