{{/*
Names. R = fullname = the release name unless fullnameOverride is set; every object is R or R-<part>.
*/}}
{{- define "clipstream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "clipstream.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- end }}

{{- define "clipstream.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "clipstream.labels" -}}
helm.sh/chart: {{ include "clipstream.chart" . }}
{{ include "clipstream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: clipstream
{{- end }}

{{- define "clipstream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "clipstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component: (dict "ctx" $ "component" "qdrant"). */}}
{{- define "clipstream.componentLabels" -}}
{{ include "clipstream.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "clipstream.componentSelector" -}}
{{ include "clipstream.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The clipstream image: <repository>:<tag or appVersion-variant>. */}}
{{- define "clipstream.image" -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion .Values.image.variant) .Values.image.tag) }}
{{- end }}

{{- define "clipstream.grpcPort" -}}
{{- int .Values.settings.grpc_port }}
{{- end }}

{{/* Secret names: the chart's R-<part>, or the existingSecret that replaces it. */}}
{{- define "clipstream.secret.qdrant" -}}
{{- default (printf "%s-qdrant" (include "clipstream.fullname" .)) .Values.secrets.qdrant.existingSecret }}
{{- end }}
{{- define "clipstream.secret.api" -}}
{{- default (printf "%s-api" (include "clipstream.fullname" .)) .Values.secrets.api.existingSecret }}
{{- end }}
{{- define "clipstream.secret.postgres" -}}
{{- default (printf "%s-postgres" (include "clipstream.fullname" .)) .Values.secrets.postgres.existingSecret }}
{{- end }}
{{- define "clipstream.secret.objectStore" -}}
{{- default (printf "%s-object-store" (include "clipstream.fullname" .)) .Values.secrets.objectStore.existingSecret }}
{{- end }}
{{/* Ray's token (key auth_token, the key KubeRay's authOptions.secretName reads). */}}
{{- define "clipstream.secret.rayAuth" -}}
{{- default (printf "%s-ray-auth" (include "clipstream.fullname" .)) .Values.secrets.rayAuth.existingSecret }}
{{- end }}

{{/* Object-store credentials are needed when MLflow's artifacts or the runs live on one. */}}
{{- define "clipstream.objectStore" -}}
{{- if or .Values.mlflow.artifacts.objectStore.uri .Values.runs.uri }}true{{ end }}
{{- end }}

{{/* The runs storage of training: the object-store URI, or the PVC (its claim name) mounted at runsMount. */}}
{{- define "clipstream.runsMount" -}}/mnt/clipstream/runs{{- end }}
{{- define "clipstream.runsDir" -}}
{{- default (include "clipstream.runsMount" .) .Values.runs.uri }}
{{- end }}
{{- define "clipstream.runsClaim" -}}
{{- if not .Values.runs.uri }}
{{- default (printf "%s-runs" (include "clipstream.fullname" .)) .Values.runs.existingClaim }}
{{- end }}
{{- end }}

{{/*
The largest gRPC request the Serve proxy accepts (services/app.py MAX_REQUEST_BYTES, several images of
settings.serve_max_image_bytes each): the proxy's limit and the Ingress body limit are this one number.
*/}}
{{- define "clipstream.maxRequestBytes" -}}67108864{{- end }}

{{/* Where the bundled or external services are. */}}
{{- define "clipstream.mlflowUri" -}}
{{- if .Values.mlflow.enabled }}
{{- printf "http://%s-mlflow:5000" (include "clipstream.fullname" .) }}
{{- else }}
{{- required "mlflow.external.trackingUri is required when mlflow.enabled is false" .Values.mlflow.external.trackingUri }}
{{- end }}
{{- end }}

{{- define "clipstream.qdrantUrl" -}}
{{- if .Values.qdrant.enabled }}
{{- printf "http://%s-qdrant:6333" (include "clipstream.fullname" .) }}
{{- else }}
{{- required "qdrant.external.url is required when qdrant.enabled is false" .Values.qdrant.external.url }}
{{- end }}
{{- end }}

{{- define "clipstream.postgresHost" -}}
{{- if .Values.postgres.enabled }}
{{- printf "%s-postgres" (include "clipstream.fullname" .) }}
{{- else }}
{{- required "postgres.external.host is required when postgres.enabled is false" .Values.postgres.external.host }}
{{- end }}
{{- end }}

{{- define "clipstream.postgresPort" -}}
{{- if .Values.postgres.enabled }}5432{{ else }}{{ int .Values.postgres.external.port }}{{ end }}
{{- end }}

{{/* Pod and container security for the clipstream image (uid 1000, gid 100). */}}
{{- define "clipstream.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 100
fsGroup: 100
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "clipstream.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{/*
Ray Serve's throughput settings, read when Ray's processes start: services/app.py SERVE_ENV
(tests/k8s/test_chart.py keeps the two equal).
*/}}
{{- define "clipstream.serveEnv" -}}
- name: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD
  value: "0"
- name: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP
  value: "0"
- name: RAY_SERVE_USE_GRPC_BY_DEFAULT
  value: "1"
- name: RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE
  value: "1000"
- name: RAY_SERVE_LOG_TO_STDERR
  value: "0"
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ include "clipstream.maxRequestBytes" . | quote }}
- name: RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
  value: "68157440"
{{- end }}

{{/* Environment of every Ray container (serving here; `clipstream k8s job` renders the same for training). */}}
{{- define "clipstream.rayEnvFrom" -}}
- configMapRef:
    name: {{ include "clipstream.fullname" . }}-settings
{{- if include "clipstream.objectStore" . }}
- secretRef:
    name: {{ include "clipstream.secret.objectStore" . }}
    optional: true
{{- end }}
{{- end }}

{{- define "clipstream.rayEnv" -}}
- name: CLIPSTREAM_QDRANT_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "clipstream.secret.qdrant" . }}
      key: api-key
- name: CLIPSTREAM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "clipstream.secret.api" . }}
      key: api-key
{{- with .Values.mlflow.artifacts.objectStore.endpointUrl }}
- name: AWS_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{ include "clipstream.serveEnv" . }}
{{- end }}

