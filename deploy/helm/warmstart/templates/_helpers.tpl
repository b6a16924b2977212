{{/*
Labels every object carries: deploy/'s own (name, component, part-of) and Helm's.
Call with (dict "ctx" $ "name" "warmstart-agent" "component" "agent").
*/}}
{{- define "warmstart.labels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: warmstart
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Labels of the pods (no version: a pod template changing with every upgrade rolls pods for nothing). */}}
{{- define "warmstart.podLabels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: warmstart
{{- end -}}

{{/* An image reference: repository, then @digest, or :tag (the chart's appVersion when empty). */}}
{{- define "warmstart.image" -}}
{{- $image := index . 0 -}}
{{- $ctx := index . 1 -}}
{{- if not $image.repository -}}
{{- fail "image.*.repository must not be empty" -}}
{{- end -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default $ctx.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "warmstart.controllerImage" -}}
{{- include "warmstart.image" (list .Values.image.controller .) -}}
{{- end -}}

{{- define "warmstart.agentImage" -}}
{{- include "warmstart.image" (list .Values.image.agent .) -}}
{{- end -}}

{{/* The image Wrap pods copy warmstart-entrypoint from: image.wrap, else the agent image. */}}
{{- define "warmstart.wrapImage" -}}
{{- if .Values.image.wrap.repository -}}
{{- include "warmstart.image" (list .Values.image.wrap .) -}}
{{- else -}}
{{- include "warmstart.agentImage" . -}}
{{- end -}}
{{- end -}}

{{/* The artifact claim's name: an existing one, or the one the chart creates. */}}
{{- define "warmstart.claimName" -}}
{{- default .Values.storage.claimName .Values.storage.existingClaim -}}
{{- end -}}

{{/*
The runtime's paths as a dict (socket, stateDir, rootDir, crioStorage): the preset of
runtime.name, each overridden by its own value.
*/}}
{{- define "warmstart.runtime" -}}
{{- $presets := dict
  "containerd" (dict "socket" "/run/containerd/containerd.sock" "stateDir" "/run/containerd" "rootDir" "/var/lib/containerd")
  "crio" (dict "socket" "/var/run/crio/crio.sock" "stateDir" "/run/containerd" "rootDir" "/var/lib/containerd")
  "k3s" (dict "socket" "/run/k3s/containerd/containerd.sock" "stateDir" "/run/k3s/containerd" "rootDir" "/var/lib/rancher/k3s/agent/containerd")
  "rke2" (dict "socket" "/run/k3s/containerd/containerd.sock" "stateDir" "/run/k3s/containerd" "rootDir" "/var/lib/rancher/rke2/agent/containerd")
-}}
{{- $r := .Values.runtime -}}
{{- $p := get $presets $r.name -}}
{{- if not $p -}}
{{- fail (printf "runtime.name %q: expected containerd, crio, k3s or rke2" $r.name) -}}
{{- end -}}
{{- dict
  "socket" (default $p.socket $r.socket)
  "stateDir" (default $p.stateDir $r.containerdStateDir)
  "rootDir" (default $p.rootDir $r.containerdRootDir)
  "crioStorage" (default "/var/lib/containers/storage" $r.crioStorageDir)
  | toJson -}}
{{- end -}}
