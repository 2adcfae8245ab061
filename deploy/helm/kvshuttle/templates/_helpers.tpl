{{/* Names and labels. */}}
{{- define "kvshuttle.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvshuttle.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: <fullname>-<component>. Call with (list $ "registry"). */}}
{{- define "kvshuttle.component" -}}
{{- printf "%s-%s" (include "kvshuttle.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{- define "kvshuttle.labels" -}}
{{- $ := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $.Chart.Name $.Chart.Version }}
app.kubernetes.io/managed-by: {{ $.Release.Service }}
app.kubernetes.io/version: {{ $.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvshuttle
{{ include "kvshuttle.selectorLabels" . }}
{{- end -}}

{{- define "kvshuttle.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "kvshuttle.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "kvshuttle.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvshuttle.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image: call with (list $ .Values.images.controlPlane) */}}
{{- define "kvshuttle.image" -}}
{{- $ := index . 0 -}}{{- $img := index . 1 -}}
{{- printf "%s:%s" $img.repository (default $.Chart.AppVersion $img.tag) -}}
{{- end -}}

{{/*
Command-line flags from a `settings` map: `key: value` -> `--key=value`; booleans -> `--key` / `--no-key`.
Numbers print as written (YAML integers arrive as floats; whole ones print without an exponent).
One YAML list item per flag. The flags are those of `kvshuttle <command> --help`.
*/}}
{{- define "kvshuttle.flags" -}}
{{- range $k, $v := . }}
{{- if kindIs "bool" $v }}
- {{ if $v }}{{ printf "--%s" $k | quote }}{{ else }}{{ printf "--no-%s" $k | quote }}{{ end }}
{{- else if and (kindIs "float64" $v) (eq $v (floor $v)) }}
- {{ printf "--%s=%d" $k (int64 $v) | quote }}
{{- else }}
- {{ printf "--%s=%v" $k $v | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Addresses of the control-plane services, as their callers dial them. */}}
{{- define "kvshuttle.registryAddress" -}}
{{- printf "%s:%d" (include "kvshuttle.component" (list . "registry")) (int .Values.registry.port) -}}
{{- end -}}
{{/* Every scheduler replica, by the headless Service's DNS records: the gateways spread their plans over them, round
robin (one ClusterIP address would pin each gateway's HTTP/2 connection, so all its plans, to one replica). */}}
{{- define "kvshuttle.schedulerAddress" -}}
{{- printf "dns:///%s-peers:%d" (include "kvshuttle.component" (list . "scheduler")) (int .Values.scheduler.port) -}}
{{- end -}}

{{- define "kvshuttle.etcdEndpoints" -}}
{{- if eq .Values.etcd.mode "external" -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- $svc := include "kvshuttle.component" (list . "etcd") -}}
{{- printf "%s:%d" $svc (int .Values.etcd.bundled.clientPort) -}}
{{- end -}}
{{- end -}}

{{/* Environment every kvshuttle process shares: log level, tracing, TLS towards kvshuttle's gRPC services. */}}
{{- define "kvshuttle.commonEnv" -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: KVSHUTTLE_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: KVSHUTTLE_TRACES_EXPORTER
  value: {{ ternary "otlp" "none" .Values.tracing.enabled | quote }}
{{- if .Values.tracing.enabled }}
- name: KVSHUTTLE_OTLP_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .Values.tracing.sampler | quote }}
{{- with .Values.tracing.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,k8s.pod.name=$(POD_NAME),service.namespace=%s" .Release.Namespace .Release.Name | quote }}
{{- end }}
{{- if include "kvshuttle.tlsSource" . }}
- name: KVSHUTTLE_TLS_CA
  value: /etc/kvshuttle/tls/ca.crt
- name: KVSHUTTLE_TLS_CLIENT_CERT
  value: /etc/kvshuttle/tls/tls.crt
- name: KVSHUTTLE_TLS_CLIENT_KEY
  value: /etc/kvshuttle/tls/tls.key
{{- if .Values.tls.serverName }}
- name: KVSHUTTLE_TLS_SERVER_NAME
  value: {{ .Values.tls.serverName | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
TLS of a kvshuttle gRPC server (registry, scheduler, gateway): its own certificate, and client certificates of the
CA required (the registry and the scheduler authorize each call by the certificate's Common Name). The gateway's gRPC
API faces clients: it requires them only with gateway.grpcClientCertificates. Call with (list $ component).
*/}}
{{- define "kvshuttle.serverTlsEnv" -}}
{{- $ := index . 0 -}}{{- $component := index . 1 -}}
{{- if include "kvshuttle.tlsSource" $ }}
- name: KVSHUTTLE_TLS_CERT
  value: /etc/kvshuttle/tls/tls.crt
- name: KVSHUTTLE_TLS_KEY
  value: /etc/kvshuttle/tls/tls.key
{{- if or (ne $component "gateway") $.Values.gateway.grpcClientCertificates }}
- name: KVSHUTTLE_TLS_CLIENT_CA
  value: /etc/kvshuttle/tls/ca.crt
{{- end }}
{{- end }}
{{- end -}}

{{/* etcd connection of the registry: endpoints, TLS files, user and password file. */}}
{{- define "kvshuttle.etcdEnv" -}}
- name: KVSHUTTLE_ETCD_ENDPOINTS
  value: {{ include "kvshuttle.etcdEndpoints" . | quote }}
{{- if eq .Values.etcd.mode "external" }}
{{- with .Values.etcd.external }}
{{- if .tlsSecret }}
- name: KVSHUTTLE_ETCD_CA
  value: /etc/kvshuttle/etcd-tls/ca.crt
- name: KVSHUTTLE_ETCD_CERT
  value: /etc/kvshuttle/etcd-tls/tls.crt
- name: KVSHUTTLE_ETCD_KEY
  value: /etc/kvshuttle/etcd-tls/tls.key
{{- if .serverName }}
- name: KVSHUTTLE_ETCD_SERVER_NAME
  value: {{ .serverName | quote }}
{{- end }}
{{- end }}
{{- if .username }}
- name: KVSHUTTLE_ETCD_USERNAME
  value: {{ .username | quote }}
- name: KVSHUTTLE_ETCD_PASSWORD_FILE
  value: /etc/kvshuttle/etcd-auth/password
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvshuttle.etcdVolumeMounts" -}}
{{- if eq .Values.etcd.mode "external" }}
{{- if .Values.etcd.external.tlsSecret }}
- {name: etcd-tls, mountPath: /etc/kvshuttle/etcd-tls, readOnly: true}
{{- end }}
{{- if .Values.etcd.external.username }}
- {name: etcd-auth, mountPath: /etc/kvshuttle/etcd-auth, readOnly: true}
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvshuttle.etcdVolumes" -}}
{{- if eq .Values.etcd.mode "external" }}
{{- if .Values.etcd.external.tlsSecret }}
- name: etcd-tls
  secret: {secretName: {{ .Values.etcd.external.tlsSecret | quote }}}
{{- end }}
{{- with .Values.etcd.external }}
{{- if .username }}
- name: etcd-auth
  secret:
    secretName: {{ .passwordSecret.name | quote }}
    items: [{key: {{ .passwordSecret.key | quote }}, path: password}]
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The history store (sessions' exact token ids, long KV handles) that the registry replicas and the schedulers share:
the bundled Redis's Service, or historyStore.url / historyStore.urlSecret. Fails the render when none or two are given.
*/}}
{{- define "kvshuttle.historyStoreUrl" -}}
{{- $h := .Values.historyStore -}}
{{- if $h.bundled -}}
{{- if or $h.url $h.urlSecret.name -}}
{{- fail "historyStore.url / historyStore.urlSecret name your own Redis: set historyStore.bundled=false to use it (or leave them empty for the bundled one)" -}}
{{- end -}}
{{- printf "redis://%s:%d/0" (include "kvshuttle.component" (list . "history")) (int $h.port) -}}
{{- else if and $h.url $h.urlSecret.name -}}
{{- fail "historyStore: set historyStore.url or historyStore.urlSecret, not both" -}}
{{- else if not (or $h.url $h.urlSecret.name) -}}
{{- fail "historyStore.bundled is false: set historyStore.url (redis://HOST:PORT/DB) or historyStore.urlSecret to the Redis that the registry replicas and the schedulers share" -}}
{{- else -}}
{{- $h.url -}}
{{- end -}}
{{- end -}}

{{/* An environment variable holding the history store's Redis URL: its value, or from historyStore.urlSecret. Call
with (list $ name). */}}
{{- define "kvshuttle.historyStoreUrlEnv" -}}
{{- $ := index . 0 -}}
{{- $url := include "kvshuttle.historyStoreUrl" $ }}
- name: {{ index . 1 }}
{{- if $url }}
  value: {{ $url | quote }}
{{- else }}
  valueFrom:
    secretKeyRef: {name: {{ $.Values.historyStore.urlSecret.name | quote }}, key: {{ $.Values.historyStore.urlSecret.key | quote }}}
{{- end }}
{{- end -}}

{{/* KVSHUTTLE_HISTORY_STORE of the registry and the scheduler. */}}
{{- define "kvshuttle.historyStoreEnv" -}}
{{- include "kvshuttle.historyStoreUrlEnv" (list . "KVSHUTTLE_HISTORY_STORE") }}
{{- end -}}

{{/* "true" when the KV feed is on (kvFeed.enabled): prefill workers publish, the planners follow. */}}
{{- define "kvshuttle.kvFeedEnabled" -}}
{{- if and .Values.kvFeed .Values.kvFeed.enabled -}}true{{- end -}}
{{- end -}}

{{/*
The KV feed (kvFeed): KVSHUTTLE_KV_FEED, the history store's Redis, for the workers (prefill workers publish their KV
events to it, every worker its load samples) and the planners (the schedulers, a gateway planning in process, which
follow it); nothing when it is off. The feed's keys
are under etcd.keyPrefix: the planners' --key-prefix, and the workers' KVSHUTTLE_KV_FEED_KEY_PREFIX (withPrefix).
Call with (list $ withPrefix).
*/}}
{{- define "kvshuttle.kvFeedEnv" -}}
{{- $ := index . 0 -}}
{{- if include "kvshuttle.kvFeedEnabled" $ }}
{{- include "kvshuttle.historyStoreUrlEnv" (list $ "KVSHUTTLE_KV_FEED") }}
{{- if index . 1 }}
- name: KVSHUTTLE_KV_FEED_KEY_PREFIX
  value: {{ $.Values.etcd.keyPrefix | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvshuttle.tlsVolumeMounts" -}}
{{- if include "kvshuttle.tlsSource" . }}
- {name: tls, mountPath: /etc/kvshuttle/tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* The pod's certificate: its identity's Secret. Call with (list $ identity). */}}
{{- define "kvshuttle.tlsVolumes" -}}
{{- $ := index . 0 -}}
{{- if include "kvshuttle.tlsSource" $ }}
- name: tls
  secret: {secretName: {{ include "kvshuttle.tlsSecretName" . | quote }}}
{{- end }}
{{- end -}}

{{/*
Probes of a kvshuttle gRPC server: Kubernetes' own gRPC probe when plaintext; with TLS (which the kubelet's gRPC
probe cannot speak) `kvshuttle health-check` in the container, with the pod's certificates.
Call with (list $ port serviceName).
*/}}
{{- define "kvshuttle.grpcProbe" -}}
{{- $ := index . 0 -}}{{- $port := index . 1 -}}{{- $svc := index . 2 -}}
{{- if include "kvshuttle.tlsSource" $ }}
exec:
  command:
    - kvshuttle
    - health-check
    - {{ printf "--address=127.0.0.1:%d" (int $port) | quote }}
    - {{ printf "--tls-server-name=%s" (default $svc $.Values.tls.serverName) | quote }}
{{- else }}
grpc:
  port: {{ $port }}
{{- end }}
{{- end -}}

{{/* Pod scheduling fields: call with a component's values. */}}
{{- define "kvshuttle.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "kvshuttle.podCommon" -}}
serviceAccountName: {{ include "kvshuttle.serviceAccountName" . }}
{{- with .Values.images.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/*
The model's files. Workers read the whole model; the gateway only its tokenizer and chat template.
Each helper takes (list model volume mount): the model's values (.Values.model, or an extraModels item), the
volume's name and where it is mounted ("model" at /models in every worker pod; the gateway mounts each extra model's
volume at /models-<id> too). Called with $ instead: the main model's.
kvshuttle.modelDir: where the model directory is inside the containers.
*/}}
{{- define "kvshuttle.modelArgs" -}}
{{- if kindIs "slice" . }}{{ toJson . }}{{ else }}{{ toJson (list .Values.model "model" "/models") }}{{ end -}}
{{- end -}}

{{- define "kvshuttle.modelDir" -}}
{{- $a := include "kvshuttle.modelArgs" . | fromJsonArray -}}
{{- $m := index $a 0 -}}{{- $mount := index $a 2 -}}
{{- if eq $m.source "build" -}}
{{ $mount }}/tiny
{{- else if eq $m.source "huggingface" -}}
{{ $mount }}/hf
{{- else -}}
{{- printf "%s/%s" $mount ($m.path | default "") | trimSuffix "/" -}}
{{- end -}}
{{- end -}}

{{- define "kvshuttle.modelVolume" -}}
{{- $a := include "kvshuttle.modelArgs" . | fromJsonArray -}}
{{- $m := index $a 0 -}}
- name: {{ index $a 1 }}
{{- if eq $m.source "pvc" }}
  persistentVolumeClaim: {claimName: {{ $m.pvc.claimName | quote }}, readOnly: true}
{{- else if eq $m.source "hostPath" }}
  hostPath: {path: {{ $m.hostPath.path | quote }}, type: Directory}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "kvshuttle.modelMount" -}}
{{- $a := include "kvshuttle.modelArgs" . | fromJsonArray -}}
- {name: {{ index $a 1 }}, mountPath: {{ index $a 2 }}, readOnly: {{ has (index $a 0).source (list "pvc" "hostPath") }}}
{{- end -}}

{{/* Init container that fills the model volume (huggingface, build). Call with (list $ image tokenizerOnly), or
(list $ image tokenizerOnly model volume mount) for another model's volume. */}}
{{- define "kvshuttle.modelInit" -}}
{{- $ := index . 0 -}}{{- $image := index . 1 -}}{{- $tokenizerOnly := index . 2 -}}
{{- $m := $.Values.model -}}{{- $volume := "model" -}}{{- $mount := "/models" -}}
{{- if gt (len .) 3 }}{{ $m = index . 3 }}{{ $volume = index . 4 }}{{ $mount = index . 5 }}{{ end -}}
{{- if has $m.source (list "huggingface" "build") }}
- name: {{ $volume }}
  image: {{ $image }}
  imagePullPolicy: {{ $.Values.images.pullPolicy }}
  securityContext:
    {{- toYaml $.Values.securityContext | nindent 4 }}
{{- if eq $m.source "build" }}
  command: [kvshuttle, make-model, {{ printf "%s/tiny" $mount }}]
{{- else }}
  command:
    - python
    - -c
    - |
      import os
      from huggingface_hub import snapshot_download
      patterns = os.environ.get("KVSHUTTLE_MODEL_PATTERNS")
      snapshot_download(repo_id=os.environ["KVSHUTTLE_MODEL_REPO"], revision=os.environ["KVSHUTTLE_MODEL_REVISION"],
                        local_dir=os.environ["KVSHUTTLE_MODEL_DIR"], allow_patterns=patterns.split(",") if patterns else None)
  env:
    - {name: KVSHUTTLE_MODEL_REPO, value: {{ $m.huggingface.repo | quote }}}
    - {name: KVSHUTTLE_MODEL_REVISION, value: {{ $m.huggingface.revision | default "main" | quote }}}
    - {name: KVSHUTTLE_MODEL_DIR, value: {{ printf "%s/hf" $mount | quote }}}
    - {name: HF_HOME, value: /tmp/hf}
{{- if $tokenizerOnly }}
    - {name: KVSHUTTLE_MODEL_PATTERNS, value: "*.json,*.jinja,*.model,*.txt,*.tiktoken"}
{{- end }}
{{- with ($m.huggingface.tokenSecret | default dict) }}{{ if .name }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef: {name: {{ .name | quote }}, key: {{ .key | default "token" | quote }}}
{{- end }}{{ end }}
{{- end }}
  volumeMounts:
    - {name: {{ $volume }}, mountPath: {{ $mount }}}
    - {name: tmp, mountPath: /tmp}
{{- end }}
{{- end -}}

{{/* A checksum annotation, so pods restart when the chart-made config they read changes. */}}
{{- define "kvshuttle.apiKeysSecretName" -}}
{{- if .Values.gateway.apiKeys.existingSecret -}}
{{- .Values.gateway.apiKeys.existingSecret -}}
{{- else if .Values.gateway.apiKeys.entries -}}
{{- include "kvshuttle.component" (list . "api-keys") -}}
{{- end -}}
{{- end -}}

{{/* PodDisruptionBudget of a component with more than one replica. Call with (list $ component values). */}}
{{- define "kvshuttle.pdb" -}}
{{- $ := index . 0 -}}{{- $component := index . 1 -}}{{- $c := index . 2 -}}
{{- if and $c.podDisruptionBudget.enabled (or (gt (int $c.replicas) 1) (and $c.autoscaling $c.autoscaling.enabled)) }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kvshuttle.component" (list $ $component) }}
  labels:
    {{- with (include "kvshuttle.labels" (list $ $component) | trim) }}{{- . | nindent 4 }}{{- end }}
spec:
  maxUnavailable: {{ $c.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- with (include "kvshuttle.selectorLabels" (list $ $component) | trim) }}{{- . | nindent 6 }}{{- end }}
{{- end }}
{{- end -}}

{{/*
One control-plane Deployment + Service (+ PodDisruptionBudget). Call with a dict:
  root, component, values (the component's values), args, env, mounts, volumes, initContainers (YAML list items
  as strings), ports (container ports), servicePorts, probe (the probe's action).
*/}}
{{- define "kvshuttle.controlPlane" -}}
{{- $ := .root -}}{{- $c := .values -}}{{- $component := .component -}}
{{- $name := include "kvshuttle.component" (list $ $component) -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- with (include "kvshuttle.labels" (list $ $component) | trim) }}{{- . | nindent 4 }}{{- end }}
spec:
  {{- if not (and $c.autoscaling $c.autoscaling.enabled) }}
  replicas: {{ $c.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- with (include "kvshuttle.selectorLabels" (list $ $component) | trim) }}{{- . | nindent 6 }}{{- end }}
  template:
    metadata:
      labels:
        {{- with (include "kvshuttle.selectorLabels" (list $ $component) | trim) }}{{- . | nindent 8 }}{{- end }}
      annotations:
        kvshuttle.io/config-checksum: {{ .checksum | default "" | sha256sum | trunc 16 | quote }}
        {{- with (include "kvshuttle.tlsChecksum" (list $ $component)) }}
        kvshuttle.io/tls-checksum: {{ . | quote }}
        {{- end }}
        {{- with (include "kvshuttle.metricsAnnotations" (list $ (.metricsPort | default $.Values.metrics.port) .metricsScheme) | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $c.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- with (include "kvshuttle.podCommon" $ | trim) }}{{- . | nindent 6 }}{{- end }}
      {{- with (include "kvshuttle.scheduling" $c | trim) }}{{- . | nindent 6 }}{{- end }}
      {{- with (.initContainers | default "" | trim) }}
      initContainers:
        {{- . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $component }}
          image: {{ include "kvshuttle.image" (list $ $.Values.images.controlPlane) }}
          imagePullPolicy: {{ $.Values.images.pullPolicy }}
          args:
            - {{ $component }}
            {{- .args | trim | nindent 12 }}
            {{- with (include "kvshuttle.flags" $c.settings | trim) }}{{- . | nindent 12 }}{{- end }}
          env:
            {{- with (include "kvshuttle.commonEnv" $ | trim) }}{{- . | nindent 12 }}{{- end }}
            {{- with (include "kvshuttle.serverTlsEnv" (list $ $component) | trim) }}{{- . | nindent 12 }}{{- end }}
            {{- with (.env | default "" | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
          ports:
            {{- .ports | trim | nindent 12 }}
          startupProbe:
            {{- .probe | trim | nindent 12 }}
            periodSeconds: 2
            failureThreshold: 90
          readinessProbe:
            {{- .probe | trim | nindent 12 }}
            periodSeconds: 5
            timeoutSeconds: 3
          livenessProbe:
            {{- .probe | trim | nindent 12 }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 6
          resources:
            {{- toYaml $c.resources | nindent 12 }}
          securityContext:
            {{- toYaml $.Values.securityContext | nindent 12 }}
          {{- $mounts := printf "%s\n%s" (include "kvshuttle.tlsVolumeMounts" $) (.mounts | default "") | trim }}
          {{- if $mounts }}
          volumeMounts:
            {{- $mounts | nindent 12 }}
          {{- end }}
      {{- $volumes := printf "%s\n%s" (include "kvshuttle.tlsVolumes" (list $ $component)) (.volumes | default "") | trim }}
      {{- if $volumes }}
      volumes:
        {{- $volumes | nindent 8 }}
      {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- with (include "kvshuttle.labels" (list $ $component) | trim) }}{{- . | nindent 4 }}{{- end }}
  {{- with $c.service }}{{ with .annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}{{ end }}
spec:
  type: {{ if $c.service }}{{ $c.service.type | default "ClusterIP" }}{{ else }}ClusterIP{{ end }}
  selector:
    {{- with (include "kvshuttle.selectorLabels" (list $ $component) | trim) }}{{- . | nindent 4 }}{{- end }}
  ports:
    {{- .servicePorts | trim | nindent 4 }}
{{- include "kvshuttle.pdb" (list $ $component $c) }}
{{- end -}}

{{/* A list of strings as quoted YAML list items. */}}
{{- define "kvshuttle.quotedList" -}}
{{- range . }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* prometheus.io/* pod annotations. Call with (list $ port scheme). */}}
{{- define "kvshuttle.metricsAnnotations" -}}
{{- $ := index . 0 -}}
{{- if and $.Values.metrics.enabled $.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
prometheus.io/scheme: {{ index . 2 | default "http" | quote }}
{{- end }}
{{- end -}}

{{/* --metrics-listen of a process that serves metrics on the metrics port. */}}
{{- define "kvshuttle.metricsArgs" -}}
{{- if .Values.metrics.enabled }}
- {{ printf "--metrics-listen=0.0.0.0:%d" (int .Values.metrics.port) | quote }}
{{- end }}
{{- end -}}
{{- define "kvshuttle.metricsPort" -}}
{{- if .Values.metrics.enabled }}
- {name: metrics, containerPort: {{ .Values.metrics.port }}, protocol: TCP}
{{- end }}
{{- end -}}
{{- define "kvshuttle.metricsServicePort" -}}
{{- if .Values.metrics.enabled }}
- {name: metrics, port: {{ .Values.metrics.port }}, targetPort: metrics, protocol: TCP}
{{- end }}
{{- end -}}

{{/* Labels that pick one component's pods in NetworkPolicies. Call with (list $ component). */}}
{{- define "kvshuttle.policyLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "kvshuttle.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
{{- /* Workers by their role: every model's pool of that role (prefill, prefill-<id>, ...). */}}
{{- if has (index . 1) (list "prefill" "decode") }}
kvshuttle.io/worker-role: {{ index . 1 }}
{{- else }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}
{{- end -}}

{{/* The port of an endpoint (host:port, scheme://[user@]host:port/path), or the default. Call with (list endpoint
default). */}}
{{- define "kvshuttle.endpointPort" -}}
{{- $hostport := regexReplaceAll "^[a-zA-Z][a-zA-Z0-9+.-]*://" (index . 0) "" | splitList "/" | first | splitList "@" | last -}}
{{- $port := regexFind ":[0-9]+$" $hostport | trimPrefix ":" -}}
{{- $port | default (index . 1) -}}
{{- end -}}
