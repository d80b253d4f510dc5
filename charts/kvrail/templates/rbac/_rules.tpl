{{/*
Exactly what the operator calls (kvrail/operator/k8s.py and handlers.py, and Kopf itself):
- Kopf watches and patches pools (finalizer, progress annotations) and their status, and posts
  core/v1 Events on decisions.
- Children are server-side applied: verb patch, plus create (an apply that creates the object is
  authorized as a create too). Only StatefulSets and Deployments are read back (status); only
  kinds a spec change can make stale are deleted.
- inferencepools/finalizers update: owner references with blockOwnerDeletion need it where the
  OwnerReferencesPermissionEnforcement admission plugin is on.
- statefulsets/scale patch: the planner sets worker replicas through the scale subresource.
- networkpolicies: each pool's workers' policy is a child like any other (create, patch), and
  delete removes it where KVRAIL_OPERATOR_NETWORK_POLICIES is false (networkPolicies.enabled);
  the rule stays when they are off, so turning them off cleans up what the operator made.
- configmaps, delete only: the router's <pool>-config that earlier operators wrote (the router
  now takes every setting from its environment) is removed as a stale child.
- GAIE mode (router.gateway.inferenceExtension): the GAIE InferencePool
  (inferencepools.inference.networking.k8s.io, never its status: gateways own status.parents) is
  a child like the HTTPRoute (create, patch; delete once the mode is off); deployments gain delete
  for the endpoint picker's <pool>-epp. The picker itself never calls the API: no RBAC.
- secrets, only with operator.shareAccess, and only written, never read: <pool>-infrastructure
  carries the operator's own etcd and NATS access (from its mounted files) to a pool that names
  no servers of its own; delete removes it once the pool names its own.
*/}}
{{- define "kvrail.operator.poolRules" -}}
- apiGroups: [kvrail.dev]
  resources: [inferencepools]
  verbs: [list, watch, patch]
- apiGroups: [kvrail.dev]
  resources: [inferencepools/status]
  verbs: [patch]
- apiGroups: [kvrail.dev]
  resources: [inferencepools/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [delete]
{{- if .Values.operator.shareAccess }}
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, patch, delete]
{{- end }}
- apiGroups: [""]
  resources: [services]
  verbs: [create, patch, delete]
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [create, get, patch, delete]
- apiGroups: [apps]
  resources: [statefulsets/scale]
  verbs: [patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [create, get, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, patch, delete]
{{- end -}}
