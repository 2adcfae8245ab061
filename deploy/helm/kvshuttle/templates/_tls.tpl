{{/*
Mutual TLS between kvshuttle's services: where the certificates come from, their Secrets, and what each one names.

Identities (a certificate's Common Name): registry, scheduler, gateway, worker (every service pod mounts its own),
and admin (a client certificate for operators, mounted nowhere). The registry and the scheduler authorize each call
by it (control_plane/service_access.py).
*/}}

{{/* The identities the chart makes certificates for; the first four are mounted by its pods. */}}
{{- define "kvshuttle.tlsIdentities" -}}registry scheduler gateway worker admin{{- end -}}
{{- define "kvshuttle.tlsServiceIdentities" -}}registry scheduler gateway worker{{- end -}}

{{/*
Where the certificates come from: certManager, helm or existing; "" when TLS is off. Fails the render on values that
contradict each other (each message names the value to change).
*/}}
{{- define "kvshuttle.tlsSource" -}}
{{- if not (hasKey .Values "__kvshuttleTlsSource") -}}
{{- $_ := set .Values "__kvshuttleTlsSource" (include "kvshuttle.tlsSourceOnce" .) -}}
{{- end -}}
{{- .Values.__kvshuttleTlsSource -}}
{{- end -}}

{{- define "kvshuttle.tlsSourceOnce" -}}
{{- $t := .Values.tls -}}
{{- if $t.secretName -}}
{{- fail "tls.secretName (one certificate shared by every service) is no longer taken: each service has its own certificate, whose Common Name (registry, scheduler, gateway, worker) is the identity the registry and the scheduler authorize. Give tls.existingSecrets.registry/scheduler/gateway/worker instead, or leave them empty and the chart makes the certificates (docs/security.md, \"In the Helm chart\")" -}}
{{- end -}}
{{- if and (hasKey $t "mutual") (not $t.mutual) -}}
{{- fail "tls.mutual=false is no longer offered: the registry and the scheduler authorize every call by the caller's client certificate, so mutual TLS is what TLS means here (remove tls.mutual)" -}}
{{- end -}}
{{- $given := list -}}
{{- range $role := splitList " " (include "kvshuttle.tlsServiceIdentities" .) -}}
{{- if index $t.existingSecrets $role -}}{{- $given = append $given $role -}}{{- end -}}
{{- end -}}
{{- if not $t.enabled -}}
{{- if not $t.allowInsecure -}}
{{- fail "tls.enabled=false turns off mutual TLS between kvshuttle's services: any pod that can reach the registry or the scheduler could then register a worker of its own (and receive every tenant's prompts), or read, forge and delete any tenant's sessions. For debugging only, set tls.allowInsecure=true as well; NOTES.txt then warns." -}}
{{- end -}}
{{- if $given -}}
{{- fail (printf "tls.existingSecrets (%s) are given but tls.enabled is false: remove them, or turn TLS back on" (join ", " $given)) -}}
{{- end -}}
{{- else -}}
{{- if $t.allowInsecure -}}
{{- fail "tls.allowInsecure=true goes only with tls.enabled=false (it confirms turning TLS off): remove it" -}}
{{- end -}}
{{- $source := $t.source -}}
{{- if eq $source "auto" -}}
{{- /* Chosen once: a release whose certificates Helm made keeps them when cert-manager arrives later (switching would
change the CA under running pods); set tls.source to switch. */ -}}
{{- $made := lookup "v1" "Secret" .Release.Namespace (include "kvshuttle.component" (list . "tls-ca")) -}}
{{- $madeByHelm := hasKey ((and $made $made.metadata $made.metadata.annotations) | default dict) "kvshuttle.io/tls-spec" -}}
{{- $source = ternary "existing" (ternary "helm" (ternary "certManager" "helm" (.Capabilities.APIVersions.Has "cert-manager.io/v1")) $madeByHelm) (not (empty $given)) -}}
{{- end -}}
{{- if eq $source "existing" -}}
{{- $missing := list -}}
{{- range $role := splitList " " (include "kvshuttle.tlsServiceIdentities" .) -}}
{{- if not (has $role $given) -}}{{- $missing = append $missing (printf "tls.existingSecrets.%s" $role) -}}{{- end -}}
{{- end -}}
{{- if $missing -}}
{{- fail (printf "TLS from your own Secrets needs one per service: %s missing (or leave all four empty and the chart makes the certificates)" (join ", " $missing)) -}}
{{- end -}}
{{- else if $given -}}
{{- fail (printf "tls.existingSecrets (%s) are given but tls.source is %s: set tls.source=existing (or auto), or remove them" (join ", " $given) $source) -}}
{{- end -}}
{{- if and $t.certManager.issuerRef.name (ne $source "certManager") -}}
{{- fail (printf "tls.certManager.issuerRef is given but the certificates come from %s: set tls.source=certManager, or remove it" $source) -}}
{{- end -}}
{{- $source -}}
{{- end -}}
{{- end -}}

