# Training image (first version; the containers issue pins the base by digest and adds `launcher build`).
# Build:  docker build -t gptlaunch:dev .
# Run one node: docker run --gpus all --network host gptlaunch:dev launcher submit --nodes 1 --gpus-per-node 8
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
# PyTorch's CUDA wheel index for the CUDA release of the base image (use a CPU index for CPU images).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /opt/gptlaunch
# Dependencies first (cached layer), then the code.
COPY pyproject.toml constraints.txt README.md ./
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY launcher ./launcher
COPY trainer ./trainer
RUN pip install --no-cache-dir -c constraints.txt .

RUN useradd --create-home --uid 1000 trainer
USER trainer
WORKDIR /home/trainer
LABEL org.opencontainers.image.title="gptlaunch" \
      org.opencontainers.image.description="PyTorch distributed GPT trainer and launcher" \
      io.gptlaunch.torch.version="${TORCH_VERSION}"
CMD ["launcher", "--help"]
