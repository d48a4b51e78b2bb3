#!/usr/bin/env bash
# Make sure Debian packages the app or its tests need are installed.
# Usage: ensure_system_deps.sh [--optional] redis-server chromium ...
# Installs missing ones with apt-get when running as root; otherwise says what to
# install and fails (or, with --optional, warns and carries on).
set -euo pipefail
optional=0
if [[ "${1:-}" == "--optional" ]]; then optional=1; shift; fi

# What proves each package is there: a command on PATH, or a path pattern (PostgreSQL's
# server binaries live under /usr/lib/postgresql/<version>/bin, off PATH).
declare -A binary_of=([redis-server]=redis-server [redis-tools]=redis-cli [chromium]=chromium
  [postgresql]='/usr/lib/postgresql/*/bin/initdb' [nginx]=nginx [prometheus]=promtool
  [kubernetes-client]=kubectl)
present() {
  if [[ "$1" == */* ]]; then compgen -G "$1" >/dev/null; else
    command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" ]]; fi
}
missing=()
for pkg in "$@"; do
  present "${binary_of[$pkg]:-$pkg}" || missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
  echo "Installing ${missing[*]} with apt-get..."
  if DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
     || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
    exit 0
  fi
fi

msg="Missing system packages: ${missing[*]}. Install them with: sudo apt-get install -y ${missing[*]}"
if [[ $optional -eq 1 ]]; then
  echo "WARNING: $msg (continuing without them)" >&2
  exit 0
fi
echo "ERROR: $msg" >&2
exit 1
