# Stand-in for python:3.11.13-slim-bookworm, built where Docker Hub cannot be reached (the compose check
# builds it under that name only when `docker pull` fails). Debian bookworm's own CPython 3.11 and pip,
# laid out as the official image lays them out: python, python3, python3.11, pip, pip3 and pip3.11 in
# /usr/local/bin, packages installed by pip under /usr/local, no EXTERNALLY-MANAGED marker.
ARG BASE=kvtier-check/debian:bookworm
FROM ${BASE}
ENV LANG=C.UTF-8 \
    PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates python3 python3-venv python3-pip-whl python3-setuptools-whl python3-wheel-whl \
 && rm -rf /var/lib/apt/lists/* \
 && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED \
 && for name in python python3 python3.11; do ln -sf /usr/bin/python3.11 /usr/local/bin/$name; done \
 && cd /usr/share/python-wheels && pip_whl="$(echo pip-*.whl)" \
 && python3 "$pip_whl/pip" install --no-cache-dir --no-index "$pip_whl" setuptools-*.whl wheel-*.whl \
 && cd / \
 && test -x /usr/local/bin/pip && test -x /usr/local/bin/pip3.11
# Only what this machine needs: the CA of the TLS proxy it reaches PyPI through (the host's bundle, kept
# across any later update-ca-certificates). A user's machine pulls the real image and needs none of it.
COPY host-ca-bundle.crt /usr/local/share/ca-certificates/kvtier-check-host.crt
RUN update-ca-certificates >/dev/null
LABEL org.kvtier.compose-check.stand-in="python:3.11.13-slim-bookworm"
CMD ["python3"]
