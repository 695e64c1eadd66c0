# syntax=docker/dockerfile:1
# The cloud-side image for the Helm chart in k8s/specedge (its default image.repository is
# "specedge-serve", tag = chart appVersion = this project's version):
#
#   docker build -t REGISTRY/specedge-serve:0.1.0 .
#   docker build --build-arg RAY_VARIANT=py311-cpu -t REGISTRY/specedge-serve:0.1.0-cpu .
#
# Based on the official Ray image, whose Ray version must match the chart's `rayVersion`
# (the chart tests check it). The embedded SmolLM2 target is converted at build time so
# the CPU dev rollout starts without any download; GPU targets come from the models volume.
ARG RAY_VERSION=2.60.0
ARG RAY_VARIANT=py311-gpu
FROM rayproject/ray:${RAY_VERSION}-${RAY_VARIANT}

# torch is not in the Ray image; PyPI's Linux wheel of this version is the CUDA build
ARG TORCH_SPEC=torch==2.13.0

# (DL3064 flags the name TOKENIZERS_PARALLELISM; it holds no secret)
# hadolint ignore=DL3064
ENV SPECEDGE_CACHE_DIR=/home/ray/.cache/specedge \
    TOKENIZERS_PARALLELISM=false \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# HAProxy: the chart's default ingress (serve.requestPath.ingress: haproxy) runs it in front of the
# router replicas (deploy/request_path.py)
USER 0
# (DL3008: the distribution's haproxy; its version follows the base image)
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends haproxy && rm -rf /var/lib/apt/lists/*
# the Ray image's "ray" user
USER 1000

WORKDIR /home/ray/specedge

# dependencies first (this layer survives code-only changes)
COPY --chown=ray:users pyproject.toml README.md ./
# (DL3013: the pin is in TORCH_SPEC, which hadolint cannot see through)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "${TORCH_SPEC}"

COPY --chown=ray:users specdec ./specdec
COPY --chown=ray:users deploy ./deploy
COPY --chown=ray:users edge_agent ./edge_agent
# (DL3013: this installs the project itself; its dependency ranges live in pyproject.toml)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[serve]" \
    && python -m specdec.model.loading

# KubeRay runs `ray start` itself; this only makes `docker run IMAGE` show the usage.
CMD ["serve", "--help"]
