#!/bin/sh
# Runs its arguments in a network namespace of their own, where only loopback exists
# (127.0.0.1, ::1): a client under test cannot reach any other address, whatever it
# tries. Where no namespace can be made (not root, no unshare), runs them as they are:
# the clients' telemetry and update checks are turned off by tests/clients/agents.py.
if command -v unshare >/dev/null 2>&1 && unshare -n true 2>/dev/null; then
    exec unshare -n sh -c 'ip link set lo up && exec "$@"' sh "$@"
fi
echo "offline.sh: no network namespace here; running with the clients' own switches only" >&2
exec "$@"
