{{- define "pier.name" -}}{{ .Chart.Name }}{{- end -}}
{{- define "pier.fullname" -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- define "pier.labels" -}}
app.kubernetes.io/name: {{ include "pier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}
{{- define "pier.selector" -}}
app.kubernetes.io/name: {{ include "pier.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
