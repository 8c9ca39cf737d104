# The training image: NVIDIA's PyTorch container (CUDA, NCCL, cuDNN, Transformer Engine and
# Python 3.12, the megatron-core 0.19 stack) with this package installed, not mounted: the
# code a job runs is the image's (launch.slurm.mount_code=true mounts a checkout instead).
# Build it with `make image` (it records the commit and prints the digest to submit with).
ARG BASE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE}
ARG CODE_COMMIT=unknown
WORKDIR /opt/mcore-recipes
COPY pyproject.toml README.md ./
COPY recipes recipes
COPY pretrain pretrain
COPY resiliency resiliency
COPY launch launch
COPY drill drill
COPY bench bench
COPY docker/install.sh docker/install.sh
RUN bash docker/install.sh "${CODE_COMMIT}"
LABEL org.opencontainers.image.revision="${CODE_COMMIT}" \
      org.opencontainers.image.source="mcore-recipes"
# Jobs start in their run dir (mounted by the launchers); nothing here shadows the package.
WORKDIR /workspace
