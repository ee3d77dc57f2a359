{{- define "tierckpt.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tierckpt.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tierckpt.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tierckpt.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tierckpt.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "tierckpt.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "tierckpt.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tierckpt.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tierckpt.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The Secret that holds the peer token: the user's existingSecret, else the chart's own. */}}
{{- define "tierckpt.peerTokenSecret" -}}
{{- default (printf "%s-peer-token" (include "tierckpt.fullname" .)) .Values.replication.existingSecret -}}
{{- end -}}

{{- define "tierckpt.peerTokenKey" -}}
{{- if .Values.replication.existingSecret -}}
{{- .Values.replication.existingSecretKey -}}
{{- else -}}
token
{{- end -}}
{{- end -}}

{{/*
The peer token when the chart makes the Secret. Deterministic on purpose: `helm template` (Argo CD,
Flux) renders the same Secret every time, so GitOps tools see no drift and pods do not roll for
nothing. randAlphaNum would change on every render, and `lookup` returns nothing offline.
*/}}
{{- define "tierckpt.peerToken" -}}
{{- $r := .Values.replication -}}
{{- if $r.token -}}
{{- if lt (len $r.token) 32 -}}
{{- fail "replication.token must be at least 32 characters" -}}
{{- end -}}
{{- $r.token -}}
{{- else if $r.tokenSeed -}}
{{- sha256sum (printf "tierckpt-peer-token/%s/%s/%s" $r.tokenSeed .Release.Namespace .Release.Name) -}}
{{- else -}}
{{- fail "replication.enabled needs a peer token: set replication.existingSecret (a Secret you manage), replication.token, or replication.tokenSeed (e.g. the output of `openssl rand -hex 16`; the chart derives a stable token from it)" -}}
{{- end -}}
{{- end -}}

{{/* The name every daemon's TLS certificate carries (TIERCKPT_PEER_TLS_SERVER_NAME). */}}
{{- define "tierckpt.peerTlsServerName" -}}
{{- .Values.replication.tls.serverName | default (printf "%s-peers.%s.svc" (include "tierckpt.fullname" .) .Release.Namespace) }}
{{- end }}

{{/*
The pod's securityContext: podSecurityContext with the chart's user and group. Those come from
the top-level runAsUser/runAsGroup only (the init container chowns the tier directory to them, the
webhook gives trainers the group): setting them in podSecurityContext or securityContext is
refused, rather than silently replaced (sprig's merge drops a 0) or left to disagree with them.
*/}}
{{- define "tierckpt.podSecurityContext" -}}
{{- range $k := list "runAsUser" "runAsGroup" "fsGroup" }}
{{- if hasKey $.Values.podSecurityContext $k }}
{{- fail (printf "podSecurityContext.%s is set by the chart: set the top-level runAsUser/runAsGroup instead (the daemon runs as non-root: runAsUser >= 1)" $k) }}
{{- end }}
{{- end }}
{{- range $k := list "runAsUser" "runAsGroup" }}
{{- if hasKey $.Values.securityContext $k }}
{{- fail (printf "securityContext.%s is set by the chart: set the top-level runAsUser/runAsGroup instead (the daemon runs as non-root: runAsUser >= 1)" $k) }}
{{- end }}
{{- end }}
{{- $ids := dict "runAsUser" .Values.runAsUser "runAsGroup" .Values.runAsGroup "fsGroup" .Values.runAsGroup }}
{{- merge $ids (deepCopy .Values.podSecurityContext) | toYaml }}
{{- end }}
