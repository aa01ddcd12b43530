# Stand-in for redis:7.2.7-alpine, built where Docker Hub cannot be reached (the compose check builds it
# under that name only when `docker pull` fails): Debian bookworm's redis-server and redis-cli behind an
# entry point that behaves as the official image's (docker-entrypoint.sh): options alone run
# redis-server, the server runs as the redis user in /data, and protected mode is off unless a config
# file or an option sets it (the official image compiles it off), so other containers may connect.
ARG BASE=kvtier-check/debian:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
VOLUME /data
EXPOSE 6379
LABEL org.kvtier.compose-check.stand-in="redis:7.2.7-alpine"
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