{{/* Serving pods read models from MLflow, never the runs storage: only training (RayJob) pods mount it. */}}
{{- define "clipstream.rayVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /home/ray/.cache
- name: dshm
  mountPath: /dev/shm
{{- end }}

{{- define "clipstream.rayVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir: {}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.ray.shmSize }}
{{- if .Values.ray.logs.sidecar.enabled }}
- name: ray-logs-config
  configMap:
    name: {{ include "clipstream.fullname" . }}-ray-logs
{{- end }}
{{- end }}

{{/*
What every pod of the chart takes from its component's values (serve.head, serve.worker, mlflow, qdrant,
postgres): (dict "pod" <values> "n" <indentation>), each rendering nothing when its values are empty.
*/}}
{{- define "clipstream.podLabels" -}}
{{- with .pod.podLabels }}{{ toYaml . | nindent $.n }}{{ end }}
{{- end }}
{{- define "clipstream.podAnnotations" -}}
{{- with .pod.podAnnotations }}{{ toYaml . | nindent $.n }}{{ end }}
{{- end }}
{{- define "clipstream.podScheduling" -}}
{{- $out := dict }}
{{- range $field := list "priorityClassName" "nodeSelector" "tolerations" "affinity" "topologySpreadConstraints" }}
{{- with index $.pod $field }}{{ $_ := set $out $field . }}{{ end }}
{{- end }}
{{- with $out }}{{ toYaml . | nindent $.n }}{{ end }}
{{- end }}
{{- define "clipstream.extraEnv" -}}
{{- with .pod.extraEnv }}{{ toYaml . | nindent $.n }}{{ end }}
{{- end }}
{{- define "clipstream.extraVolumeMounts" -}}
{{- with .pod.extraVolumeMounts }}{{ toYaml . | nindent $.n }}{{ end }}
{{- end }}
{{- define "clipstream.extraVolumes" -}}
{{- with .pod.extraVolumes }}{{ toYaml . | nindent $.n }}{{ end }}
{{- end }}

{{/* Labels of Ray pods: the component plus the NetworkPolicy access labels. */}}
{{- define "clipstream.rayPodLabels" -}}
{{ include "clipstream.componentLabels" (dict "ctx" .ctx "component" .component) }}
clipstream.io/qdrant-client: "true"
clipstream.io/mlflow-client: "true"
{{- end }}

{{/*
The serveConfigV2 of the RayService (a YAML document, see ray.serve.schema.ServeDeploySchema). The serving
settings (settings.serve_*) go to the application builder as `args` (services/app.py `app`), which KubeRay applies
to the running cluster in place; with serve.autoscaling, Serve scales the Encoder between its bounds.
*/}}
{{- define "clipstream.serveConfig" -}}
{{- $grpc := dict "port" (int .Values.settings.grpc_port) "enable_reflection" true "grpc_servicer_functions" (list
  "clipstream.services.binding.retry_dead_replicas"
  "clipstream.v1.encoder_pb2_grpc.add_EncoderServiceServicer_to_server"
  "clipstream.v1.search_pb2_grpc.add_SearchServiceServicer_to_server"
  "clipstream.v1.admin_pb2_grpc.add_AdminServiceServicer_to_server"
  "clipstream.services.health.add_health_service") }}
{{- $args := dict }}
{{- range $field, $value := .Values.settings }}
{{- if hasPrefix "serve_" $field }}
{{- $_ := set $args $field $value }}
{{- end }}
{{- end }}
{{- $app := dict "name" "clipstream" "import_path" "clipstream.services.app:app" "route_prefix" "/clipstream"
  "args" $args }}
{{- with .Values.serve.autoscaling }}
{{- if .enabled }}
{{- $scaling := dict "min_replicas" (int .minReplicas) "max_replicas" (int .maxReplicas)
  "initial_replicas" (int $.Values.settings.serve_replicas) "target_ongoing_requests" .targetOngoingRequests }}
{{- $_ := set $app "deployments" (list (dict "name" "Encoder" "num_replicas" "auto" "autoscaling_config" $scaling)) }}
{{- end }}
{{- end }}
{{- toYaml (dict "proxy_location" "EveryNode" "grpc_options" $grpc "applications" (list $app)) }}
{{- end }}

{{/*
The checksum that rolls the Ray pods when the settings they read at start change: ConfigMap R-settings less the
serving settings, which reach the replicas as serveConfigV2 `args` (applied in place, no new pods).
*/}}
{{- define "clipstream.podSettingsChecksum" -}}
{{- $data := (include (print .Template.BasePath "/configmap.yaml") . | fromYaml).data }}
{{- $pod := dict }}
{{- range $key, $value := $data }}
{{- if not (hasPrefix "CLIPSTREAM_SERVE_" $key) }}
{{- $_ := set $pod $key $value }}
{{- end }}
{{- end }}
{{- toJson $pod | sha256sum }}
{{- end }}

{{/* Checks of value combinations the schema cannot express. */}}
{{- define "clipstream.validate" -}}
{{- if and (gt (int .Values.mlflow.replicas) 1) .Values.mlflow.enabled (not .Values.mlflow.artifacts.objectStore.uri) }}
{{- fail "mlflow.replicas > 1 needs mlflow.artifacts.objectStore.uri (the artifacts PVC is ReadWriteOnce)" }}
{{- end }}
{{- if or (lt (int .Values.serve.replicas) (int .Values.serve.minReplicas)) (gt (int .Values.serve.replicas) (int .Values.serve.maxReplicas)) }}
{{- fail "serve.replicas must lie between serve.minReplicas and serve.maxReplicas" }}
{{- end }}
{{- with .Values.serve.autoscaling }}
{{- if and .enabled (or (lt (int $.Values.settings.serve_replicas) (int .minReplicas)) (gt (int $.Values.settings.serve_replicas) (int .maxReplicas))) }}
{{- fail "settings.serve_replicas (the Encoder replicas autoscaling starts from) must lie between serve.autoscaling.minReplicas and serve.autoscaling.maxReplicas" }}
{{- end }}
{{- end }}
{{- if and .Values.ingress.enabled (not .Values.ingress.host) }}
{{- fail "ingress.host is required when ingress.enabled is true" }}
{{- end }}
{{- if and .Values.grpcRoute.enabled (not .Values.grpcRoute.parentRefs) }}
{{- fail "grpcRoute.parentRefs is required when grpcRoute.enabled is true (the Gateway it attaches to)" }}
{{- end }}
{{- if and .Values.metrics.enabled .Values.networkPolicy.enabled (not .Values.metrics.scrapeFrom) }}
{{- fail "metrics.scrapeFrom is empty: the NetworkPolicies would refuse every scrape (name Prometheus' namespace or pods)" }}
{{- end }}
{{- if and .Values.runs.uri .Values.runs.existingClaim }}
{{- fail "runs.uri and runs.existingClaim exclude each other: runs go to the object store or to a PVC" }}
{{- end }}
{{- end }}

{{/*
Ray and Serve write their logs under /tmp/ray/session_latest/logs of each Ray pod. KubeRay's logging guide
ships them with a Fluent Bit sidecar that tails them from the shared volume: here to its stdout, so that the
cluster's log pipeline (kubectl logs -c ray-logs, any node-level collector) has them. Ray pods only
(ray.logs.sidecar.enabled).
*/}}
{{- define "clipstream.rayLogSidecar" -}}
- name: ray-logs
  image: "{{ .Values.ray.logs.sidecar.image.repository }}:{{ .Values.ray.logs.sidecar.image.tag }}"
  imagePullPolicy: {{ .Values.ray.logs.sidecar.image.pullPolicy }}
  command: [/fluent-bit/bin/fluent-bit, --config=/fluent-bit/etc/ray/fluent-bit.conf]
  resources:
    {{- toYaml .Values.ray.logs.sidecar.resources | nindent 4 }}
  securityContext:
    {{- include "clipstream.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - {name: tmp, mountPath: /tmp, readOnly: true}
    - {name: ray-logs-config, mountPath: /fluent-bit/etc/ray, readOnly: true}
{{- end }}

{{/* MLflow's database password (server and migration): libpq's PGPASSWORD, from Secret R-postgres. */}}
{{- define "clipstream.mlflowDbEnv" -}}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "clipstream.secret.postgres" . }}
      key: password
{{- end }}
