#!/bin/sh
# The official Redis image's entry point, for the stand-in image (redis.Dockerfile).
set -e
# First argument an option (-f, --some-option) or a config file: run redis-server with them.
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
	set -- redis-server "$@"
fi
if [ "$1" = redis-server ]; then
	# The official image builds Redis with protected mode off; Debian's is on. Turn it off unless a
	# config file (first argument) or an option decides.
	protected=no
	case "${2:-}" in *.conf) protected= ;; esac
	for arg in "$@"; do [ "$arg" = --protected-mode ] && protected=; done
	if [ -n "$protected" ]; then set -- "$@" --protected-mode no; fi
	if [ "$(id -u)" = 0 ]; then
		find . \! -user redis -exec chown redis '{}' +
		exec setpriv --reuid=redis --regid=redis --init-groups "$@"
	fi
fi
um="$(umask)"
if [ "$um" = 0022 ]; then umask 0077; fi
exec "$@"
