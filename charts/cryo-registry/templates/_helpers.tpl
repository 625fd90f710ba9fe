{{/* Names and labels shared by every object of the release. */}}
{{- define "cryo-registry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cryo-registry.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "cryo-registry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cryo-registry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "cryo-registry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "cryo-registry.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "cryo-registry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cryo-registry.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cryo-registry.httpSecretName" -}}
{{- default (include "cryo-registry.fullname" .) .Values.existingHttpSecret }}
{{- end }}

{{- define "cryo-registry.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Checks values that would render a registry that cannot work. */}}
{{- define "cryo-registry.validate" -}}
{{- $s := .Values.storage -}}
{{- if not (has $s.type (list "filesystem" "s3")) }}
{{- fail (printf "storage.type must be filesystem or s3, not %q" $s.type) }}
{{- end }}
{{- if and (eq $s.type "s3") (not $s.s3.bucket) }}
{{- fail "storage.s3.bucket is required with storage.type=s3" }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (eq $s.type "filesystem") }}
{{- if not $s.filesystem.persistence.enabled }}
{{- fail "replicaCount > 1 needs shared storage: storage.type=s3, or a ReadWriteMany PVC (an emptyDir is per pod)" }}
{{- end }}
{{- if not (has "ReadWriteMany" $s.filesystem.persistence.accessModes) }}
{{- fail "replicaCount > 1 with filesystem storage needs storage.filesystem.persistence.accessModes to include ReadWriteMany (also for an existingClaim: say what it supports), or storage.type=s3" }}
{{- end }}
{{- end }}
{{- if and .Values.mirror.enabled (not .Values.mirror.remoteURL) }}
{{- fail "mirror.enabled needs mirror.remoteURL (the primary registry, http:// or https://)" }}
{{- end }}
{{- if and .Values.auth.htpasswd.enabled .Values.auth.token.enabled }}
{{- fail "choose one of auth.htpasswd and auth.token" }}
{{- end }}
{{- if and .Values.auth.htpasswd.enabled (not .Values.auth.htpasswd.existingSecret) }}
{{- fail "auth.htpasswd.existingSecret is required (a Secret with key htpasswd)" }}
{{- end }}
{{- if and .Values.auth.token.enabled (not .Values.auth.token.existingSecret) }}
{{- fail "auth.token.existingSecret is required (a Secret with key rootcertbundle.pem)" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.secretName is required with tls.enabled" }}
{{- end }}
{{- if and .Values.redis.enabled (not .Values.redis.addr) }}
{{- fail "redis.addr (host:port) is required with redis.enabled" }}
{{- end }}
{{- if and .Values.redis.chunkIndexAnchors (not .Values.redis.enabled) }}
{{- fail "redis.chunkIndexAnchors needs redis.enabled and redis.addr" }}
{{- end }}
{{- end }}

{{/* The distribution configuration, without secrets (they come from env). */}}
{{- define "cryo-registry.config" -}}
{{- $storage := dict "delete" (dict "enabled" .Values.storage.delete) "redirect" (dict "disable" (not .Values.storage.redirect)) "maintenance" (dict "uploadpurging" (dict "enabled" true "age" "168h" "interval" "24h" "dryrun" false)) -}}
{{- if eq .Values.storage.type "s3" }}
{{- $s3 := dict "bucket" .Values.storage.s3.bucket "region" .Values.storage.s3.region "secure" .Values.storage.s3.secure "rootdirectory" .Values.storage.s3.rootDirectory -}}
{{- with .Values.storage.s3.regionEndpoint }}{{ $_ := set $s3 "regionendpoint" . }}{{ end }}
{{- if .Values.storage.s3.forcePathStyle }}{{ $_ := set $s3 "forcepathstyle" true }}{{ end }}
{{- $_ := set $storage "s3" $s3 -}}
{{- else }}
{{- $_ := set $storage "filesystem" (dict "rootdirectory" "/var/lib/cryo-registry") -}}
{{- end }}
{{- if .Values.redis.enabled }}
{{- $_ := set $storage "cache" (dict "blobdescriptor" "redis") -}}
{{- end }}
{{- $http := dict "addr" (printf ":%d" (int .Values.service.port)) "headers" (dict "X-Content-Type-Options" (list "nosniff")) -}}
{{- if .Values.tls.enabled }}
{{- $_ := set $http "tls" (dict "certificate" "/etc/cryo/tls/tls.crt" "key" "/etc/cryo/tls/tls.key") -}}
{{- end }}
{{- $cfg := dict "version" "0.1" "log" (dict "level" .Values.logLevel "formatter" "json" "accesslog" (dict "disabled" true)) "storage" $storage "http" $http "validation" (dict "manifests" (dict "urls" (dict "allow" (list "^https?://")))) -}}
{{- if .Values.redis.enabled }}
{{- $_ := set $cfg "redis" (dict "addrs" (list .Values.redis.addr) "db" (int .Values.redis.db)) -}}
{{- end }}
{{- if .Values.auth.htpasswd.enabled }}
{{- $_ := set $cfg "auth" (dict "htpasswd" (dict "realm" .Values.auth.htpasswd.realm "path" "/etc/cryo/auth/htpasswd")) -}}
{{- else if .Values.auth.token.enabled }}
{{- $_ := set $cfg "auth" (dict "token" (dict "realm" .Values.auth.token.realm "service" .Values.auth.token.service "issuer" .Values.auth.token.issuer "rootcertbundle" "/etc/cryo/auth/rootcertbundle.pem")) -}}
{{- end }}
{{- if .Values.mirror.enabled }}
{{- $_ := set $cfg "proxy" (dict "remoteurl" .Values.mirror.remoteURL) -}}
{{- end }}
{{- toYaml (mergeOverwrite $cfg .Values.extraConfig) }}
{{- end }}

{{/* Environment shared by the registry and the gc job: secrets and the config path. */}}
{{- define "cryo-registry.env" -}}
- name: REGISTRY_HTTP_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "cryo-registry.httpSecretName" . }}
      key: httpSecret
{{- if and (eq .Values.storage.type "s3") .Values.storage.s3.existingSecret }}
- name: REGISTRY_STORAGE_S3_ACCESSKEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.storage.s3.existingSecret }}
      key: accessKey
