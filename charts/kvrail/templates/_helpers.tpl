{{/* Resource name prefix: <release>-<chart>, or the release name when it contains the chart. */}}
{{- define "kvrail.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Recommended labels; pass (dict "ctx" $ "component" "operator"). */}}
{{- define "kvrail.labels" -}}
{{ include "kvrail.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvrail
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version }}
{{- end -}}

{{- define "kvrail.selectorLabels" -}}
app.kubernetes.io/name: {{ default .ctx.Chart.Name .ctx.Values.nameOverride }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* repository:tag, the tag defaulting to the chart's appVersion; pass (dict "ctx" $ "image" ...). */}}
{{- define "kvrail.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "kvrail.operator.serviceAccountName" -}}
{{- default (printf "%s-operator" (include "kvrail.fullname" .)) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{/* The Secret holding a component's credentials (keys username and password). */}}
{{- define "kvrail.credentialsSecret" -}}
{{- $block := index .ctx.Values .component -}}
{{- default (printf "%s-%s-credentials" (include "kvrail.fullname" .ctx) .component) $block.auth.existingSecret -}}
{{- end -}}

{{/* etcd client URLs the operator gives pools by default (comma-separated), or "". */}}
{{- define "kvrail.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "%s://%s-etcd.%s.svc:2379" (ternary "https" "http" (not (empty .Values.etcd.tls.secretName))) (include "kvrail.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- join "," .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{- define "kvrail.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "%s://%s-nats.%s.svc:4222" (ternary "tls" "nats" (not (empty .Values.nats.tls.secretName))) (include "kvrail.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{/*
The Secret (keys username and password) whose credentials the operator uses for etcd or NATS, or
"" for none: with auth enabled, the chart's own Secret (generated or auth.existingSecret) for an
in-cluster server, auth.existingSecret for an external one. Pass (dict "ctx" $ "component" "etcd").
*/}}
{{- define "kvrail.operatorCredentialsSecret" -}}
{{- $block := index .ctx.Values .component -}}
{{- if $block.auth.enabled -}}
{{- if $block.enabled -}}
{{- include "kvrail.credentialsSecret" . -}}
{{- else -}}
{{- $block.auth.existingSecret -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The Secret whose ca.crt the operator trusts for etcd or NATS, or "": caSecret for an external
server, tls.secretName for the in-cluster one. Pass (dict "ctx" $ "component" "etcd").
*/}}
{{- define "kvrail.caSecret" -}}
{{- $block := index .ctx.Values .component -}}
{{- if $block.enabled -}}
{{- $block.tls.secretName -}}
{{- else -}}
{{- $block.caSecret -}}
{{- end -}}
{{- end -}}

{{/* Where credential Secrets are mounted: the folder operator/builders/env.py uses for workers. */}}
{{- define "kvrail.secretsDir" -}}
/var/run/secrets/kvrail
{{- end -}}

{{- define "kvrail.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvrail.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Cross-field rules the schema cannot express. */}}
{{- define "kvrail.validate" -}}
{{- if and .Values.etcd.enabled .Values.etcd.endpoints -}}
{{- fail "etcd: set either enabled (in-cluster etcd) or endpoints (external), not both" -}}
{{- end -}}
{{- if and .Values.nats.enabled .Values.nats.url -}}
{{- fail "nats: set either enabled (in-cluster NATS) or url (external), not both" -}}
{{- end -}}
{{- if and .Values.etcd.enabled .Values.etcd.caSecret -}}
{{- fail "etcd.caSecret is for an external etcd (endpoints): the in-cluster etcd serves TLS from etcd.tls.secretName" -}}
{{- end -}}
{{- if and .Values.nats.enabled .Values.nats.caSecret -}}
{{- fail "nats.caSecret is for an external NATS (url): the in-cluster NATS serves TLS from nats.tls.secretName" -}}
{{- end -}}
{{- if and (not .Values.etcd.enabled) .Values.etcd.tls.secretName -}}
{{- fail "etcd.tls.secretName is for the in-cluster etcd: for an external etcd set etcd.caSecret" -}}
{{- end -}}
{{- if and (not .Values.nats.enabled) .Values.nats.tls.secretName -}}
{{- fail "nats.tls.secretName is for the in-cluster NATS: for an external NATS set nats.caSecret" -}}
{{- end -}}
{{- if and (index .Values.operator "metricsPort") (eq (int (index .Values.operator "metricsPort")) 8080) -}}
{{- fail "operator.metricsPort must not be 8080, the operator's health port" -}}
{{- end -}}
{{- if and .Values.gateway.enabled (not .Values.gateway.className) -}}
{{- fail "gateway.className is required when gateway.enabled is true (your Gateway API implementation's GatewayClass)" -}}
{{- end -}}
{{- if and .Values.operator.enabled (not .Values.operator.serviceAccount.create) (not .Values.operator.serviceAccount.name) -}}
{{- fail "operator.serviceAccount.name is required when operator.serviceAccount.create is false" -}}
{{- end -}}
{{- end -}}
