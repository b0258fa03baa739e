{{/* kube-scheduler's configuration of the vgpu scheduler profile; the comments are in
deploy/k8s/base/scheduler/config.yaml, which this renders to with the default values. Two
extender entries, both the allocator: GPU pods (filter, bind; every resource name the
allocator reads is managed) and every pod (prioritize, weight 60, ignorable). */}}
{{- define "vgpu.schedulerConfig" -}}
{{- $url := printf "https://%s:9443/scheduler" (include "vgpu.allocatorHost" .) -}}
{{- $v := .Values -}}
{{- $slice := list $v.resourceMem $v.resourceMemPercentage $v.resourceCores $v.resourcePriority -}}
{{- $peers := list "volcano.sh/vgpu-number" "volcano.sh/vgpu-memory" "volcano.sh/vgpu-memory-percentage" "volcano.sh/vgpu-cores" "aliyun.com/gpu-mem" "tencent.com/vcuda-core" "tencent.com/vcuda-memory" "docker.com/vcuda-core" "docker.com/vcuda-memory" "k8s.amazonaws.com/vgpu" -}}
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: {{ $v.scheduler.leaderElect }}
  resourceLock: leases
  resourceName: vgpu-scheduler
  resourceNamespace: {{ include "vgpu.namespace" . }}
profiles:
- schedulerName: {{ $v.schedulerName }}
extenders:
- urlPrefix: {{ $url }}
  filterVerb: filter
  bindVerb: bind
  enableHTTPS: true
  tlsConfig:
    certFile: /etc/vgpu/extender-client/tls.crt
    keyFile: /etc/vgpu/extender-client/tls.key
    caFile: /etc/vgpu/extender-client/ca.crt
  httpTimeout: 5s
  nodeCacheCapable: true
  ignorable: false
  managedResources:
  - name: {{ $v.resourceName }}
    ignoredByScheduler: false
  {{- range concat $slice $peers }}
  - name: {{ . }}
    ignoredByScheduler: true
  {{- end }}
- urlPrefix: {{ $url }}
  prioritizeVerb: prioritize
  weight: 60
  enableHTTPS: true
  tlsConfig:
    certFile: /etc/vgpu/extender-client/tls.crt
    keyFile: /etc/vgpu/extender-client/tls.key
    caFile: /etc/vgpu/extender-client/ca.crt
  httpTimeout: 5s
  nodeCacheCapable: true
  ignorable: true
{{- end }}
