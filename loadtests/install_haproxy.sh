#!/usr/bin/env bash
# Installs HAProxy from Debian's packages, only if missing, for `--ingress haproxy`
# (RAY_SERVE_ENABLE_HA_PROXY: Serve runs it in front of the router replicas). Idempotent;
# needs root. The Debian service is never started: Serve runs its own haproxy process.
set -euo pipefail
if command -v haproxy >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
had_policy=0
[ -e /usr/sbin/policy-rc.d ] && had_policy=1
if [ "$had_policy" = 0 ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
fi
trap 'if [ "$had_policy" = 0 ]; then rm -f /usr/sbin/policy-rc.d; fi' EXIT
apt-get install -y -q --no-install-recommends haproxy
command -v haproxy >/dev/null
