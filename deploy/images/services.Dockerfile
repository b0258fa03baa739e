# syntax=docker/dockerfile:1
# The Python services (allocator, node agent, metrics, kubelet simulator): one slim image,
# entry point `vgpu`. Build from the repository root:
#   docker build -f deploy/images/services.Dockerfile -t vgpu/services:0.1.0 .
# Dependencies are installed at the versions pinned in deploy/images/constraints.txt.

ARG PYTHON_VERSION=3.12.8
ARG DEBIAN_RELEASE=bookworm

FROM python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE} AS build
ARG PIP_VERSION=24.3.1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/vgpu \
    && /opt/vgpu/bin/pip install "pip==${PIP_VERSION}"
WORKDIR /src
# Dependencies first, so that a change of our code alone reuses this layer.
COPY deploy/images/constraints.txt /src/constraints.txt
RUN /opt/vgpu/bin/pip install --constraint /src/constraints.txt --requirement /src/constraints.txt
COPY pyproject.toml README.md /src/
COPY services /src/services
# With dependencies: one added to pyproject.toml but not yet pinned still gets installed.
RUN /opt/vgpu/bin/pip install --constraint /src/constraints.txt /src

FROM python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE}
ARG VGPU_VERSION=0.1.0
LABEL org.opencontainers.image.title="vgpu services" \
      org.opencontainers.image.version="${VGPU_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/vgpu /opt/vgpu
ENV PATH=/opt/vgpu/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root by default; the node agent's DaemonSet alone runs it as root (kubelet sockets).
USER 65532:65532
ENTRYPOINT ["vgpu"]
CMD ["--help"]