- name: REGISTRY_STORAGE_S3_SECRETKEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.storage.s3.existingSecret }}
      key: secretKey
{{- end }}
{{- if and .Values.redis.enabled .Values.redis.existingSecret }}
- name: REGISTRY_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: password
{{- end }}
{{- if and .Values.mirror.enabled .Values.mirror.existingSecret }}
- name: REGISTRY_PROXY_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ .Values.mirror.existingSecret }}
      key: username
- name: REGISTRY_PROXY_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.mirror.existingSecret }}
      key: password
{{- end }}
{{- end }}

{{/* Volumes shared by the registry and the gc job. */}}
{{- define "cryo-registry.volumes" -}}
- name: tmp
  emptyDir: {}
- name: config
  configMap:
    name: {{ include "cryo-registry.fullname" . }}
{{- if eq .Values.storage.type "filesystem" }}
- name: data
{{- if .Values.storage.filesystem.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ .Values.storage.filesystem.persistence.existingClaim | default (include "cryo-registry.fullname" .) }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- if .Values.auth.htpasswd.enabled }}
- name: auth
  secret:
    secretName: {{ .Values.auth.htpasswd.existingSecret }}
{{- else if .Values.auth.token.enabled }}
- name: auth
  secret:
    secretName: {{ .Values.auth.token.existingSecret }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- end }}

{{- define "cryo-registry.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: config
  mountPath: /etc/cryo/registry
  readOnly: true
{{- if eq .Values.storage.type "filesystem" }}
- name: data
  mountPath: /var/lib/cryo-registry
{{- end }}
{{- if or .Values.auth.htpasswd.enabled .Values.auth.token.enabled }}
- name: auth
  mountPath: /etc/cryo/auth
  readOnly: true
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/cryo/tls
  readOnly: true
{{- end }}
{{- end }}
