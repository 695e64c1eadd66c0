#!/usr/bin/env bash
# debian_install.sh PACKAGE COMMAND...: installs a Debian package only if one of its COMMANDs is
# missing (Prometheus + promtool for the metrics tests, HAProxy for the haproxy ingress).
# Idempotent; needs root (CI and the dev machines run as root). The package's service is never
# started (policy-rc.d 101): the tests and Serve run their own processes.
set -euo pipefail
pkg=$1; shift
missing=0
for cmd in "$@"; do command -v "$cmd" >/dev/null 2>&1 || missing=1; done
[ "$missing" = 0 ] && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
had_policy=0
[ -e /usr/sbin/policy-rc.d ] && had_policy=1
if [ "$had_policy" = 0 ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
fi
trap 'if [ "$had_policy" = 0 ]; then rm -f /usr/sbin/policy-rc.d; fi' EXIT
apt-get install -y -q --no-install-recommends "$pkg"
for cmd in "$@"; do command -v "$cmd" >/dev/null; done
