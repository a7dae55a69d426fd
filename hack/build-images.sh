#!/usr/bin/env bash
# Builds the tfps images (operator, ps, worker) from images/*/Dockerfile with buildah, without
# a daemon and without pulling anything, and writes each as a docker-archive under
# $TFPS_CACHE/images/ that containerd can import (hack/load-images.sh).
#
# No public image registry is reachable here, so the bases are local:
# - a Debian bookworm base made once with mmdebstrap (python3.11 + pip), in place of
#   python:3.11.14-slim-trixie (operator, ps);
# - that base + tensorflow-cpu (the version in pyproject's `cpu` extra), a CPU stand-in for
#   tensorflow/tensorflow:2.21.0-gpu (worker).
# The Dockerfiles are the ones `docker build` uses elsewhere; only --build-arg BASE differs.
#
# Cached by content: an image's key hashes its Dockerfile, its base and the build context
# (the repository's files that .dockerignore lets in). An image whose key has an archive is
# not built again; a source change rebuilds only the layers after `COPY . /src/`.
#
# Usage: hack/build-images.sh [--load] [operator|ps|worker ...]
#   --load  then import the archives into containerd (hack/load-images.sh; its socket is
#           $TFPS_CONTAINERD_SOCK, default /run/containerd/containerd.sock)
# Writes $TFPS_CACHE/images/current.json: image name -> ref, tags, archive, image id, size.
set -euo pipefail
export PYTHONSAFEPATH=1  # run from the repository root, its operator/ folder would shadow the stdlib's
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
cache=${TFPS_CACHE:-$HOME/.cache/tfps}
dir="$cache/images"
# pip inside the builds must trust what the host trusts (a TLS-inspecting proxy, say): the
# host's bundle is bind-mounted over the image's for each RUN, never copied into a layer.
ca_bundle=${TFPS_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
suite=bookworm
packages=python3.11,python3-pip,python3-venv,ca-certificates,passwd

load=0
names=()
for a in "$@"; do
  case $a in
    --load) load=1 ;;
    operator|ps|worker) names+=("$a") ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-images: unknown argument: $a" >&2; exit 2 ;;
  esac
