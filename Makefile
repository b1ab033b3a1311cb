# The two commands a user needs; each creates or updates the virtual environment first.
#   make bench   the main job: Muon vs AdamW side by side on a tiny GPT (CPU, a few minutes)
#   make test    the test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.muonscale-installed
DOCS_STAMP := $(VENV)/.muonscale-docs-installed
TORCH_VERSION ?= 2.13.0

.PHONY: bench test test-megatron test-integrations lint install clean docs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/muonscale bench $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

# Megatron-Core needs Python >= 3.12: its own venv (.venv-megatron, ~5.5 GB, ~2 min to build).
test-megatron:
	bash .ci/megatron_env.sh
	PYTHONPATH=. .venv-megatron/bin/python -m pytest tests/megatron -q -p no:cacheprovider

# Hugging Face / Lightning / torchtitan integrations: their own venv (.venv-integrations, pinned
# in .ci/integrations_env.sh, ~2.5 min to build) and tests (tests/integrations).
test-integrations:
	bash .ci/integrations_env.sh
	PYTHONPATH=. .venv-integrations/bin/python -m pytest tests/integrations -q -p no:cacheprovider

# The docs site (docs/README.md): the [docs] extra into .venv, then site/ built with --strict
# (a broken link, anchor or reference fails).
$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

# Formatting is the tool's: `ruff format .` fixes what `ruff format --check` reports. The docs
# check: list indentation that the site's Markdown renders wrongly (tools/check_markdown_lists.py).
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) tools/check_markdown_lists.py

# The sdist and wheel in dist/ (python -m build), their metadata checked (twine check), then
# the wheel installed with torch alone into a fresh venv and run (tests/test_wheel_install.py).
.PHONY: dist
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*
	MUONSCALE_WHEEL="$$(ls dist/muonscale-*.whl)" TORCH_VERSION=$(TORCH_VERSION) \
		$(PY) -m pytest -q -m slow tests/test_wheel_install.py -p no:cacheprovider

clean:
	rm -rf $(VENV) runs .pytest_cache site
	rm -rf dist build muonscale.egg-info
