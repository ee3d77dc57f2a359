{{/* The environment the chart sets on the daemon container (extraEnv may not repeat a name). */}}
{{- define "tierckpt.daemonEnv" }}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: TIERCKPT_SHM_DIR
  value: {{ .Values.daemon.shmDir | quote }}
- name: TIERCKPT_CAPACITY
  value: {{ .Values.daemon.capacity | quote }}
- name: TIERCKPT_KEEP_LAST
  value: {{ .Values.daemon.keepLast | quote }}
- name: TIERCKPT_HOST
  value: {{ .Values.daemon.host | quote }}
- name: TIERCKPT_PORT
  value: {{ .Values.daemon.port | quote }}
- name: TIERCKPT_LEASE_TTL_S
  value: {{ .Values.daemon.leaseTtlSeconds | quote }}
- name: TIERCKPT_PREFAULT
  value: {{ .Values.daemon.prefault | quote }}
- name: TIERCKPT_LOG_LEVEL
  value: {{ .Values.daemon.logLevel | quote }}
- name: TIERCKPT_LOG_JSON
  value: {{ .Values.daemon.logJson | quote }}
{{- with .Values.persist.url }}
- name: TIERCKPT_PERSIST_URL
  value: {{ . | quote }}
{{- end }}
- name: TIERCKPT_PERSIST_EVERY
  value: {{ .Values.persist.every | quote }}
- name: TIERCKPT_PERSIST_KEEP_LAST
  value: {{ .Values.persist.keepLast | quote }}
- name: TIERCKPT_UPLOAD_CONCURRENCY
  value: {{ .Values.upload.concurrency | quote }}
{{- with .Values.upload.maxRate }}
- name: TIERCKPT_UPLOAD_MAX_RATE
  value: {{ . | quote }}
{{- end }}
- name: TIERCKPT_DRAIN_TIMEOUT_S
  value: {{ .Values.drainTimeoutSeconds | quote }}
{{- with .Values.s3.endpoint }}
- name: TIERCKPT_S3_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with .Values.s3.region }}
- name: TIERCKPT_S3_REGION
  value: {{ . | quote }}
{{- end }}
- name: TIERCKPT_S3_FORCE_PATH_STYLE
  value: {{ .Values.s3.forcePathStyle | quote }}
{{- if .Values.replication.enabled }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
# Replication: every daemon pod, as the headless Service's DNS lists them (ready or not).
- name: TIERCKPT_PEERS
  value: {{ .Values.replication.peers | default (printf "dns:%s-peers.%s.svc.%s:%d" (include "tierckpt.fullname" .) .Release.Namespace .Values.replication.clusterDomain (int .Values.daemon.port)) | quote }}
- name: TIERCKPT_NODE_NAME
  value: {{ .Values.replication.nodeName | default (printf "$(POD_IP):%d" (int .Values.daemon.port)) | quote }}
- name: TIERCKPT_REPLICAS
  value: {{ .Values.replication.replicas | quote }}
- name: TIERCKPT_PEER_TIMEOUT_S
  value: {{ .Values.replication.timeoutSeconds | quote }}
- name: TIERCKPT_REPLICATION_CONCURRENCY
  value: {{ .Values.replication.concurrency | quote }}
{{- with .Values.replication.maxRate }}
- name: TIERCKPT_REPLICATION_MAX_RATE
  value: {{ . | quote }}
{{- end }}
{{- with .Values.replication.inflightBytes }}
- name: TIERCKPT_REPLICATION_INFLIGHT_BYTES
  value: {{ . | quote }}
{{- end }}
{{- with .Values.replication.fetchMaxRate }}
- name: TIERCKPT_PEER_FETCH_MAX_RATE
  value: {{ . | quote }}
{{- end }}
- name: TIERCKPT_PEER_TOKEN_FILE
  value: /var/run/tierckpt/peer-token/token
{{- end }}
{{- with .Values.replication.tls.secretName }}
# TLS on the TCP port: the certificate, its key, and the CA every peer's must chain to.
- name: TIERCKPT_PEER_TLS_CERT
  value: /var/run/tierckpt/peer-tls/tls.crt
- name: TIERCKPT_PEER_TLS_KEY
  value: /var/run/tierckpt/peer-tls/tls.key
- name: TIERCKPT_PEER_TLS_CA
  value: /var/run/tierckpt/peer-tls/ca.crt
- name: TIERCKPT_PEER_TLS_SERVER_NAME
  value: {{ include "tierckpt.peerTlsServerName" $ | quote }}
{{- end }}
{{- end }}
