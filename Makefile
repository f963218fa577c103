# The two commands of the README: `make demo` and `make test`. Both set everything up first.
.PHONY: setup demo test lint bench clean

setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/a2d run configs/demo.yaml

# Three workers on two cores: the suite's end-to-end tests spend much of their time waiting on the
# processes and servers they start, which left ~22 % of two workers' core time idle (user+sys 27.4 of
# 35.2 core-min); a third fills it (14.0 min against 17.6, same machine, 2026-12-03).
test: setup
	.venv/bin/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder

lint: setup
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

clean:
	rm -rf a2d-store .pytest_cache
