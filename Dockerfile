# gptlaunch training image: a pinned OS base, torch with its CUDA runtime and NCCL wheels pinned, our
# packages from the build context, a non-root user. Build it with `launcher build [--variant cpu|cuda]`
# (progress, the failing step named, versions read back by running the probe inside); by hand:
#   docker build -t gptlaunch:cuda .                                         # CUDA 13.0, NCCL 2.29.7
#   docker build -t gptlaunch:cpu --build-arg VARIANT=cpu --build-arg TORCH_VERSION=2.13.0+cpu \
#       --build-arg NCCL_VERSION= \
#       --build-arg CUDA_VERSION= --build-arg BASE_IMAGE=gptlaunch/debian-base:bookworm .
# By hand, the CPU variant needs torch's CPU wheel in deploy/docker/wheels/ (launcher build stages the
# context in a temporary directory and puts it there itself), and a proxy CA in deploy/docker/certs/ca.crt.
# No CUDA base image is needed: torch's CUDA wheels bring the CUDA runtime; the host brings the driver.

# Python 3.11 on Debian bookworm, by digest (a tag moves; re-pin with `docker buildx imagetools inspect`).
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${BASE_IMAGE} AS deps
# cuda or cpu: which pins file (deploy/docker/pins/) gives torch and its GPU stack.
ARG VARIANT=cuda
# The NCCL wheel for torch's CUDA build (empty for the CPU variant).
ARG NCCL_VERSION=2.29.7
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_INDEX_URL=${PIP_INDEX_URL} \
    PIP_FIND_LINKS=/wheels PYTHONDONTWRITEBYTECODE=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m venv /opt/venv
# A CA bundle (certs/ca.crt) lets pip through a TLS-intercepting proxy; it lives in this stage only.
COPY deploy/docker/certs/ /certs/
COPY deploy/docker/wheels/ /wheels/
COPY deploy/docker/pins/${VARIANT}.txt /tmp/pins.txt
COPY constraints.txt /src/
# The GPU stack first: the biggest layer, rebuilt only when the pins or constraints change; torch's own
# dependencies (sympy, jinja2, setuptools, ...) are pinned by constraints.txt too.
RUN if [ -f /certs/ca.crt ]; then export PIP_CERT=/certs/ca.crt; fi \
 && /opt/venv/bin/pip install -c /src/constraints.txt -r /tmp/pins.txt \
    ${NCCL_VERSION:+"nvidia-nccl-cu13==${NCCL_VERSION}"}
# Then our dependencies and build backend (pinned by constraints.txt), read from pyproject.toml: a code
# edit keeps this layer.
COPY pyproject.toml /src/
RUN if [ -f /certs/ca.crt ]; then export PIP_CERT=/certs/ca.crt; fi \
 && /opt/venv/bin/python -c "import tomllib; t = tomllib.load(open('/src/pyproject.toml', 'rb')); print(*t['project']['dependencies'], *t['build-system']['requires'], sep='\n')" >/tmp/deps.txt \
 && /opt/venv/bin/pip install -c /src/constraints.txt -c /tmp/pins.txt -r /tmp/deps.txt
RUN find /opt/venv -name __pycache__ -prune -exec rm -rf {} +

# Our code as a wheel, in a stage of its own: the final image installs it in a small last layer.
FROM deps AS wheel
COPY README.md /src/
COPY gptlaunch /src/gptlaunch
COPY launcher /src/launcher
COPY trainer /src/trainer
RUN /opt/venv/bin/pip wheel --no-deps --no-index --no-build-isolation --wheel-dir /dist /src

FROM ${BASE_IMAGE}
ARG VARIANT=cuda
ARG TORCH_VERSION=2.13.0
ARG CUDA_VERSION=13.0
ARG NCCL_VERSION=2.29.7
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="gptlaunch" \
      org.opencontainers.image.description="PyTorch distributed GPT trainer and launcher (${VARIANT})" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/gptlaunch/gptlaunch" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.gptlaunch.variant="${VARIANT}" \
      io.gptlaunch.torch.version="${TORCH_VERSION}" \
      io.gptlaunch.cuda.version="${CUDA_VERSION}" \
      io.gptlaunch.nccl.version="${NCCL_VERSION}"
RUN useradd --create-home --uid 1000 --shell /bin/bash trainer
# torch.compile builds C++ at run time (Inductor's CPU kernels, Triton's GPU launchers): a compiler and
# Python's headers (python:*-slim has the headers of its own Python; a Debian python3 needs python3-dev;
# both pinned, hadolint cannot see the pin inside ${dev[@]}).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN include="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
 && dev=() && if [ ! -f "$include/Python.h" ]; then dev=(python3-dev=3.11.2-1+b1); fi \
 && apt-get update \
 && apt-get install -y --no-install-recommends g++=4:12.2.0-3 "${dev[@]}" \
 && rm -rf /var/lib/apt/lists/*
# (before pip runs below: no bytecode of pip itself in the code layer)
ENV PATH=/opt/venv/bin:${PATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# torch, its GPU stack and our dependencies: one big layer that a code edit leaves as it is.
COPY --from=deps /opt/venv /opt/venv
# Our code: a layer of a few hundred kB.
COPY --from=wheel /dist/ /tmp/dist/
RUN /opt/venv/bin/pip install --no-deps --no-index --no-compile --no-cache-dir /tmp/dist/*.whl \
 && rm -rf /tmp/dist
USER trainer
WORKDIR /home/trainer
CMD ["launcher", "--help"]
