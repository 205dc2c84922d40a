{{/* The release's name, trimmed for labels and object names. */}}
{{- define "ringmaster.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ringmaster.selectorLabels" -}}
app.kubernetes.io/name: ringmaster
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ringmaster.labels" -}}
{{ include "ringmaster.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ringmaster
{{- if not .Values.kustomize }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}
{{- end -}}

{{- define "ringmaster.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ringmaster.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ringmaster.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "ringmaster.leaderElection" -}}
{{- if or .Values.leaderElection.enabled (gt (int .Values.replicaCount) 1) -}}true{{- end -}}
{{- end -}}

{{/* Whose PodGroups the gang scheduler reads: gangSchedulerApi, or by the scheduler's name
     as the operator decides (volcano for a scheduler named volcano). */}}
{{- define "ringmaster.gangApi" -}}
{{- if .Values.gangSchedulerApi -}}
{{- .Values.gangSchedulerApi -}}
{{- else if eq .Values.gangScheduler "volcano" -}}
volcano
{{- else -}}
scheduler-plugins
{{- end -}}
{{- end -}}

{{/* The PriorityClass of launchers: launcherPriorityClass.name, else the one the chart makes
     (<fullname>-launcher, unique to the release) when it makes one; empty: none, as with a
     gang scheduler (it orders its own groups). */}}
{{- define "ringmaster.launcherPriorityClass" -}}
{{- $class := .Values.launcherPriorityClass | default dict -}}
{{- if .Values.gangScheduler -}}
{{- else if $class.name -}}
{{- $class.name -}}
{{- else if $class.create -}}
{{- include "ringmaster.fullname" . }}-launcher
{{- end -}}
{{- end -}}
