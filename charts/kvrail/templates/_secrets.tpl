{{/*
A generated credentials Secret for etcd or NATS (keys username and password), unless
<component>.auth.existingSecret names one. The password is random at install and kept on upgrade
(read back with lookup); `helm template` cannot look up, so it renders a fresh one. With
persistence on, the Secret outlives `helm uninstall` (resource-policy keep) like the server's
PersistentVolumeClaim: its data is protected by that password, which a reinstall must reuse.
Without persistence nothing outlives the release.
*/}}
{{- define "kvrail.generatedCredentials" -}}
{{- $block := index .ctx.Values .component -}}
{{- if and $block.enabled $block.auth.enabled (not $block.auth.existingSecret) -}}
{{- $name := include "kvrail.credentialsSecret" . -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace $name -}}
apiVersion: v1
kind: Secret
metadata:
  name: {{ $name }}
  namespace: {{ .ctx.Release.Namespace }}
  labels:
    {{- include "kvrail.labels" (dict "ctx" .ctx "component" .component) | nindent 4 }}
  {{- if $block.persistence.enabled }}
  annotations:
    helm.sh/resource-policy: keep
  {{- end }}
type: Opaque
data:
  username: {{ .username | b64enc }}
  {{- if and $existing $existing.data }}
  password: {{ index $existing.data "password" }}
  {{- else }}
  {{- /* a letter first: safe even where a server reads it as a config value (nats-server did,
  from $NATS_PASSWORD, before the chart wrote it into a quoted include: kvrail.nats_auth) */}}
  password: {{ printf "k%s" (randAlphaNum 31) | b64enc }}
  {{- end }}
{{- end -}}
{{- end -}}
