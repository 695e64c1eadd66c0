{{/* Names and labels. */}}
{{- define "specedge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped name; <= 47 chars, KubeRay's RayService name limit. */}}
{{- define "specedge.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specedge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specedge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specedge.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "specedge.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specedge
{{- end }}

{{- define "specedge.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* ---------------- GPU accounting (one verifier replica = pipeline stages) ---------------- */}}

{{/* GPUs one verifier replica holds: ceil(pipeline_parallel_size * tensor_parallel_size * num_gpus_per_stage). */}}
{{- define "specedge.gpusPerReplica" -}}
{{- $v := .Values.app.verifier | default dict }}
{{- $pp := $v.pipeline_parallel_size | default 1 }}
{{- $tp := $v.tensor_parallel_size | default 1 }}
{{- $g := $v.num_gpus_per_stage | default 0 }}
{{- mulf (mul $pp $tp) $g | ceil | int }}
{{- end }}

{{/* GPUs per worker pod: gpuWorkers.gpusPerPod, default one replica per pod. */}}
{{- define "specedge.gpusPerPod" -}}
{{- $gpr := include "specedge.gpusPerReplica" . | int }}
{{- $gpp := .Values.gpuWorkers.gpusPerPod | default $gpr | int }}
{{- if and (gt $gpr 0) (le $gpp 0) }}
{{- fail "gpuWorkers.gpusPerPod must be positive" }}
{{- end }}
{{- $tp := (.Values.app.verifier | default dict).tensor_parallel_size | default 1 | int }}
{{- if and (gt $tp 1) (gt $gpr 0) (ne (mod $gpp $gpr) 0) }}
{{- fail (printf "gpuWorkers.gpusPerPod=%d: tensor_parallel_size %d places a verifier replica's %d GPUs on one node (STRICT_PACK): a multiple of them per pod" $gpp $tp $gpr) }}
{{- end }}
{{- if and (gt $gpr 0) (ne (mod $gpp $gpr) 0) (ne (mod $gpr $gpp) 0) }}
{{- fail (printf "gpuWorkers.gpusPerPod=%d must be a multiple or a divisor of the GPUs per verifier replica (%d)" $gpp $gpr) }}
{{- end }}
{{- $gpp }}
{{- end }}

{{/* Worker pods for a number of verifier replicas: (dict "root" $ "replicas" N). */}}
{{- define "specedge.gpuPods" -}}
{{- $gpr := include "specedge.gpusPerReplica" .root | int }}
{{- $gpp := include "specedge.gpusPerPod" .root | int }}
{{- $total := mul $gpr (int .replicas) }}
{{- if eq $gpr 0 }}
{{- 0 }}
{{- else }}
{{- if ne (mod $total $gpp) 0 }}
{{- fail (printf "%d verifier replicas x %d GPUs = %d GPUs do not fill whole pods of gpuWorkers.gpusPerPod=%d" (int .replicas) $gpr $total $gpp) }}
{{- end }}
{{- div $total $gpp }}
{{- end }}
{{- end }}

{{/* Verifier replicas KubeRay provisions for: Serve's min/max when autoscaling, else num_replicas. */}}
{{- define "specedge.verifierReplicas" -}}
{{- $v := .Values.app.verifier | default dict }}
{{- if .Values.serve.autoscaling.enabled }}
{{- .Values.serve.autoscaling.minReplicas | int }}
{{- else }}
{{- $v.num_replicas | default 1 | int }}
{{- end }}
{{- end }}

{{- define "specedge.verifierMaxReplicas" -}}
{{- if .Values.serve.autoscaling.enabled }}
{{- .Values.serve.autoscaling.maxReplicas | int }}
{{- else }}
{{- include "specedge.verifierReplicas" . }}
{{- end }}
{{- end }}

{{/* The GPU worker pods' affinity: gpuWorkers.affinity plus, unless it has its own, a pod anti-affinity
     keeping verifier pods off each other's nodes (gpuWorkers.podAntiAffinity: preferred | required | none). */}}
{{- define "specedge.gpuWorkerAffinity" -}}
{{- $aff := deepCopy (.Values.gpuWorkers.affinity | default dict) }}
{{- $mode := .Values.gpuWorkers.podAntiAffinity | default "none" }}
{{- if and (ne $mode "none") (not (hasKey $aff "podAntiAffinity")) }}
{{- $labels := include "specedge.selectorLabels" . | fromYaml }}
{{- $_ := set $labels "app.kubernetes.io/component" "gpu-worker" }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" $labels) }}
{{- if eq $mode "required" }}
{{- $_ := set $aff "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
{{- else }}
{{- $_ := set $aff "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) }}
{{- end }}
{{- end }}
{{- if $aff }}
{{- toYaml $aff }}
{{- end }}
{{- end }}

{{/* ---------------- tenants ---------------- */}}

{{- define "specedge.tenantsEnabled" -}}
{{- if or .Values.tenants.existingSecret (and .Values.tenants.create .Values.tenants.entries) }}true{{ end }}
{{- end }}

{{- define "specedge.tenantsSecretName" -}}
{{- default (printf "%s-tenants" (include "specedge.fullname" .)) .Values.tenants.existingSecret }}
{{- end }}

{{- define "specedge.tenantsFile" -}}
{{- printf "%s/%s" (.Values.tenants.mountPath | trimSuffix "/") .Values.tenants.secretKey }}
{{- end }}

{{/* The tenants file: plain `api_key`s are replaced by their SHA-256 (hash_api_key). */}}
{{- define "specedge.tenantsYaml" -}}
{{- $out := list }}
{{- range .Values.tenants.entries }}
{{- $t := deepCopy . }}
{{- if hasKey $t "api_key" }}
{{- $_ := set $t "api_key_sha256" (sha256sum (toString $t.api_key)) }}
{{- $_ := unset $t "api_key" }}
{{- end }}
{{- $out = append $out $t }}
{{- end }}
{{- toYaml (dict "tenants" $out) }}
{{- end }}

{{/* ---------------- Serve config (serveConfigV2) ---------------- */}}

{{/* args of deploy:build_app: .Values.app plus the mounted tenants file. */}}
{{- define "specedge.appArgs" -}}
{{- $args := deepCopy (.Values.app | default dict) }}
{{- if include "specedge.tenantsEnabled" . }}
{{- $router := deepCopy (get $args "router" | default dict) }}
{{- $_ := set $router "tenants_file" (include "specedge.tenantsFile" .) }}
{{- $_ := set $args "router" $router }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{- define "specedge.serveConfig" -}}
{{- $app := dict
      "name" .Values.serve.applicationName
      "import_path" .Values.serve.importPath
      "route_prefix" (.Values.app.route_prefix | default "/")
      "args" (include "specedge.appArgs" . | fromYaml) }}
{{- if .Values.serve.autoscaling.enabled }}
{{- $as := .Values.serve.autoscaling }}
{{- $_ := set $app "deployments" (list (dict
      "name" $as.deploymentName
      "num_replicas" "auto"
      "autoscaling_config" (dict
        "min_replicas" ($as.minReplicas | int)
        "max_replicas" ($as.maxReplicas | int)
        "target_ongoing_requests" $as.targetOngoingRequests
        "upscale_delay_s" $as.upscaleDelayS
        "downscale_delay_s" $as.downscaleDelayS))) }}
{{- end }}
{{- $http := dict "host" "0.0.0.0" "port" (.Values.serve.port | int) }}
{{- if .Values.serve.requestTimeoutS }}
{{- $_ := set $http "request_timeout_s" .Values.serve.requestTimeoutS }}
{{- end }}
{{- toYaml (dict "proxy_location" .Values.serve.proxyLocation "http_options" $http "applications" (list $app)) }}
{{- end }}

{{/* ---------------- pod pieces shared by head and workers ---------------- */}}

{{- define "specedge.env" -}}
- name: HF_HOME
  value: {{ .Values.models.hfHome | quote }}
- name: HF_HUB_OFFLINE
  value: {{ ternary "1" "0" .Values.models.hfHubOffline | quote }}
- name: TOKENIZERS_PARALLELISM
  value: "false"
{{- $rp := .Values.serve.requestPath }}
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: {{ ternary "1" "0" $rp.throughputOptimized | quote }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" (eq $rp.ingress "haproxy") | quote }}
- name: RAY_SERVE_ENABLE_DIRECT_INGRESS
  value: {{ ternary "1" "0" (eq $rp.ingress "haproxy") | quote }}
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: {{ $rp.controlLoopS | quote }}
- name: RAY_SERVE_METRICS_EXPORT_INTERVAL_MS
  value: {{ $rp.metricsExportMs | quote }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "specedge.volumeMounts" -}}
- name: models
  mountPath: {{ .Values.models.mountPath }}
- name: dshm
  mountPath: /dev/shm
{{- if include "specedge.tenantsEnabled" . }}
- name: tenants
  mountPath: {{ .Values.tenants.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* volumes; argument: (dict "root" $ "shm" "<size>") */}}
{{- define "specedge.volumes" -}}
- name: models
  {{- if .root.Values.models.volume }}
  {{- toYaml .root.Values.models.volume | nindent 2 }}
  {{- else }}
  emptyDir: {}
  {{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
{{- if include "specedge.tenantsEnabled" .root }}
- name: tenants
  secret:
    secretName: {{ include "specedge.tenantsSecretName" .root }}
    items:
      - key: {{ .root.Values.tenants.secretKey }}
        path: {{ .root.Values.tenants.secretKey }}
{{- end }}
{{- end }}

{{/* Checksum of the tenants file in pod annotations: a new key list rolls the cluster. */}}
{{- define "specedge.podAnnotations" -}}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- if and .Values.tenants.restartOnChange .Values.tenants.create (not .Values.tenants.existingSecret) .Values.tenants.entries }}
checksum/tenants: {{ include "specedge.tenantsYaml" . | sha256sum }}
{{- end }}
{{- end }}
