{{/* Names and labels shared by every object of the chart. */}}

{{- define "tfps.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name; truncated at 63 characters (a DNS label). */}}
{{- define "tfps.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tfps.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tfps.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tfps.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "tfps.labels" -}}
helm.sh/chart: {{ include "tfps.chart" . }}
{{ include "tfps.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tfps
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tfps.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tfps.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference: repository:tag (tag defaults to the chart's appVersion), or @digest when set. */}}
{{- define "tfps.image" -}}
{{- $image := .image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The namespace every namespaced object goes to. */}}
{{- define "tfps.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{/*
The operator's configuration file. Its format is tfps.operator.config.OperatorConfig
(camelCase, unknown keys rejected); tests/unit/test_chart.py validates the rendered file with it.
*/}}
{{- define "tfps.operatorConfig" -}}
{{- $rt := .Values.runtime -}}
{{- $op := .Values.operator -}}
images:
  ps: {{ include "tfps.image" (dict "image" $rt.images.ps "root" .) | quote }}
  worker: {{ include "tfps.image" (dict "image" $rt.images.worker "root" .) | quote }}
  pullPolicy: {{ $rt.images.pullPolicy }}
ports:
  grpc: {{ $rt.ports.grpc }}
  data: {{ $rt.ports.data }}
  metrics: {{ $rt.ports.metrics }}
resources:
  {{- toYaml $rt.resources | nindent 2 }}
podSecurityContext:
  {{- toYaml $rt.podSecurityContext | nindent 2 }}
containerSecurityContext:
  {{- toYaml $rt.containerSecurityContext | nindent 2 }}
tmpVolume: {{ $rt.tmpVolume }}
networkPolicy:
  enabled: {{ $rt.networkPolicy.enabled }}
  metricsFrom:
    {{- toYaml $rt.networkPolicy.metricsFrom | nindent 4 }}
resyncSeconds: {{ $op.resyncSeconds }}
progressSeconds: {{ $op.progressSeconds }}
finishedPodGraceSeconds: {{ $op.finishedPodGraceSeconds }}
reconcileWorkers: {{ $op.reconcileWorkers }}
scheduling:
  gang: {{ .Values.scheduling.gang }}
  allJobs: {{ .Values.scheduling.allJobs }}
  {{- with .Values.scheduling.schedulerName }}
  schedulerName: {{ . | quote }}
  {{- end }}
  queueing: {{ .Values.scheduling.queueing }}
{{- end -}}

{{/* Arguments of the operator container (its entrypoint is `tfps`). */}}
{{- define "tfps.operatorArgs" -}}
{{- $op := .Values.operator -}}
- operator
- --config=/etc/tfps/config.yaml
- --log-level={{ $op.logLevel }}
- --metrics-address=$(POD_IP)
- --metrics-port={{ $op.metricsPort }}
- --health-port={{ $op.healthPort }}
- --log-format={{ $op.logFormat }}
- --peering={{ include "tfps.peeringName" . }}
{{- if $op.watchNamespaces }}
{{- range $op.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- range $op.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* RBAC rules on cluster-scoped resources (always in the ClusterRole). */}}
{{- define "tfps.clusterRules" -}}
# kopf: discovering the resources it serves (it watches CRDs to notice them appear).
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- if empty .Values.operator.watchNamespaces }}
# kopf peering (leader election) among replicas serving the whole cluster; the chart
# creates the peering object, so no `create`.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- else }}
# kopf: knowing which of the watched namespaces exist.
- apiGroups: [""]
  resources: [namespaces]
  verbs: [get, list, watch]
{{- end }}
{{- end -}}

{{/* RBAC rules on namespaced resources (ClusterRole when cluster-wide, else a Role per watched namespace). */}}
{{- define "tfps.namespacedRules" -}}
# TrainingJobs: watched; patched for kopf's finalizer and annotations; deleted after
# ttlSecondsAfterFinished; their status written through the status subresource.
- apiGroups: [tfps.io]
  resources: [trainingjobs]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [tfps.io]
  resources: [trainingjobs/status]
  verbs: [get, patch]
{{- if eq .Values.scheduling.queueing "kueue" }}
# The PS and worker pods (watched, created, deleted; patched only to end their Kueue pod group:
# an annotation, and Kueue's finalizer off a pod deleted while it runs).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete, patch]
{{- else }}
# The PS and worker pods (watched, created, deleted; never changed in place).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete]
{{- end }}
# Each job's headless Service.
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, delete]
# Each job's Secret (bearer token, TLS material): created once and deleted with the job.
# No get/list/watch: the operator cannot read any Secret, not even the ones it made.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, delete]
# Each job's NetworkPolicy (read before deleting, to delete only the job's own).
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, delete]
# Events about the jobs (kopf posts core/v1 events).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- $gang := .Values.scheduling.gang }}
{{- if has $gang (list "auto" "workload") }}
# Gang scheduling: each job's Workload (Kubernetes' own, scheduling.k8s.io/v1alpha1).
- apiGroups: [scheduling.k8s.io]
  resources: [workloads]
  verbs: [create]
{{- else if eq $gang "coscheduling" }}
# Gang scheduling: each job's PodGroup (scheduler-plugins' coscheduling).
- apiGroups: [scheduling.x-k8s.io]
  resources: [podgroups]
  verbs: [create]
{{- else if eq $gang "volcano" }}
# Gang scheduling: each job's PodGroup (Volcano).
- apiGroups: [scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [create]
{{- end }}
{{- if not (empty .Values.operator.watchNamespaces) }}
# kopf peering (leader election) among replicas, per watched namespace.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}

{{/* kopf's peering object: shared by the operator replicas (leader election). */}}
{{- define "tfps.peeringName" -}}
{{- include "tfps.fullname" . -}}
{{- end -}}
