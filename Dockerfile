# eaglesrv on an NVIDIA GPU. Build: docker build -t eaglesrv .   Run: see README.md, "Docker".
#
# A CUDA *devel* base, not a runtime one: flashinfer JIT-compiles its attention kernels on
# first use with nvcc and the CUDA headers, and links them against lib64/stubs/libcuda.so
# (-lcudart -lcuda); a runtime image has none of these. Rebuilding that toolchain from apt
# or pip pieces would be a subset nobody has run; devel is what flashinfer is known to
# JIT with, and what SGLang's own image uses. The devel layers cost a few GB of disk, and
# the kernels compile once per container (about a minute), then load from ~/.cache.
# CUDA 12.6 to match the cu126 torch wheels below (PyTorch's longest-kept CUDA 12 build);
# change CUDA_VERSION and TORCH_INDEX_URL together.
ARG CUDA_VERSION=12.6.3
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126

# python3-dev and g++: Triton compiles a small C launcher (it includes Python.h) at run time.
# Not pinned (DL3008): the base image's Ubuntu release fixes them, and exact package
# revisions disappear from Ubuntu's archive when it updates them.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-dev python3-venv g++ \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    CUDA_HOME=/usr/local/cuda \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"

# flashinfer, as measured on an H200 (../shared/DESIGN.md): the three packages without their
# declared dependencies, which would pull cutlass-dsl, cuda-tile, nccl4py, cudnn-frontend
# and another torch; cuda-python is only metadata. Then the small pure-Python packages
# flashinfer imports (pynvml from nvidia-ml-py at import time), within its own bounds
# (DL3013: flashinfer states no pins for them).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --no-deps flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2 \
        cuda-python==12.6.2.post1 \
    && pip install --no-cache-dir nvidia-ml-py "packaging>=24.2" requests click einops tabulate "typing-extensions>=4.13"

# eaglesrv's dependencies and its server extra, read from pyproject.toml alone, so that
# editing the source does not reinstall them.
WORKDIR /opt/eaglesrv
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['server']))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# A non-root user (uid 1000, like most hosts' first user, so a mounted cache stays theirs;
# Ubuntu 24.04 images ship an "ubuntu" user with that uid). Hugging Face models go to its
# home, where `docker run -v ~/.cache/huggingface:...` mounts the host's cache.
ENV HF_HOME=/home/eaglesrv/.cache/huggingface
RUN if id ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
    && useradd --create-home --uid 1000 --shell /bin/bash eaglesrv \
    && install -d -o eaglesrv -g eaglesrv "$HF_HOME"

COPY README.md ./
COPY eaglesrv ./eaglesrv
# The package itself, from the copied source (DL3013 reads ".[server]" as an unpinned name);
# its dependencies are already installed above.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[server]"

# By uid, not name: Kubernetes' runAsNonRoot can only verify a numeric user.
USER 1000:1000
WORKDIR /home/eaglesrv
EXPOSE 30000
# /health answers 503 while the model loads (a hub download can take minutes): failures in
# the start period do not count. No curl in the image: Python's urllib (an HTTP error or a
# refused connection raises, so the exit code is 1).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=8)"]
# The address is in the ENTRYPOINT, not in CMD: arguments after the image name replace CMD,
# and `docker run eaglesrv --model-path ...` must still listen on 0.0.0.0:30000.
ENTRYPOINT ["python", "-m", "eaglesrv.launch", "--host", "0.0.0.0", "--port", "30000"]
# No arguments: the default model (SmolLM2-135M-Instruct), as `python -m eaglesrv.launch` serves it.
CMD []