{{/* Name of an identity's Secret (ca.crt, tls.crt, tls.key). Call with (list $ identity); identity "ca": the CA's. */}}
{{- define "kvshuttle.tlsSecretName" -}}
{{- $ := index . 0 -}}{{- $role := index . 1 -}}
{{- if and (eq (include "kvshuttle.tlsSource" $) "existing") (ne $role "ca") -}}
{{- index $.Values.tls.existingSecrets $role -}}
{{- else -}}
{{- include "kvshuttle.component" (list $ (printf "tls-%s" $role)) -}}
{{- end -}}
{{- end -}}

{{/*
The DNS names an identity's certificate carries (JSON list): the Services its server is dialed by, in every form a
pod may use (<svc>, <svc>.<ns>, <svc>.<ns>.svc, <svc>.<ns>.svc.<clusterDomain>), and tls.serverName when set.
Workers and admin only call: no names. Call with (list $ identity).
*/}}
{{- define "kvshuttle.tlsDnsNames" -}}
{{- $ := index . 0 -}}{{- $role := index . 1 -}}
{{- $services := dict "registry" (list "registry") "scheduler" (list "scheduler" "scheduler-peers") "gateway" (list "gateway") -}}
{{- $names := list -}}
{{- range $suffix := (index $services $role | default list) -}}
{{- $svc := include "kvshuttle.component" (list $ $suffix) -}}
{{- $names = concat $names (list $svc (printf "%s.%s" $svc $.Release.Namespace) (printf "%s.%s.svc" $svc $.Release.Namespace) (printf "%s.%s.svc.%s" $svc $.Release.Namespace $.Values.tls.clusterDomain)) -}}
{{- end -}}
{{- if and (hasKey $services $role) $.Values.tls.serverName -}}
{{- $names = append $names $.Values.tls.serverName -}}
{{- end -}}
{{- if eq $role "gateway" -}}
{{- $names = concat $names $.Values.tls.gatewayDnsNames -}}
{{- end -}}
{{- toJson (uniq $names) -}}
{{- end -}}

{{/* The IP addresses an identity's certificate carries (JSON list): the gateway's REST bridge (and its in-process
scheduler) call its own gRPC API on 0.0.0.0 / 127.0.0.1. */}}
{{- define "kvshuttle.tlsIpAddresses" -}}
{{- $role := index . 1 -}}
{{- toJson (ternary (list "127.0.0.1" "0.0.0.0") list (eq $role "gateway")) -}}
{{- end -}}

