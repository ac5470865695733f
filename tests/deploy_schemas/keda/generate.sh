#!/bin/sh
# Remakes scaledobject.json (README.md beside it says what it is). Needs npm and the registry.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
npm init -y >/dev/null
npm install --no-audit --no-fund @kubernetes-models/keda@2.0.0 typescript-json-schema@0.68.0
cat > tsconfig.json <<'JSON'
{"compilerOptions": {"strict": true, "module": "nodenext", "moduleResolution": "nodenext",
  "skipLibCheck": true},
 "files": ["node_modules/@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject.d.ts"]}
JSON
npx typescript-json-schema tsconfig.json IScaledObject --required --noExtraProps \
  --strictNullChecks --refs false -o "$here/scaledobject.json"
