"""a2d flows. Importing any of them puts `a2d.flows.run_logs.RefusalLogs` on Prefect's run loggers."""

from a2d.flows.run_logs import install as _install

_install()