{{/*
tls.source helm: the CA and every identity's certificate, made with Helm's own functions (genCA, genSignedCert) and
computed once per render (kept in .Values.__kvshuttleTls, so tls.yaml and the pods' checksum annotations see the same
ones): a dict of Secret name -> {annotations, data}.

Stable across upgrades by `lookup`: an existing CA Secret is reused, and an existing certificate is kept while it
was signed by that CA for the same names (the kvshuttle.io/tls-spec annotation); otherwise a new one is made. Chosen
over a pre-install hook Job because it needs no image, no ServiceAccount token and no RBAC to write Secrets (kvshuttle
never talks to the Kubernetes API, and its pods mount no token), and the Secrets stay ordinary release objects that
`helm uninstall` removes. The cost: without a cluster to look in (`helm template`, `--dry-run=client`, GitOps tools
that render with `helm template`) every render makes new certificates; use cert-manager or tls.existingSecrets there.
*/}}
{{- define "kvshuttle.tlsGenerated" -}}
{{- if not (hasKey .Values "__kvshuttleTls") -}}
{{- $days := int .Values.tls.helm.validityDays -}}
{{- $caName := include "kvshuttle.tlsSecretName" (list . "ca") -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace $caName -}}
{{- include "kvshuttle.tlsOwnSecret" (list . $old $caName) -}}
{{- $oldData := (and $old $old.data) | default dict -}}
{{- $ca := dict -}}
{{- $caData := dict -}}
{{- if and (index $oldData "tls.crt") (index $oldData "tls.key") -}}
{{- $ca = buildCustomCert (index $oldData "tls.crt") (index $oldData "tls.key") -}}
{{- $caData = dict "ca.crt" (index $oldData "tls.crt") "tls.crt" (index $oldData "tls.crt") "tls.key" (index $oldData "tls.key") -}}
{{- else -}}
{{- $ca = genCA (printf "kvshuttle CA %s/%s" .Release.Namespace .Release.Name) $days -}}
{{- $caData = dict "ca.crt" ($ca.Cert | b64enc) "tls.crt" ($ca.Cert | b64enc) "tls.key" ($ca.Key | b64enc) -}}
{{- end -}}
{{- $out := dict $caName (dict "annotations" (dict "kvshuttle.io/tls-spec" "ca") "data" $caData) -}}
{{- range $role := splitList " " (include "kvshuttle.tlsIdentities" .) -}}
{{- $name := include "kvshuttle.tlsSecretName" (list $ $role) -}}
{{- $dns := include "kvshuttle.tlsDnsNames" (list $ $role) | fromJsonArray -}}
{{- $ips := include "kvshuttle.tlsIpAddresses" (list $ $role) | fromJsonArray -}}
{{- $spec := printf "%s|%s|%s|%d" $role (join "," $dns) (join "," $ips) $days | sha256sum | trunc 16 -}}
{{- $prev := lookup "v1" "Secret" $.Release.Namespace $name -}}
{{- include "kvshuttle.tlsOwnSecret" (list $ $prev $name) -}}
{{- $prevData := (and $prev $prev.data) | default dict -}}
{{- $prevSpec := "" -}}
{{- if and $prev $prev.metadata $prev.metadata.annotations -}}
{{- $prevSpec = index $prev.metadata.annotations "kvshuttle.io/tls-spec" | default "" -}}
{{- end -}}
{{- $data := dict -}}
{{- if and (eq $prevSpec $spec) (eq (index $prevData "ca.crt" | default "") (index $caData "ca.crt")) (index $prevData "tls.crt") (index $prevData "tls.key") -}}
{{- $data = dict "ca.crt" (index $prevData "ca.crt") "tls.crt" (index $prevData "tls.crt") "tls.key" (index $prevData "tls.key") -}}
{{- else -}}
{{- $cert := genSignedCert $role $ips $dns $days $ca -}}
{{- $data = dict "ca.crt" (index $caData "ca.crt") "tls.crt" ($cert.Cert | b64enc) "tls.key" ($cert.Key | b64enc) -}}
{{- end -}}
{{- $_ := set $out $name (dict "annotations" (dict "kvshuttle.io/tls-spec" $spec) "data" $data) -}}
{{- end -}}
{{- $_ := set .Values "__kvshuttleTls" $out -}}
{{- end -}}
{{- end -}}

{{/* Fails when a Secret the chart would make with Helm exists but is not one it made (cert-manager's, after a switch of
tls.source, or one made by hand): Helm could not take it over. Call with (list $ lookedUpSecret name). */}}
{{- define "kvshuttle.tlsOwnSecret" -}}
{{- $ := index . 0 -}}{{- $secret := index . 1 -}}
{{- if $secret -}}
{{- $annotations := (and $secret.metadata $secret.metadata.annotations) | default dict -}}
{{- if not (hasKey $annotations "kvshuttle.io/tls-spec") -}}
{{- fail (printf "Secret %s exists but is not one the chart made with tls.source helm (cert-manager's, or made by hand): delete it (kubectl -n %s delete secret %s) to have Helm make the certificates, or keep tls.source certManager / existing" (index . 2) $.Release.Namespace (index . 2)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Pod annotation value that changes when a pod's certificate does (kvshuttle reads it at start): the source and the
Secret's name, and with Helm-made certificates the certificate itself. Call with (list $ identity).
*/}}
{{- define "kvshuttle.tlsChecksum" -}}
{{- $ := index . 0 -}}{{- $role := index . 1 -}}
{{- $source := include "kvshuttle.tlsSource" $ -}}
{{- if $source -}}
{{- $name := include "kvshuttle.tlsSecretName" . -}}
{{- $cert := "" -}}
{{- if eq $source "helm" -}}
{{- include "kvshuttle.tlsGenerated" $ -}}
{{- $cert = index (index $.Values.__kvshuttleTls $name).data "tls.crt" -}}
{{- end -}}
{{- printf "%s|%s|%s" $source $name $cert | sha256sum | trunc 16 -}}
{{- end -}}
{{- end -}}
