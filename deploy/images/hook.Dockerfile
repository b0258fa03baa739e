# syntax=docker/dockerfile:1
# libvgpu.so, built with gcc alone (libvgpu-hook/build.sh), in a small image whose only job
# is to copy it onto a node (the node agent's init container runs install-hook).
#   docker build -f deploy/images/hook.Dockerfile -t vgpu/hook:0.1.0 .
#
# The hook is preloaded into GPU containers of every distribution, so it is built against an
# old glibc (2.28 on AlmaLinux 8: CUDA images on Ubuntu 20.04+, UBI 8+ and Rocky 8+ load it).
# A newer build image makes a hook those containers cannot load.

ARG BUILD_IMAGE=almalinux:8.10
ARG RUNTIME_IMAGE=busybox:1.37.0

FROM ${BUILD_IMAGE} AS build
# No package versions: the distribution's repositories keep only the current ones, and the
# glibc the hook links against is fixed by BUILD_IMAGE.
# hadolint ignore=DL3041
RUN dnf install -y --setopt=install_weak_deps=False gcc glibc-devel \
    && dnf clean all
COPY libvgpu-hook /src/libvgpu-hook
RUN rm -rf /src/libvgpu-hook/build && sh /src/libvgpu-hook/build.sh

FROM ${RUNTIME_IMAGE}
ARG VGPU_VERSION=0.1.0
LABEL org.opencontainers.image.title="vgpu hook installer" \
      org.opencontainers.image.version="${VGPU_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /src/libvgpu-hook/build/libvgpu.so /opt/vgpu/libvgpu.so
COPY deploy/images/install-hook.sh /usr/local/bin/install-hook
# Root: it writes to host paths (the init container mounts them); it runs for a second.
ENTRYPOINT ["/bin/sh", "/usr/local/bin/install-hook"]
