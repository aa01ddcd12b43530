# Stand-in for prom/prometheus:v3.1.0, built where Docker Hub cannot be reached (the compose check builds
# it under that name only when `docker pull` fails): Debian bookworm's prometheus (2.42, the same flags
# compose.yaml passes) laid out as the official image: /bin/prometheus as the entry point, run as nobody
# in /prometheus; wget for compose.yaml's healthcheck (the official image has busybox's).
ARG BASE=kvtier-check/debian:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
WORKDIR /prometheus
USER nobody
EXPOSE 9090
VOLUME /prometheus
LABEL org.kvtier.compose-check.stand-in="prom/prometheus:v3.1.0"
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
