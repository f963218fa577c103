# The two commands of the README: `make demo` and `make test`. Both set everything up first.
.PHONY: setup demo test lint bench clean

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/a2d run configs/demo.yaml

test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

clean:
	rm -rf a2d-store .pytest_cache
