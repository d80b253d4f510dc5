{{/*
Ingress of a bundled server (etcd or NATS): only kvrail's own pods. Pass (dict "ctx" $ "port" N).
- Every port from the release's pods in its namespace (app.kubernetes.io/instance): the operator,
  the etcd auth Job, `helm test`, and the server's own members.
- The client port from the routers and workers of every pool (app.kubernetes.io/part-of: kvrail
  with a kvrail.dev/pool label, as operator/builders/meta.py sets them), in the namespaces the
  operator watches (operator.watchNamespaces; empty: every namespace).
Metrics and monitoring ports get no other source: a policy of your own adds Prometheus
(NetworkPolicies add up). Kubelet probes are not subject to NetworkPolicy in most CNIs.
*/}}
{{- define "kvrail.networkPolicies.serverIngress" -}}
- from:
    - podSelector:
        matchLabels:
          app.kubernetes.io/instance: {{ .ctx.Release.Name }}
- from:
    - podSelector:
        matchLabels:
          app.kubernetes.io/part-of: kvrail
        matchExpressions:
          - {key: kvrail.dev/pool, operator: Exists}
      {{- with .ctx.Values.operator.watchNamespaces }}
      namespaceSelector:
        matchExpressions:
          - key: kubernetes.io/metadata.name
            operator: In
            values:
              {{- toYaml . | nindent 14 }}
      {{- else }}
      namespaceSelector: {}
      {{- end }}
  ports:
    - {protocol: TCP, port: {{ .port }}}
{{- end -}}
