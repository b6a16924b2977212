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

{{/*
The object store settings, checked (render fails naming the value): whether it is on, and
what is missing. Call with the root context; renders "true" or "".
*/}}
{{- define "warmstart.objectStore" -}}
{{- $s := .Values.objectStore -}}
{{- if $s.endpoint -}}
{{- if not (regexMatch "^https?://[^/]+" $s.endpoint) -}}
{{- fail (printf "objectStore.endpoint %q: an http:// or https:// URL is needed" $s.endpoint) -}}
{{- end -}}
{{- if not $s.bucket -}}
{{- fail "objectStore.bucket: required with objectStore.endpoint" -}}
{{- end -}}
{{- if not $s.credentials.existingSecret -}}
{{- fail "objectStore.credentials.existingSecret: required with objectStore.endpoint (the name of a Secret in the release namespace holding the access key id and secret access key; the chart never takes the keys themselves)" -}}
{{- end -}}
{{- if and $s.ca.configMap $s.ca.secret -}}
{{- fail "objectStore.ca: set configMap or secret, not both" -}}
{{- end -}}
{{- if not .Values.agent.cache.enabled -}}
{{- fail "objectStore.endpoint needs agent.cache.enabled=true: restores fetch artifacts from the object store into the node cache" -}}
{{- end -}}
true
{{- else -}}
{{- if or $s.bucket $s.credentials.existingSecret $s.ca.configMap $s.ca.secret -}}
{{- fail "objectStore.endpoint: required when any other objectStore setting (bucket, credentials.existingSecret, ca) is set" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The object store's environment (the controller's and the agent's). */}}
{{- define "warmstart.objectStoreEnv" -}}
{{- $s := .Values.objectStore -}}
- name: WARMSTART_S3_ENDPOINT
  value: {{ $s.endpoint | quote }}
- name: WARMSTART_S3_BUCKET
  value: {{ $s.bucket | quote }}
{{- with $s.prefix }}
- name: WARMSTART_S3_PREFIX
  value: {{ . | quote }}
{{- end }}
- name: WARMSTART_S3_REGION
  value: {{ $s.region | quote }}
- name: WARMSTART_S3_PATH_STYLE
  value: {{ $s.pathStyle | quote }}
- name: WARMSTART_S3_COMPRESSION_LEVEL
  value: {{ $s.compressionLevel | quote }}
# Files of the mounted Secret: the keys never appear in the pod's spec.
- name: WARMSTART_S3_ACCESS_KEY_ID_FILE
  value: /etc/warmstart/s3-credentials/{{ $s.credentials.accessKeyIdKey }}
- name: WARMSTART_S3_SECRET_ACCESS_KEY_FILE
  value: /etc/warmstart/s3-credentials/{{ $s.credentials.secretAccessKeyKey }}
{{- if or $s.ca.configMap $s.ca.secret }}
- name: WARMSTART_S3_CA_FILE
  value: /etc/warmstart/s3-ca/{{ $s.ca.key }}
{{- end }}
{{- end -}}

{{/* The object store's volume mounts. */}}
{{- define "warmstart.objectStoreMounts" -}}
- name: s3-credentials
  mountPath: /etc/warmstart/s3-credentials
  readOnly: true
{{- if or .Values.objectStore.ca.configMap .Values.objectStore.ca.secret }}
- name: s3-ca
  mountPath: /etc/warmstart/s3-ca
  readOnly: true
{{- end }}
{{- end -}}

{{/* The object store's volumes: the credentials Secret (only its two keys), the CA bundle. */}}
{{- define "warmstart.objectStoreVolumes" -}}
{{- $s := .Values.objectStore -}}
- name: s3-credentials
  secret:
    secretName: {{ $s.credentials.existingSecret }}
    defaultMode: 288 # 0440: root, and the group (fsGroup) of a non-root container
    items:
      - key: {{ $s.credentials.accessKeyIdKey }}
        path: {{ $s.credentials.accessKeyIdKey }}
      - key: {{ $s.credentials.secretAccessKeyKey }}
        path: {{ $s.credentials.secretAccessKeyKey }}
{{- if $s.ca.configMap }}
- name: s3-ca
  configMap:
    name: {{ $s.ca.configMap }}
    items:
      - key: {{ $s.ca.key }}
        path: {{ $s.ca.key }}
{{- else if $s.ca.secret }}
- name: s3-ca
  secret:
    secretName: {{ $s.ca.secret }}
    items:
      - key: {{ $s.ca.key }}
        path: {{ $s.ca.key }}
{{- end }}
{{- end -}}
