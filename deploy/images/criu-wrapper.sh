#!/bin/sh
# /usr/local/bin/criu in the agent image (deploy/images/agent.Containerfile).
#
# CRIU 4.2.1 and the glibc it needs live in a private prefix unpacked from Debian testing;
# the prefix's own dynamic loader runs it with the prefix's libraries, so the rest of the
# image keeps bookworm's. exec keeps the PID and every open file descriptor, so the agent
# can run `criu swrk <fd>` through this wrapper with the RPC socket inherited.
prefix=/opt/warmstart/criu
exec "$prefix/usr/lib64/ld-linux-x86-64.so.2" \
    --library-path "$prefix/usr/lib/x86_64-linux-gnu" \
    "$prefix/usr/sbin/criu" "$@"
