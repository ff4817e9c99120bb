#!/usr/bin/env bash
# Build the clipstream image (k8s/images/Dockerfile) with docker buildx, push it, and record the digest the registry
# gave it, so that the release and its training jobs run that exact image (a tag can be pushed over; a digest
# cannot). Writes, under --out:
#   VARIANT.digest       REPOSITORY@sha256:...  (for `clipstream k8s job|stream --image`)
#   VARIANT.values.yaml  image.repository/tag/variant, the tag pinned to the digest (TAG@sha256:...), for
#                        `helm upgrade -f` and `clipstream k8s job|stream --release-values`
# and prints REPOSITORY@sha256:... last. --dry-run prints the commands instead of running them.
#
#   k8s/images/push.sh [--repository REPO] [--version VERSION] [--variant gpu|cpu] [--platform PLATFORM]
#                      [--out DIR] [--dry-run]
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
repository="ghcr.io/clipstream/clipstream"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/pyproject.toml")"
variant="gpu"
platform="linux/amd64"
out="$root/.clipstream/images"
dry_run=""

usage() { sed -n '/^#   k8s/,/^#  *\[--out/s/^#   //p' "${BASH_SOURCE[0]}"; }
die() { echo "push.sh: $1 (see --help)" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --repository|--version|--variant|--platform|--out)
      [ $# -ge 2 ] && [ -n "$2" ] && [[ "$2" != --* ]] || die "$1 needs a value"
      case "$1" in
        --repository) repository="$2" ;; --version) version="$2" ;; --variant) variant="$2" ;;
        --platform) platform="$2" ;; --out) out="$2" ;;
      esac
      shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1'" ;;
  esac
done

case "$variant" in gpu|cpu) ;; *) die "--variant '$variant': gpu or cpu" ;; esac
[[ "$repository" =~ ^[a-z0-9]+([._-]+[a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*$ ]] \
  || die "--repository '$repository': not an image repository (lower case, e.g. ghcr.io/org/clipstream)"
[[ "$version" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,100}$ ]] || die "--version '$version': not usable in an image tag"
tag="$version-$variant"
metadata="$out/$variant.metadata.json"

build=(docker buildx build --platform "$platform" -f "$root/k8s/images/Dockerfile"
       --build-arg "VERSION=$version" --build-arg "VARIANT=$variant"
       --tag "$repository:$tag" --push --metadata-file "$metadata" "$root")
if [ -n "$dry_run" ]; then
  printf '%q ' "${build[@]}"; echo
  echo "# then: $out/$variant.digest and $out/$variant.values.yaml from $metadata (containerimage.digest)"
  exit 0
fi

command -v docker > /dev/null || { echo "push.sh: docker (with buildx) is not installed here" >&2; exit 1; }
mkdir -p "$out"
"${build[@]}"
digest="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["containerimage.digest"])' "$metadata")"
[[ "$digest" =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "push.sh: no digest in $metadata" >&2; exit 1; }
echo "$repository@$digest" > "$out/$variant.digest"
cat > "$out/$variant.values.yaml" <<VALUES
# $repository:$tag as pushed by k8s/images/push.sh
image:
  repository: $repository
  tag: "$tag@$digest"
  variant: $variant
VALUES
echo "$repository@$digest"
