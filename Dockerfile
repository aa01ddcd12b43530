# The kvtier service image: `kvtier serve` with the CPU, disk and Redis tiers. No vLLM, no torch:
# the service never touches a model, so the image stays small (the connector lives in vLLM's image).
#
#   docker build -t kvtier:local .                # compose.yaml builds it under this name
#   docker run --rm kvtier:local config           # any `kvtier` subcommand (--version, stats, clear...)

# ---- build: a wheel of the repository, so the final image carries no source tree or build tools.
FROM python:3.11.13-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY runtime ./runtime
COPY app ./app
COPY storage ./storage
COPY connector ./connector
COPY bench ./bench
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtime
FROM python:3.11.13-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed uid/gid: compose.yaml mounts the socket and arena tmpfs volumes with uid=10001, and the
# vllm-cpu image runs as the same uid, so owner-only (0600) socket and arena files just work.
RUN groupadd --system --gid 10001 kvtier \
 && useradd --system --uid 10001 --gid kvtier --home-dir /var/lib/kvtier --shell /usr/sbin/nologin kvtier \
 && mkdir -p /run/kvtier /var/lib/kvtier/shm /var/lib/kvtier/disk \
 && chown -R kvtier:kvtier /run/kvtier /var/lib/kvtier \
 && chmod 0700 /run/kvtier /var/lib/kvtier/shm /var/lib/kvtier/disk

# Base dependencies only (no [cpu]/[gpu] extra): pydantic, redis+hiredis, msgspec, prometheus-client...
COPY --from=build /wheels /wheels
RUN pip install /wheels/*.whl && rm -rf /wheels

# Defaults for running the image on its own; compose.yaml sets the same values explicitly.
# /dev/shm is only 64 MiB in a container, so the arena goes to a directory meant for a tmpfs mount.
ENV KVTIER_SERVICE_URL=unix:///run/kvtier/kvtier.sock \
    KVTIER_SHM_DIR=/var/lib/kvtier/shm

USER kvtier
WORKDIR /var/lib/kvtier
# Admin HTTP (/health, /metrics, /stats) when KVTIER_ADMIN_PORT=9400 is set, as compose.yaml does.
EXPOSE 9400
ENTRYPOINT ["kvtier"]
CMD ["serve"]
