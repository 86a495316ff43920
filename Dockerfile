# syntax=docker/dockerfile:1
# deca-ds on GPU machines: CUDA 12.8 (devel: nvcc and a C++ compiler for the ops DeepSpeed compiles on first use),
# Python 3.11 (the lock's), and the same install script CI runs, with the CUDA build of torch.
#   docker build -t deca-ds .
#   docker run --gpus all --ipc=host deca-ds deepspeed --num_gpus 8 launch/train.py --ds_config ds_configs/<preset>.json
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common build-essential \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /deca-ds
# what the install reads (the editable install needs the package itself); the rest comes after. pip's
# download cache is a BuildKit cache mount, so a rebuild after a code change downloads no torch again.
COPY pyproject.toml README.md ./
COPY requirements/ requirements/
COPY launch/install.sh launch/install.sh
COPY deca_ds/ deca_ds/
RUN --mount=type=cache,target=/root/.cache/pip PYTHON=python3.11 bash launch/install.sh --cuda 12.8 --bnb --venv /opt/venv
COPY . .

ENV PATH=/opt/venv/bin:$PATH
CMD ["deepspeed", "--help"]
