{{/* The namespace of every namespaced object. */}}
{{- define "vgpu.namespace" -}}
{{ .Values.namespace.name }}
{{- end }}

{{/* Labels on every object: the kustomize base's, then Helm's bookkeeping. */}}
{{- define "vgpu.labels" -}}
app.kubernetes.io/part-of: vgpu
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* Labels of one component's objects and pods (selectors use name + component). */}}
{{- define "vgpu.selector" -}}
app.kubernetes.io/name: vgpu
app.kubernetes.io/component: {{ . }}
{{- end }}

{{/* An image reference from {registry, repository, tag}: the registry defaults to
global.imageRegistry, the tag to the chart's appVersion. */}}
{{- define "vgpu.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- $registry := $image.registry | default $root.Values.global.imageRegistry -}}
{{- $tag := $image.tag | default $root.Chart.AppVersion -}}
{{- if $registry }}{{ printf "%s/%s:%s" $registry $image.repository $tag }}{{ else }}{{ printf "%s:%s" $image.repository $tag }}{{ end }}
{{- end }}

{{/* A ConfigMap name with a content hash, as kustomize's configMapGenerator makes them: a
changed file gives a new name, so the pods that mount it roll. */}}
{{- define "vgpu.hashedName" -}}
{{- $name := index . 0 -}}
{{- $content := index . 1 -}}
{{ printf "%s-%s" $name ($content | sha256sum | trunc 10) }}
{{- end }}

{{- define "vgpu.natsConfigName" -}}
{{ include "vgpu.hashedName" (list "vgpu-nats-config" (.Files.Get "files/nats.conf")) }}
{{- end }}

{{- define "vgpu.natsScriptName" -}}
{{ include "vgpu.hashedName" (list "vgpu-nats-credentials-script" (.Files.Get "files/nats_credentials.py")) }}
{{- end }}

{{- define "vgpu.extenderCertsScriptName" -}}
{{ include "vgpu.hashedName" (list "vgpu-extender-certs-script" (.Files.Get "files/extender_certs.py")) }}
{{- end }}

{{- define "vgpu.schedulerConfigName" -}}
{{ include "vgpu.hashedName" (list "vgpu-scheduler-config" (include "vgpu.schedulerConfig" .)) }}
{{- end }}

{{/* The pod-level pull secrets, if any. */}}
{{- define "vgpu.pullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end }}

{{/* The allocator's Service address, for kube-scheduler's extender and the certificate. */}}
{{- define "vgpu.allocatorHost" -}}
vgpu-allocator.{{ include "vgpu.namespace" . }}.svc
{{- end }}

{{/* The allocator's request settings, each only where it differs from the service's default
(so the default rendering stays the kustomize one). */}}
{{- define "vgpu.requestEnv" -}}
{{- $v := .Values -}}
{{- $names := list
  (list "VGPU_RESOURCE_GPU" $v.resourceName "nvidia.com/gpu")
  (list "VGPU_RESOURCE_MEMORY" $v.resourceMem "nvidia.com/gpumem")
  (list "VGPU_RESOURCE_MEMORY_PERCENT" $v.resourceMemPercentage "nvidia.com/gpumem-percentage")
  (list "VGPU_RESOURCE_CORES" $v.resourceCores "nvidia.com/gpucores")
  (list "VGPU_RESOURCE_PRIORITY" $v.resourcePriority "nvidia.com/priority")
  (list "VGPU_DEFAULT_MEMORY_MIB" (toString $v.scheduler.defaultMem) "0")
  (list "VGPU_DEFAULT_CORES" (toString $v.scheduler.defaultCores) "0")
  (list "VGPU_NODE_POLICY" $v.scheduler.defaultSchedulerPolicy.nodeSchedulerPolicy "")
  (list "VGPU_GPU_POLICY" $v.scheduler.defaultSchedulerPolicy.gpuSchedulerPolicy "")
  (list "VGPU_MEMORY_UNIT" $v.scheduler.memoryUnit "GiB")
  (list "VGPU_ADOPT_SCHEDULERS" (join "," $v.scheduler.adoptSchedulers) "hami-scheduler")
  (list "VGPU_COUNT_ONLY_EQUAL_SHARE" (toString $v.scheduler.countOnlyEqualShare) "false")
-}}
{{- range $names }}
{{- if ne (index . 1) (index . 2) }}
- name: {{ index . 0 }}
  value: {{ index . 1 | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The node agent's node-affinity terms: one per GPU-node label (any one suffices), and the
peers' labels with devicePlugin.peerNodeLabels. */}}
{{- define "vgpu.gpuNodeTerms" -}}
{{- $labels := .Values.devicePlugin.gpuNodeLabels -}}
{{- if .Values.devicePlugin.peerNodeLabels -}}
{{- $labels = concat $labels (list (dict "key" "nvidia-device-enable" "value" "enable") (dict "key" "k8s.amazonaws.com/accelerator" "value" "vgpu")) -}}
{{- end -}}
{{- range $labels }}
- matchExpressions:
  - key: {{ .key }}
    operator: In
    values: [{{ .value | quote }}]
{{- end }}
{{- end }}

{{/* NVIDIA's device-plugin config file the node agent reads, as {name, key} of its ConfigMap,
or nothing. devicePlugin.config.map (inline files, as NVIDIA's chart takes them) makes the
ConfigMap; config.name names one that exists. The file used is config.default, or the only
one. */}}
{{- define "vgpu.devicePluginConfig" -}}
{{- $c := .Values.devicePlugin.config -}}
{{- if and $c.map $c.name }}
{{- fail "devicePlugin.config: give map (the files) or name (an existing ConfigMap), not both" }}
{{- end }}
{{- if or $c.map $c.name }}
{{- $key := $c.default }}
{{- if and (not $key) $c.map (eq (len $c.map) 1) }}
{{- $key = keys $c.map | first }}
{{- end }}
{{- if not $key }}
{{- fail "devicePlugin.config.default: name the file to use (a key of the ConfigMap); per-node selection by label is not supported" }}
{{- end }}
{{- if and $c.map (not (hasKey $c.map $key)) }}
{{- fail (printf "devicePlugin.config.default: %q is not a key of devicePlugin.config.map" $key) }}
{{- end }}
name: {{ $c.name | default (include "vgpu.hashedName" (list "vgpu-device-plugin-config" (toJson $c.map))) }}
key: {{ $key }}
{{- end }}
{{- end }}