done
[ ${#names[@]} -gt 0 ] || names=(operator ps worker)

for tool in buildah mmdebstrap python3 flock; do
  command -v "$tool" >/dev/null || { echo "build-images: $tool is missing (apt-get install buildah mmdebstrap)" >&2; exit 1; }
done
mkdir -p "$dir"
# One build at a time per cache (make images and the cluster script may overlap).
exec 9>"$dir/.lock"
flock 9

step=0; total=$(( ${#names[@]} + 2 ))
progress() { step=$((step + 1)); printf '[build-images %d/%d %s] %s\n' "$step" "$total" "$(date +%T)" "$*"; }
sha() { sha256sum | cut -c1-"${1:-64}"; }
has_image() { buildah inspect --type image "$1" >/dev/null 2>&1; }
bud() {
  local ca=()
  [ -f "$ca_bundle" ] && ca=(-v "$ca_bundle:/etc/ssl/certs/ca-certificates.crt:ro")
  buildah bud --isolation=chroot --pull=never --layers "${ca[@]}" "$@"
}
tmp=$(mktemp -d "$dir/tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

project() {  # the project's version, or its `cpu` extra (the tensorflow-cpu requirement)
  python3 -c 'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(p["version"] if sys.argv[2] == "version" else p["optional-dependencies"]["cpu"][0])' "$root/pyproject.toml" "$1"
}
version=$(project version)
tf_requirement=$(project cpu)

# --- the local Python base: mmdebstrap, then FROM scratch + ADD ------------------------------
base_containerfile='FROM scratch
ADD base.tar /
RUN ln -sf python3 /usr/bin/python && { [ -e /usr/bin/pip ] || ln -s pip3 /usr/bin/pip; }
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PIP_BREAK_SYSTEM_PACKAGES=1
CMD ["python3"]'
hooks=()
[ -d /usr/share/mmdebstrap/hooks/merged-usr ] && hooks=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
mmdebstrap_args=(--variant=minbase "--include=$packages" "${hooks[@]}" "$suite")
base_tar="$dir/base-$suite-$(printf '%s\n' "${mmdebstrap_args[@]}" | sha 12).tar"

progress "base image ($suite, mmdebstrap)"
if [ -f "$base_tar" ] && [ -f "$base_tar.sha256" ]; then
  echo "  cached: $base_tar"
else
  t0=$(date +%s)
  mmdebstrap --quiet "${mmdebstrap_args[@]}" "$base_tar.partial.tar" </dev/null
  mv "$base_tar.partial.tar" "$base_tar"
  sha <"$base_tar" >"$base_tar.sha256"
  echo "  made $base_tar ($(du -m "$base_tar" | cut -f1) MB) in $(( $(date +%s) - t0 )) s"
fi
# The base's identity is its tarball's digest, so a cached image stays valid while the
# tarball does (buildah's storage may be wiped; the base is then imported again).
base_key=$(printf '%s\n%s\n' "$(cat "$base_tar.sha256")" "$base_containerfile" | sha 12)
base_ref="localhost/tfps-base:$base_key"
# shellcheck disable=SC2016 # ${BASE} and ${TF_REQUIREMENT} are buildah's to expand
tf_containerfile='ARG BASE
FROM ${BASE}
ARG TF_REQUIREMENT
RUN python3 -m pip install --no-cache-dir "${TF_REQUIREMENT}"'
tf_key=$(printf '%s\n%s\n%s\n' "$base_key" "$tf_requirement" "$tf_containerfile" | sha 12)
tf_ref="localhost/tfps-tf-cpu-base:$tf_key"

ensure_base() {
  has_image "$base_ref" && return 0
  echo "  importing $base_tar as $base_ref"
  mkdir -p "$tmp/base"
  ln -f "$base_tar" "$tmp/base/base.tar" 2>/dev/null || cp "$base_tar" "$tmp/base/base.tar"
  printf '%s\n' "$base_containerfile" >"$tmp/base/Containerfile"
  bud --quiet -f "$tmp/base/Containerfile" -t "$base_ref" "$tmp/base" >/dev/null
  rm -rf "$tmp/base"
}
ensure_tf_base() {
  has_image "$tf_ref" && return 0
  ensure_base
  echo "  building $tf_ref ($tf_requirement on $base_ref, the stand-in for the GPU base)"
  local t0; t0=$(date +%s)
  mkdir -p "$tmp/tf"
  printf '%s\n' "$tf_containerfile" >"$tmp/tf/Containerfile"
  bud --build-arg "BASE=$base_ref" --build-arg "TF_REQUIREMENT=$tf_requirement" \
    -f "$tmp/tf/Containerfile" -t "$tf_ref" "$tmp/tf"
  echo "  built $tf_ref in $(( $(date +%s) - t0 )) s"
}

# --- the build context: the repository's files that .dockerignore lets in --------------------
progress "build context"
context_key=$(python3 - "$root" "$tmp/context" <<'PY'
# Lists the repository's files (git's tracked and untracked-not-ignored; every file when this is
# no git checkout), keeps those .dockerignore lets in (Docker's rules: patterns in order, the
# last match wins, `!` re-includes, a pattern matching a folder covers what is in it), copies
# them into a throwaway context and prints the digest of its paths, modes and contents.
import hashlib, os, re, shutil, subprocess, sys

root, dest = sys.argv[1], sys.argv[2]
try:
    out = subprocess.run(["git", "-C", root, "ls-files", "-z", "-co", "--exclude-standard"],
                         check=True, capture_output=True).stdout.decode()
    files = [f for f in out.split("\0") if f]
except (OSError, subprocess.CalledProcessError):
    files = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = [s for s in subdirs if s not in (".git", ".venv", ".tfps")]
        files += [os.path.relpath(os.path.join(d, n), root) for n in names]

def regex(pattern):
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out, i = out + "(?:.*/)?", i + 1
            else:
                out += ".*"
            continue
        out += {"*": "[^/]*", "?": "[^/]"}.get(c, re.escape(c) if c != "[" else "[")
        if c == "[":
            j = pattern.index("]", i)
            out += pattern[i + 1:j].replace("!", "^", 1) + "]"
            i = j
        i += 1
    return re.compile(out + r"\Z")

rules = []
ignore = os.path.join(root, ".dockerignore")
if os.path.exists(ignore):
    for line in open(ignore):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((negate, regex(pattern)))

def included(path):
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    keep = True
    for negate, rx in rules:
        if any(rx.match(p) for p in prefixes):
            keep = negate
    return keep

digest = hashlib.sha256()
for f in sorted(files):
    src = os.path.join(root, f)
    if not os.path.isfile(src) or os.path.islink(src) or not included(f):
        continue
    os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
    shutil.copy2(src, os.path.join(dest, f))
    with open(src, "rb") as fh:
        body = hashlib.sha256(fh.read()).hexdigest()
    digest.update(f"{f}\0{os.stat(src).st_mode & 0o777:o}\0{body}\n".encode())
print(digest.hexdigest())
PY
)
echo "  $(find "$tmp/context" -type f | wc -l) files, digest ${context_key:0:12}"

# --- the images -------------------------------------------------------------------------------
build_image() {
  local name=$1 base base_id repo="docker.io/tfps/$1"
  progress "tfps/$name"
  if [ "$name" = worker ]; then base=$tf_ref base_id=$tf_key; else base=$base_ref base_id=$base_key; fi
  local key
  key=$(printf 'tfps-image v1\n%s\n%s\n%s\n%s\n' "$version" "$base_id" "$context_key" \
    "$(sha <"$root/images/$name/Dockerfile")" | sha 12)
  local archive="$dir/tfps-$name-$key.tar"
  if [ -f "$archive" ] && [ -f "$archive.json" ]; then
    echo "  cached: $archive"
    return 0
  fi
  if [ "$name" = worker ]; then ensure_tf_base; else ensure_base; fi
  local t0; t0=$(date +%s)
  # The names containerd will know them by (the chart's `tfps/<name>` is docker.io/tfps/<name>);
  # the archive carries both tags.
  bud --build-arg "BASE=$base" -f "$root/images/$name/Dockerfile" \
    -t "$repo:$version" -t "$repo:$key" "$tmp/context"
  local t1; t1=$(date +%s)
  rm -f "$archive.partial"
  buildah push --quiet "$repo:$key" "docker-archive:$archive.partial:$repo:$version" >/dev/null
  mv "$archive.partial" "$archive"
  local t2; t2=$(date +%s)
  python3 - "$archive" "$name" "$repo" "$version" "$key" "$base" $((t1 - t0)) $((t2 - t1)) <<'PY'
import json, os, sys, tarfile
archive, name, repo, version, key, base, build_s, export_s = sys.argv[1:]
with tarfile.open(archive) as tar:
    manifest = json.load(tar.extractfile("manifest.json"))[0]
    config = manifest["Config"]
    layers = sum(tar.getmember(l).size for l in manifest["Layers"])
image_id = "sha256:" + os.path.basename(config).removeprefix("sha256:").removesuffix(".json")
entry = {"ref": f"{repo}:{version}", "content_ref": f"{repo}:{key}", "tags": [version, key],
         "archive": archive, "image_id": image_id, "size": layers,
         "archive_size": os.path.getsize(archive), "base": base,
         "build_seconds": int(build_s), "export_seconds": int(export_s)}
json.dump(entry, open(archive + ".json", "w"), indent=2)
PY
  echo "  built in $((t1 - t0)) s, exported in $((t2 - t1)) s: $archive ($(du -m "$archive" | cut -f1) MB)"
  # Older archives of this image and its older content tags in buildah's storage go; the
  # layer cache (untagged intermediate images) stays for the next build.
  local old
  for old in "$dir/tfps-$name-"*.tar; do
    [ "$old" = "$archive" ] || rm -f "$old" "$old.json"
  done
  buildah images --format '{{.Name}}:{{.Tag}}' | grep -E "^$repo:[0-9a-f]{12}\$" |
    grep -v ":$key\$" | xargs -r buildah rmi >/dev/null 2>&1 || true
}

for name in "${names[@]}"; do build_image "$name"; done

# current.json: every image that has an archive (also those not named this time).
python3 - "$dir" <<'PY'
import glob, json, os, re, sys
d = sys.argv[1]
current = {}
for meta in sorted(glob.glob(os.path.join(d, "tfps-*-*.tar.json")), key=os.path.getmtime):
    name = re.match(r"tfps-(.+)-[0-9a-f]{12}\.tar\.json$", os.path.basename(meta)).group(1)
    entry = json.load(open(meta))
    if os.path.exists(entry["archive"]):
        current[name] = entry
with open(os.path.join(d, "current.json.partial"), "w") as fh:
    json.dump(current, fh, indent=2)
os.replace(os.path.join(d, "current.json.partial"), os.path.join(d, "current.json"))
for name, e in current.items():
    print(f"  {e['ref']:28} {e['image_id'][:19]}  {e['size'] / 1e6:7.0f} MB  {e['archive']}")
PY
echo "[build-images done $(date +%T)] manifest: $dir/current.json"

if [ "$load" = 1 ]; then
  exec 9>&-
  "$here/load-images.sh" "${names[@]}"
fi
